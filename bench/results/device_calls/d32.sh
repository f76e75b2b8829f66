#!/usr/bin/env bash
# Thirty-second call: the new bulk rows coded by QueueNewCodes after Start returned (d31's build
# coded them at the end of Start, which the waiting heads still waited for), with the reply's
# launch and shortlists_ready; against b23's kvrecalld (coding before the launches), alternated
# three times at 128K N = 1024, once at N = 2048 and 512K. The host's load is printed first.
set -u
tar -C .device/b25 -xJf .device/b25/ship/bundle.tar.xz
B=$PWD/.device/b25/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b25/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d32; mkdir -p $L
S=$OUT/d32_summary.txt
cat /proc/loadavg | tee -a $S
for t in tiered_shortlist_test tiered_placement_test gpu_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
echo "t=$SECONDS tests done" | tee -a $S
n=0
run() {  # BINARY-NAME SHORTLIST [CONTEXT SELECTORS]
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=${3:-131072} --batches=1 --selectors=${4:-retopk,index} --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_busy_p50_us","heads_concurrency_p50")], "launch", round(r.get("launch_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "build", round(r["build_seconds_max"],3), "gpuB", r["session_gpu_bytes"])' $L/s$n.json "$n $1 N=$2" 2>&1 | tee -a $S
  grep -i "error\|host" $L/k$n.log | head -3 | tee -a $S
}
for spec in "kvrecalld 1024" "kvrecalld-base 1024" "kvrecalld 1024" "kvrecalld-base 1024" "kvrecalld 1024" "kvrecalld-base 1024" "kvrecalld 2048" "kvrecalld-base 2048" "kvrecalld 2048 524288 index" "kvrecalld-base 2048 524288 index"; do
  cat /proc/loadavg | tee -a $S
  [ $SECONDS -lt 500 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  run $spec
done
echo "t=$SECONDS served done" | tee -a $S
cd $L && tar czf $OUT/d32.tgz *.json *.log
