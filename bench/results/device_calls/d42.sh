#!/usr/bin/env bash
# Forty-second call: d41's bundle again on the warm machine, to settle what d41 left open with
# one pair each: 512K index N = 2048 new / base (0f05a29) BAAB, and 128K index N = 1024
# new / d40's build ABBA. No tests (d41 ran them on this bundle).
set -u
tar -C .device/b41 -xJf .device/b41/ship/bundle.tar.xz
B=$PWD/.device/b41/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b41/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d42; mkdir -p $L
S=$OUT/d42_summary.txt
cat /proc/loadavg | tee -a $S
echo "t=$SECONDS tests done" | tee -a $S
n=0
run() {  # BINARY-NAME SHORTLIST [CONTEXT SELECTORS BATCHES]
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=${3:-131072} --batches=${5:-1} --selectors=${4:-retopk,index} --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], "b", r.get("batch"), r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_busy_p50_us","heads_concurrency_p50")], "launch", round(r.get("launch_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "build", round(r["build_seconds_max"],3), "gpuB", r["session_gpu_bytes"])' $L/s$n.json "$n $1 N=$2" 2>&1 | tee -a $S
  grep -i "error\|host" $L/k$n.log | head -3 | tee -a $S
}
for spec in "kvrecalld-base 2048 524288 index" "kvrecalld 2048 524288 index" "kvrecalld 2048 524288 index" "kvrecalld-base 2048 524288 index" "kvrecalld-d40 1024 131072 index" "kvrecalld 1024 131072 index" "kvrecalld 1024 131072 index" "kvrecalld-d40 1024 131072 index"; do
  [ $SECONDS -lt 400 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 5
  cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS served done" | tee -a $S
cd $L && tar czf $OUT/d42.tgz *.json *.log
