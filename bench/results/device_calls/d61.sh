#!/usr/bin/env bash
# Sixty-first call: the balance with a clean wait signal (Finish queries the stream before it
# synchronizes: a step the device had finished is no wait). tiered_shortlist_test; served
# tiered retopk + index auto_tau at 128K (N = 1024): a warm-up, then balanced / fixed 0.5 /
# fixed 0.5 / balanced; 512K (N = 2048): balanced / none / fixed 0.5. One binary.
set -u
tar -C .device/b61 -xJf .device/b61/ship/bundle.tar.xz
B=$PWD/.device/b61/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b61/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d61; mkdir -p $L
S=$OUT/d61_summary.txt
cat /proc/loadavg | tee -a $S
for t in tiered_shortlist_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/tiered_shortlist_test --gtest_filter='*Balanced*:*ReTopKsExact*' > $L/memcheck.log 2>&1
echo "memcheck rc $?" | tee -a $S
grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck.log | head -4 | tee -a $S
echo "t=$SECONDS tests done" | tee -a $S
n=0
run() {  # MODE SHORTLIST CONTEXT SELECTORS
  n=$((n + 1))
  case $1 in
    balanced) flags="--tiered_gpu_exact_balance=true --tiered_gpu_exact_share=0.75";;
    fixed) flags="--tiered_gpu_exact_balance=false --tiered_gpu_exact_share=0.5";;
    none) flags="--tiered_gpu_exact_share=0";;
  esac
  start_kvrecalld $B/kvrecalld $L/k$n.log --address=127.0.0.1:0 $flags || return 1
  timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=$3 --batches=1 --selectors=$4 --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  echo "rc $?" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "devx", round(r.get("device_exact_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "devheads", round(r.get("device_exact_heads_per_step"),2), {k:(v["heads"], round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_concurrency_p50")], "launch", round(r.get("launch_p50_us",0)), "build", round(r["build_seconds_max"],3))' $L/s$n.json "$n $1 N=$2" 2>&1 | tee -a $S
  grep -i "error\|pin\|cannot" $L/k$n.log | head -3 | tee -a $S
}
for spec in "balanced 1024 131072 retopk,index" "balanced 1024 131072 retopk,index" "fixed 1024 131072 retopk,index" "fixed 1024 131072 retopk,index" "balanced 1024 131072 retopk,index" "balanced 2048 524288 retopk,index" "none 2048 524288 retopk,index" "fixed 2048 524288 retopk,index"; do
  [ $SECONDS -lt 440 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 2; cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/d61.tgz *.json *.log 2>/dev/null
