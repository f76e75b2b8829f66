#!/usr/bin/env bash
# Seventy-eighth call: the compute pool's workers prewoken for ReTopK's decisions (a tiered step
# wakes one sleeping worker before its launch, which wakes the rest: ThreadPool::Prewake) against
# the build before (kvrecalld-base). Tests first (thread_pool, tiered_shortlist); then 128K
# tiered retopk, batch 1, auto_tau, the default exact search, the binaries alternating three
# times. Bundle: .device/b78.
set -u
tar -C .device/b78 -xJf .device/b78/ship/bundle.tar.xz
B=$PWD/.device/b78/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b78/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d78; mkdir -p $L
S=$OUT/d78_summary.txt
cat /proc/loadavg | tee -a $S
for t in thread_pool_test tiered_shortlist_test; do
  timeout 200 $B/$t --gtest_brief=1 > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -6 | tee -a $S
done
echo "t=$SECONDS tests done" | tee -a $S
n=0
for binary in kvrecalld-base kvrecalld kvrecalld-base kvrecalld kvrecalld-base kvrecalld; do
  n=$((n + 1))
  [ $SECONDS -lt 480 ] || { echo "t=$SECONDS skip $n $binary" | tee -a $S; continue; }
  sleep 2; cat /proc/loadavg | tee -a $S
  start_kvrecalld $B/$binary $L/k$n.log --address=127.0.0.1:0 || continue
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json \
    --placement=tiered --contexts=131072 --batches=1 --selectors=retopk --auto_tau --steps=60 \
    --warmup=8 > /dev/null 2> $L/s$n.log
  echo "rc $?" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], r.get("exact_search"), "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "plan", round(r.get("plan_p50_us",0)), "launch", round(r.get("launch_p50_us",0)), "decide", round(r.get("decide_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "devx", round(r.get("device_exact_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "finish", round(r.get("finish_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step",0),2), "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_concurrency_p50")])' $L/s$n.json "$n $binary" 2>&1 | tee -a $S
done
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/d78.tgz *.json *.log 2>/dev/null
