set -u
R=$(pwd)
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/before .before >/dev/null 2>&1 || echo "before install failed"
git log -1 --format=%h 2>/dev/null; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
cd /tmp
for i in 1 2; do
  PYTHONPATH=/tmp/before:/tmp/site timeout 100 python3 $R/benchmarks/compare_trees.py --label before >> $OUT/compare.jsonl 2>>$OUT/compare.err
  timeout 100 python3 $R/benchmarks/compare_trees.py --label after >> $OUT/compare.jsonl 2>>$OUT/compare.err
done
python3 - <<'P'
import json, collections, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/compare.jsonl")]
d = collections.defaultdict(lambda: collections.defaultdict(list))
for r in rows: d[r["case"]][r["label"]].append(r["us"])
for c, v in d.items(): print(f"{c:42s} before {v['before']} after {v['after']}")
print({r["label"]: r["source"] for r in rows if "source" in r})
P
cd $R
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist loadfile tests > $OUT/gpu_suite.log 2>&1; echo "suite rc=$?"; tail -5 $OUT/gpu_suite.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite.log | head -20
for c in "demo --tokens 8" "demo --quant fp8 --tokens 8" "bench" "resolve" "probe"; do
  timeout 90 python3 -m moe_triton $c > "$OUT/cli_${c%% *}_$(echo $c | tr -c 'a-z0-9' _).log" 2>&1; echo "cli '$c' rc=$?"
done
tail -4 $OUT/cli_demo_demo___quant_fp8___tokens_8_.log
