#!/usr/bin/env bash
# Twentieth call: the GPU tier's step without pageable copies or stream-wide syncs (new codes in
# the packed upload, error words downloaded with the outputs), and the blocked PQ assignment.
# Tests on the GPU tier; then tiered 128K retopk auto_tau + index, base (HEAD 56c208f) and new
# kvrecalld alternated, N = 1024, 2048 and the graph; a phase-traced new kvrecalld last.
set -u
tar -C .device/b13 -xJf .device/b13/ship/bundle.tar.xz
B=$PWD/.device/b13/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b13/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d20; mkdir -p $L
S=$OUT/d20_summary.txt
nproc | tee -a $S
for t in product_quantizer_test cuda_pq_shortlist_test tiered_shortlist_test tiered_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -6 | tee -a $S
done
n=0
run() {  # BINARY-NAME SHORTLIST
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 150 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "build", round(r["build_seconds_max"],3))' $L/s$n.json "$n $1 N=$2" 2>&1 | tee -a $S
  grep PHASES $L/k$n.log | tail -3 | tee -a $S
}
for spec in "kvrecalld-base 1024" "kvrecalld 1024" "kvrecalld-base 2048" "kvrecalld 2048" "kvrecalld-base 0" "kvrecalld 0" "kvrecalld 1024" "kvrecalld-base 1024" "kvrecalld-trace 1024" "kvrecalld-trace 0"; do
  run $spec
done
cd $L && tar czf $OUT/d20.tgz *.json *.log
