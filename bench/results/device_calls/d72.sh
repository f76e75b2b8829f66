#!/usr/bin/env bash
# Seventy-second call: the shortlist's faster kernels (255e84c) and the reuse heads ahead of the
# outliers' chunks in a tiered step's loop (kvrecalld) against ad59b66 (kvrecalld-base, d71's),
# and the pool's workers polling for 400 us between steps (--compute_spin_us=400) against the
# default 100 (the client's round trip is ~200 us). Tests first; then 128K retopk + index,
# batch 1, auto_tau, N = 1024, the binaries alternating.
set -u
tar -C .device/b72 -xJf .device/b72/ship/bundle.tar.xz
B=$PWD/.device/b72/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b72/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d72; mkdir -p $L
S=$OUT/d72_summary.txt
cat /proc/loadavg | tee -a $S
for t in tiered_shortlist_test tiered_placement_test gpu_exact_heads_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -6 | tee -a $S
done
echo "t=$SECONDS tests done" | tee -a $S
n=0
run() {  # BINARY CONTEXT SHORTLIST [SERVER FLAG...]
  n=$((n + 1))
  local binary=$1 context=$2 shortlist=$3
  shift 3
  start_kvrecalld $B/$binary $L/k$n.log --address=127.0.0.1:0 "$@" || return 1
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=$context --batches=1 --selectors=retopk,index --auto_tau --steps=40 --warmup=5 --shortlist=$shortlist > /dev/null 2> $L/s$n.log
  echo "rc $?" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "devx", round(r.get("device_exact_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "plan", round(r.get("plan_p50_us",0)), "launch", round(r.get("launch_p50_us",0)), "decide", round(r.get("decide_p50_us",0)), "fwait", round(r.get("finish_wait_p50_us",0)), "finish", round(r.get("finish_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step"),2), {k:(v["heads"], round(v["bulk_p50_us"])) for k,v in r["head_bulk_by_path"].items()}, "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_concurrency_p50")])' $L/s$n.json "$n $binary $*" 2>&1 | tee -a $S
}
for spec in "kvrecalld-base" "kvrecalld" "kvrecalld --compute_spin_us=400" "kvrecalld-base" "kvrecalld" "kvrecalld --compute_spin_us=400" "kvrecalld-base --compute_spin_us=400"; do
  [ $SECONDS -lt 420 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 2; cat /proc/loadavg | tee -a $S
  set -- $spec
  b=$1; shift
  run $b 131072 1024 "$@"
done
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/d72.tgz *.json *.log 2>/dev/null
