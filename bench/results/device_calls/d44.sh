#!/usr/bin/env bash
# Forty-fourth call: the captured step without event or copy nodes on the static sets' side
# (cuda::StampTime stamps the step's times on the device's clock, cuda::CopyByKernel uploads the
# pinned input and downloads the pinned output; the shortlists keep their ids' copy and event).
# With the review's mends (rows marked coded once queued, outliers before the error words, NaN
# distances ordered as the scan orders them). GPU tests (the step I/O test and the tiered
# shortlist test also under memcheck); served 128K
# N = 1024 retopk auto_tau + index, new / d41's build (7326f4a) ABBAAB with pauses, as time allows.
set -u
tar -C .device/b44 -xJf .device/b44/ship/bundle.tar.xz
B=$PWD/.device/b44/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b44/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d44; mkdir -p $L
S=$OUT/d44_summary.txt
cat /proc/loadavg | tee -a $S
for t in cuda_step_io_test cuda_pq_encode_test tiered_shortlist_test tiered_placement_test gpu_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
for t in cuda_step_io_test tiered_shortlist_test; do
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/$t > $L/memcheck_$t.log 2>&1; echo "memcheck $t rc $?" | tee -a $S
  grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck_$t.log | head -4 | tee -a $S
done
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
for spec in "kvrecalld 1024" "kvrecalld-d41 1024" "kvrecalld-d41 1024" "kvrecalld 1024" "kvrecalld 1024" "kvrecalld-d41 1024"; do
  [ $SECONDS -lt 300 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 5
  cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS served done" | tee -a $S
cd $L && tar czf $OUT/d44.tgz *.json *.log
