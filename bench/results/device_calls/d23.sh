#!/usr/bin/env bash
# Twenty-third call: the tiered GPU tier's step captured in a CUDA graph (the upload, the
# shortlists with their lengths in the upload and launches planned for a bucketed bound, the
# static sets, the downloads, the events), replayed every step; the new codes placed after it.
# Tests on the GPU (and memcheck of the shortlist test); tiered 128K retopk auto_tau + index:
# base (56c208f), new, new with --cuda_graphs=false, alternated, N = 1024, 2048, the graph; 512K
# index N = 2048 base/new.
set -u
tar -C .device/b16 -xJf .device/b16/ship/bundle.tar.xz
B=$PWD/.device/b16/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b16/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d23; mkdir -p $L
S=$OUT/d23_summary.txt
for t in tiered_shortlist_test tiered_placement_test gpu_placement_test backend_seam_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -6 | tee -a $S
done
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/tiered_shortlist_test --gtest_filter='*Grow*:*InFlight*' > $L/memcheck.log 2>&1; echo "memcheck tiered_shortlist_test rc $?" | tee -a $S
grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck.log | head -4 | tee -a $S
n=0
run() {  # BINARY-NAME SHORTLIST CONTEXT SELECTORS [SERVER FLAG]
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 ${5:-} || return 1
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=$3 --batches=1 --selectors=$4 --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "build", round(r["build_seconds_max"],3), "gpuB", r["session_gpu_bytes"])' $L/s$n.json "$n $1 N=$2 ${5:-}" 2>&1 | tee -a $S
  grep -i "captured\|error" $L/k$n.log | head -3 | tee -a $S
}
for spec in "kvrecalld-base 1024" "kvrecalld 1024" "kvrecalld 1024 131072 retopk,index --cuda_graphs=false" "kvrecalld-base 2048" "kvrecalld 2048" "kvrecalld 2048 131072 retopk,index --cuda_graphs=false" "kvrecalld-base 0" "kvrecalld 0" "kvrecalld 1024" "kvrecalld-base 1024"; do
  set -- $spec
  run $1 $2 ${3:-131072} ${4:-retopk,index} ${5:-}
done
run kvrecalld-base 2048 524288 index
run kvrecalld 2048 524288 index
cd $L && tar czf $OUT/d23.tgz *.json *.log
