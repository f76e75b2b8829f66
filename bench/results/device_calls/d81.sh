#!/usr/bin/env bash
# Eighty-first call: SmallBudgetTest (now pinned to no GPU) on the H200 machine, then the
# comparison-sorted TopKPositions for ReTopK's neighbors (0328b5e, kvrecalld) against 1485ed4
# (kvrecalld-base, d79's) served: 128K tiered retopk, batch 1, auto_tau, the default exact
# search, alternating twice. Bundle: .device/b81.
set -u
tar -C .device/b81 -xJf .device/b81/ship/bundle.tar.xz
B=$PWD/.device/b81/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b81/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d81; mkdir -p $L
S=$OUT/d81_summary.txt
timeout 120 $B/service_hardening_test --gtest_brief=1 --gtest_filter='SmallBudget*' > $L/hardening.log 2>&1
echo "service_hardening_test SmallBudget* rc $?" | tee -a $S
grep -E "PASSED|FAILED|Failure" $L/hardening.log | head -5 | tee -a $S
n=0
for binary in kvrecalld-base kvrecalld kvrecalld-base kvrecalld; do
  n=$((n + 1))
  [ $SECONDS -lt 200 ] || { echo "t=$SECONDS skip $n $binary" | tee -a $S; continue; }
  cat /proc/loadavg | tee -a $S
  start_kvrecalld $B/$binary $L/k$n.log --address=127.0.0.1:0 || continue
  timeout 100 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json \
    --placement=tiered --contexts=131072 --batches=1 --selectors=retopk --auto_tau --steps=60 \
    --warmup=8 > /dev/null 2> $L/s$n.log
  echo "rc $?" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "plan", round(r.get("plan_p50_us",0)), "decide", round(r.get("decide_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "finish", round(r.get("finish_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step",0),2), r.get("path_mix"))' $L/s$n.json "$n $binary" 2>&1 | tee -a $S
done
echo "t=$SECONDS all done" | tee -a $S
