#!/usr/bin/env bash
# Sixty-fifth call: the pool woken before the launch (2f57f76, cpu::ThreadPool::Wake) against
# 95d221f (kvrecalld-nowake); the CPU stand-in's tests (28923a8) on the GPU machine. Served 128K
# retopk + index, auto_tau, N = 1024: a warm-up, then wake / nowake alternating; 512K wake /
# nowake; then pq_shortlist_bench at 128K for the shortlist kernels' split.
set -u
tar -C .device/b65 -xJf .device/b65/ship/bundle.tar.xz
B=$PWD/.device/b65/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b65/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d65; mkdir -p $L
S=$OUT/d65_summary.txt
cat /proc/loadavg | tee -a $S
for t in tiered_shortlist_test tiered_placement_test thread_pool_test host_exact_heads_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
echo "t=$SECONDS tests done" | tee -a $S
n=0
run() {  # BINARY SHORTLIST CONTEXT SELECTORS
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=$3 --batches=1 --selectors=$4 --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  echo "rc $?" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "devx", round(r.get("device_exact_p50_us",0)), "gate", round(r.get("device_exact_wait_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "plan", round(r.get("plan_p50_us",0)), "launch", round(r.get("launch_p50_us",0)), "decide", round(r.get("decide_p50_us",0)), "fwait", round(r.get("finish_wait_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step"),2), {k:(v["heads"], round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_concurrency_p50")], "build", round(r["build_seconds_max"],3))' $L/s$n.json "$n $1 N=$2" 2>&1 | tee -a $S
  grep -i "error\|pin\|cannot" $L/k$n.log | head -3 | tee -a $S
}
for spec in "kvrecalld 1024 131072 retopk,index" "kvrecalld-nowake 1024 131072 retopk,index" "kvrecalld 1024 131072 retopk,index" "kvrecalld-nowake 1024 131072 retopk,index" "kvrecalld 1024 131072 retopk,index" "kvrecalld-nowake 1024 131072 retopk,index" "kvrecalld 2048 524288 retopk,index" "kvrecalld-nowake 2048 524288 retopk,index"; do
  [ $SECONDS -lt 380 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 2; cat /proc/loadavg | tee -a $S
  run $spec
done
if [ $SECONDS -lt 470 ]; then
  timeout 100 $B/pq_shortlist_bench --context=131072 --shortlists=1024 --graph=false --steps=20 --warmup=3 > $L/pq.json 2> $L/pq.log
  echo "pq rc $?" | tee -a $S; tail -c 1500 $L/pq.json | tee -a $S
fi
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/d65.tgz *.json *.log 2>/dev/null
