set -u
R=$(pwd)
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/before .before >/dev/null 2>&1
python3 - <<'P'
import torch
from moe_triton.routing import route, route_torch, RoutingSpec
for E, K in ((8, 2), (128, 8)):
    spec = RoutingSpec(K, renormalize=True)
    bad_ref = bad_jit = 0
    for seed in range(40):
        g = torch.Generator(device="cuda").manual_seed(seed)
        logits = torch.randn(4096, E, device="cuda", generator=g)
        a, _ = route(logits, spec)          # may be the JIT path (first call of this signature) or direct
        a2, _ = route(logits.clone(), spec)  # the direct path
        b, _ = route_torch(logits, spec)
        bad_jit += int((a != a2).any(1).sum())
        rows = (a2.sort(1).values != b.sort(1).values.int()).any(1).nonzero().flatten().tolist()
        bad_ref += len(rows)
        for r in rows[:2]:
            p = logits[r].softmax(-1)
            top = p.topk(K + 1)
            print(f"E={E} seed={seed} row={r} ours={sorted(a2[r].tolist())} ref={sorted(b[r].tolist())} "
                  f"probs={top.values.tolist()} ids={top.indices.tolist()}")
    print(f"E={E} K={K}: rows differing from route_torch {bad_ref} of {40*4096}; JIT vs direct {bad_jit}")
P
cd /tmp
for i in 1 2 3; do
  PYTHONPATH=/tmp/before:/tmp/site timeout 100 python3 $R/benchmarks/compare_trees.py --label before >> $OUT/compare.jsonl 2>>$OUT/compare.err
  timeout 100 python3 $R/benchmarks/compare_trees.py --label after >> $OUT/compare.jsonl 2>>$OUT/compare.err
done
python3 - <<'P'
import json, collections, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/compare.jsonl")]
d = collections.defaultdict(lambda: collections.defaultdict(list))
for r in rows: d[r["case"]][r["label"]].append(r["us"])
for c, v in d.items(): print(f"{c:42s} before {v['before']} after {v['after']}")
P
cd $R
for i in 1 2; do timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pipeline.py -k "test_stages_bf16" 2>&1 | tail -2; done
export XDG_CACHE_HOME=/tmp/cache; python3 -m moe_triton demo --tokens 2 >/dev/null 2>&1; D=$(ls -d /tmp/cache/moe-triton/*/ | grep -v fp8 | head -1)
for c in "resolve $D" "probe triton"; do timeout 90 python3 -m moe_triton $c > $OUT/cli_$(echo $c | cut -c1-5).log 2>&1; echo "cli '$c' rc=$?"; done
ls /tmp/cache/moe-triton/ 2>&1 | head
