#!/usr/bin/env bash
# Fifty-sixth call: the GPU's exact heads after d55's mends (a step's reports are written once
# the tier's Finish brought the device heads' candidates; tier_micros.device_exact apart from
# static_set). Tests, memcheck on the served test; served tiered index at 128K (N = 1024) with
# --tiered_gpu_exact_share 0.5 / 0.375 / 0 / 0 / 0.375 / 0.5 after a warm-up, then 512K
# (N = 2048) 0.5 / 0.375 / 0. One binary: the share is the only difference.
set -u
tar -C .device/b56 -xJf .device/b56/ship/bundle.tar.xz
B=$PWD/.device/b56/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b56/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d56; mkdir -p $L
S=$OUT/d56_summary.txt
cat /proc/loadavg | tee -a $S
for t in tiered_shortlist_test tiered_codes_test tiered_placement_test gpu_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/tiered_shortlist_test --gtest_filter='*HalfTheHeads*:*AShortlistAsLong*' > $L/memcheck.log 2>&1
echo "memcheck rc $?" | tee -a $S
grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck.log | head -4 | tee -a $S
echo "t=$SECONDS tests done" | tee -a $S
n=0
run() {  # SHARE SHORTLIST CONTEXT
  n=$((n + 1))
  start_kvrecalld $B/kvrecalld $L/k$n.log --address=127.0.0.1:0 --tiered_gpu_exact_share=$1 || return 1
  timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=$3 --batches=1 --selectors=index --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  echo "rc $?" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), round(r["e2e_p99_us"]), "ss", round(r["static_set_p50_us"]), "devx", round(r.get("device_exact_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "devheads", r.get("device_exact_heads_per_step"), {k:(v["heads"], round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_busy_p50_us","heads_concurrency_p50")], "ready", round(r.get("shortlists_ready_p50_us",0)), "build", round(r["build_seconds_max"],3), "gpuB", r["session_gpu_bytes"])' $L/s$n.json "$n share=$1 N=$2" 2>&1 | tee -a $S
  grep -i "error\|pin\|cannot" $L/k$n.log | head -3 | tee -a $S
}
for spec in "0.5 1024 131072" "0.5 1024 131072" "0.375 1024 131072" "0 1024 131072" "0 1024 131072" "0.375 1024 131072" "0.5 1024 131072" "0.5 2048 524288" "0.375 2048 524288" "0 2048 524288"; do
  [ $SECONDS -lt 400 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 2
  cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS served done" | tee -a $S
cd $L && tar czf $OUT/d56.tgz *.json *.log
