#!/usr/bin/env bash
# Twenty-seventh call: d26 again after its fixes (the scan kernel's shared-memory opt-in counts
# its static shared memory; the selection's collect kernel is instantiated in one translation
# unit; the misfit test's buffers hold what its successful runs read). GPU tests; memcheck of
# both PQ tests; the kernels alone (pq_shortlist_bench, base = 63b9e81's kernel, alternated,
# 128K and 512K); tiered 128K retopk auto_tau + index served, base (63b9e81) and new
# alternated, N = 1024 and 2048; 512K index N = 2048 base and new (their builds); a build
# phase trace (kvrecalld-trace: the new one with timing lines on stderr, not committed).
set -u
tar -C .device/b20 -xJf .device/b20/ship/bundle.tar.xz
B=$PWD/.device/b20/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b20/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d27; mkdir -p $L
S=$OUT/d27_summary.txt
for t in cuda_pq_shortlist_test cuda_pq_encode_test cuda_exact_topk_test cuda_retopk_test index_batch_topk_test tiered_shortlist_test tiered_placement_test gpu_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
for t in cuda_pq_shortlist_test cuda_pq_encode_test; do
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/$t > $L/memcheck_$t.log 2>&1; echo "memcheck $t rc $?" | tee -a $S
  grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck_$t.log | head -4 | tee -a $S
done
echo "t=$SECONDS tests done" | tee -a $S
kern() {  # BINARY TAG FLAGS...
  local bin=$1 tag=$2; shift 2
  timeout 150 $B/$bin "$@" > $L/$tag.json 2> $L/$tag.log; echo "$tag rc $?" | tee -a $S
  python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
print(sys.argv[2], "train_s", d.get("pq_train_s"), "encode_s", d.get("pq_encode_s"))
for name, v in d["variants"].items():
  print(sys.argv[2], name, {k: round(v[k]["p50"], 2) for k in ("total_us","gpu_us","gpu_kernels_us","gpu_select_alone_us","host_us","recall_at_k") if k in v})' $L/$tag.json $tag 2>&1 | tee -a $S
}
K128="--context=131072 --graph=false --shortlists=1024,2048 --steps=40 --warmup=4"
kern pq_shortlist_bench_base kb1 $K128
kern pq_shortlist_bench kn1 $K128
kern pq_shortlist_bench_base kb2 $K128
kern pq_shortlist_bench kn2 $K128
K512="--context=524288 --graph=false --shortlists=2048 --steps=16 --warmup=2"
kern pq_shortlist_bench_base kb512 $K512
kern pq_shortlist_bench kn512 $K512
echo "t=$SECONDS kernels done" | tee -a $S
n=0
run() {  # BINARY-NAME SHORTLIST [CONTEXT SELECTORS]
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=${3:-131072} --batches=1 --selectors=${4:-retopk,index} --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "build", round(r["build_seconds_max"],3), "gpuB", r["session_gpu_bytes"])' $L/s$n.json "$n $1 N=$2" 2>&1 | tee -a $S
  grep -i "captured\|error" $L/k$n.log | head -3 | tee -a $S
}
for spec in "kvrecalld-base 1024" "kvrecalld 1024" "kvrecalld-base 2048" "kvrecalld 2048" "kvrecalld 1024" "kvrecalld-base 1024" "kvrecalld-base 2048 524288 index" "kvrecalld 2048 524288 index"; do
  [ $SECONDS -lt 480 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  run $spec
done
run kvrecalld-trace 2048 131072 index
grep TRACE $L/k$n.log | head -8 | tee -a $S
echo "t=$SECONDS served done" | tee -a $S
cd $L && tar czf $OUT/d27.tgz *.json *.log
