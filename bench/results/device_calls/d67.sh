#!/usr/bin/env bash
# Sixty-seventh call: 6c0753c, the review's mends. Tests on the device: the new
# gpu_exact_heads_test (the GPU tier's failure paths), tiered_shortlist, tiered_placement (the new
# finish / reserve fields), step_io, gpu_placement; memcheck on gpu_exact_heads_test. Then served
# 128K retopk + index three times and 512K once, one binary, for the time outside the bulk.
set -u
tar -C .device/b67 -xJf .device/b67/ship/bundle.tar.xz
B=$PWD/.device/b67/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b67/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d67; mkdir -p $L
S=$OUT/d67_summary.txt
cat /proc/loadavg | tee -a $S
for t in gpu_exact_heads_test tiered_shortlist_test tiered_placement_test cuda_step_io_test gpu_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/tiered_shortlist_test --gtest_filter='*Balanced*:*ReTopKsExact*' > $L/memcheck.log 2>&1
echo "memcheck rc $?" | tee -a $S
grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck.log | head -4 | tee -a $S
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 $B/gpu_exact_heads_test > $L/memcheck_io.log 2>&1
echo "memcheck step_io rc $?" | tee -a $S
grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck_io.log | head -4 | tee -a $S
echo "t=$SECONDS tests done" | tee -a $S
n=0
run() {  # BINARY SHORTLIST CONTEXT SELECTORS
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=$3 --batches=1 --selectors=$4 --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  echo "rc $?" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "devx", round(r.get("device_exact_p50_us",0)), "gate", round(r.get("device_exact_wait_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "plan", round(r.get("plan_p50_us",0)), "launch", round(r.get("launch_p50_us",0)), "decide", round(r.get("decide_p50_us",0)), "fwait", round(r.get("finish_wait_p50_us",0)), "finish", round(r.get("finish_p50_us",0)), "reserve", round(r.get("reserve_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step"),2), {k:(v["heads"], round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_concurrency_p50")], "build", round(r["build_seconds_max"],3))' $L/s$n.json "$n $1 N=$2" 2>&1 | tee -a $S
  grep -i "error\|pin\|cannot" $L/k$n.log | head -3 | tee -a $S
}
for spec in "kvrecalld 1024 131072 retopk,index" "kvrecalld 1024 131072 retopk,index" "kvrecalld 1024 131072 retopk,index" "kvrecalld 2048 524288 retopk,index"; do
  [ $SECONDS -lt 400 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 2; cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/d67.tgz *.json *.log 2>/dev/null
