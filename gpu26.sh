set -u
R=$(pwd)
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/before .before >/dev/null 2>&1 || echo "before install failed"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
cd /tmp
for i in 1 2 3; do
  PYTHONPATH=/tmp/before:/tmp/site timeout 100 python3 $R/benchmarks/compare_trees.py --label before >> $OUT/compare.jsonl 2>>$OUT/compare.err
  timeout 100 python3 $R/benchmarks/compare_trees.py --label after >> $OUT/compare.jsonl 2>>$OUT/compare.err
done
python3 - <<'P'
import json, collections, os, statistics as st
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/compare.jsonl")]
d = collections.defaultdict(lambda: collections.defaultdict(list))
for r in rows: d[r["case"]][r["label"]].append(r["us"])
for c, v in d.items():
    b, a = v["before"], v["after"]
    print(f"{c:40s} before {b} after {a} median ratio {st.median(a)/st.median(b):.3f}")
print({r["label"]: r["source"] for r in rows if "source" in r})
P
cd $R
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist loadfile tests > $OUT/gpu_suite.log 2>&1; echo "suite rc=$?"; tail -2 $OUT/gpu_suite.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite.log | head -20
export XDG_CACHE_HOME=/tmp/cache
for c in "demo --tokens 8" "demo --quant fp8 --tokens 8" "bench"; do
  timeout 90 python3 -m moe_triton $c > "$OUT/cli_$(echo $c | tr -c 'a-z0-9' _).log" 2>&1; echo "cli '$c' rc=$?"
done
D=$(ls -d /tmp/cache/moe-triton/*/ | grep -v fp8 | head -1)
for c in "resolve $D" "probe torch triton"; do timeout 90 python3 -m moe_triton $c > $OUT/cli_$(echo $c | cut -c1-5).log 2>&1; echo "cli '$c' rc=$?"; done
tail -3 $OUT/cli_demo___quant_fp8___tokens_8_.log; tail -3 $OUT/cli_resol.log; tail -3 $OUT/cli_probe.log
