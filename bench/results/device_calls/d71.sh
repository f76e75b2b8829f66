#!/usr/bin/env bash
# Seventy-first call: ReTopK's caches keep their byte count (ad59b66, kvrecalld) against 6c0753c
# (kvrecalld-before): tiered_shortlist_test, then retopk at 128K batch 8 (before / after) and
# batch 1 (after / before / after), auto_tau, N = 1024.
set -u
tar -C .device/b71 -xJf .device/b71/ship/bundle.tar.xz
B=$PWD/.device/b71/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b71/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d71; mkdir -p $L
S=$OUT/d71_summary.txt
cat /proc/loadavg | tee -a $S
timeout 200 $B/tiered_shortlist_test > $L/t.log 2>&1; echo "tiered_shortlist_test rc $?" | tee -a $S; $B/retopk_selector_test 2>&1 | tail -1 | tee -a $S
grep -E "PASSED|FAILED|Failure" $L/t.log | head -5 | tee -a $S
n=0
run() {  # BINARY BATCH
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=131072 --batches=$2 --selectors=retopk --auto_tau --steps=40 --warmup=5 --shortlist=1024 > /dev/null 2> $L/s$n.log
  echo "rc $?" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["batch"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "devx", round(r.get("device_exact_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "plan", round(r.get("plan_p50_us",0)), "decide", round(r.get("decide_p50_us",0)), "fwait", round(r.get("finish_wait_p50_us",0)), "finish", round(r.get("finish_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step"),2))' $L/s$n.json "$n $1" 2>&1 | tee -a $S
}
for spec in "kvrecalld-before 8" "kvrecalld 8" "kvrecalld 1" "kvrecalld-before 1" "kvrecalld 1"; do
  [ $SECONDS -lt 400 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 2; cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/d71.tgz *.json *.log 2>/dev/null
