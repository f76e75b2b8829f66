#!/usr/bin/env bash
# Forty-sixth call: the GPU tests of 3de2a90 (drain a failed step, fences, alignment refused) and
# 5eb11b1 (PqEncode / PqEncodeRows sharing their arithmetic), never run on a device before: every
# cuda_* test, the placements' GPU tests, memcheck of the step I/O, PQ coding and tiered
# shortlist tests; then two served 128K N = 1024 runs of HEAD (retopk auto_tau + index).
set -u
tar -C .device/b46 -xJf .device/b46/ship/bundle.tar.xz
B=$PWD/.device/b46/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b46/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d46; mkdir -p $L
S=$OUT/d46_summary.txt
cat /proc/loadavg | tee -a $S
for t in cuda_device_buffer_test cuda_exact_topk_test cuda_partial_attention_test \
    cuda_pq_encode_test cuda_pq_shortlist_test cuda_retopk_match_test cuda_retopk_test \
    cuda_step_io_test tiered_shortlist_test tiered_placement_test gpu_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
for t in cuda_step_io_test cuda_pq_encode_test tiered_shortlist_test; do
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/$t > $L/memcheck_$t.log 2>&1
  echo "memcheck $t rc $?" | tee -a $S
  grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck_$t.log | head -4 | tee -a $S
done
echo "t=$SECONDS tests done" | tee -a $S
n=0
run() {  # BINARY-NAME SHORTLIST
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 100 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "ss", round(r["static_set_p50_us"]), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us")], "launch", round(r.get("launch_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "paths", {k: (v["heads"], round(v["bulk_p50_us"]), round(v["candidates_mean"])) for k, v in r.get("head_bulk_by_path", {}).items()})' $L/s$n.json "$n $1" 2>&1 | tee -a $S
}
for spec in "kvrecalld 1024" "kvrecalld 1024"; do
  [ $SECONDS -lt 300 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 3
  run $spec
done
echo "t=$SECONDS served done" | tee -a $S
cd $L && tar czf $OUT/d46.tgz *.json *.log
