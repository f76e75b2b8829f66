#!/usr/bin/env bash
# Twenty-second call: on top of d21, fewer driver calls before the shortlists are ready (no
# shortlist_begin event, the shortlists' error word checked with the static sets', the step's new
# codes placed after the shortlists, which scan the rows coded before). Tests on the GPU tier;
# tiered 128K retopk auto_tau + index: base (56c208f), new, and new with the static tier started
# before the heads (serial), alternated, N = 1024, 2048, the graph; 512K index N = 2048 base/new.
set -u
tar -C .device/b15 -xJf .device/b15/ship/bundle.tar.xz
B=$PWD/.device/b15/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b15/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d22; mkdir -p $L
S=$OUT/d22_summary.txt
for t in tiered_shortlist_test tiered_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -6 | tee -a $S
done
n=0
run() {  # BINARY-NAME SHORTLIST CONTEXT SELECTORS
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=$3 --batches=1 --selectors=$4 --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "build", round(r["build_seconds_max"],3), "gpuB", r["session_gpu_bytes"])' $L/s$n.json "$n $1 N=$2" 2>&1 | tee -a $S
}
for spec in "kvrecalld-base 1024" "kvrecalld 1024" "kvrecalld-serial 1024" "kvrecalld-base 2048" "kvrecalld 2048" "kvrecalld-serial 2048" "kvrecalld-base 0" "kvrecalld 0" "kvrecalld-serial 0" "kvrecalld 1024" "kvrecalld-serial 1024" "kvrecalld-base 1024"; do
  run $spec 131072 retopk,index
done
run kvrecalld-base 2048 524288 index
run kvrecalld 2048 524288 index
cd $L && tar czf $OUT/d22.tgz *.json *.log
