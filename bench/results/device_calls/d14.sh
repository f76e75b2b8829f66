#!/usr/bin/env bash
# Fourteenth call: policy.index.shortlist served. Its tests on the GPU tier, then the tiered
# 128K step with the shortlist (N = 1024, 2048) against the graph (default), retopk auto_tau and
# index, one kvrecalld, runs alternated; then 512K retopk auto_tau, shortlist 2048 vs the graph.
set -u
tar -C .device/b12 -xJf .device/b12/ship/bundle.tar.xz
B=$PWD/.device/b12/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b12/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d14; mkdir -p $L
for t in cuda_pq_shortlist_test tiered_shortlist_test tiered_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $OUT/d14_summary.txt
  grep -E "PASSED|FAILED|Failure" $L/$t.log | head -8 | tee -a $OUT/d14_summary.txt
done
summary() {
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "mix", r.get("path_mix"), "build", round(r["build_seconds_max"],3), "gpu_bytes", r.get("session_gpu_bytes"))' $1 "$2" 2>&1 | tee -a $OUT/d14_summary.txt
}
start_kvrecalld $B/kvrecalld $L/k.log --address=127.0.0.1:0 || exit 1
n=0
for f in 2048 0 1024 2048 0 1024; do
  n=$((n + 1))
  timeout 100 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau --steps=40 --warmup=5 --shortlist=$f > /dev/null 2> $L/s$n.log
  summary $L/s$n.json "$n shortlist=$f"
done
for f in 2048 0; do
  n=$((n + 1))
  timeout 150 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=524288 --batches=1 --selectors=retopk --auto_tau --steps=40 --warmup=5 --shortlist=$f > /dev/null 2> $L/s$n.log
  summary $L/s$n.json "$n shortlist=$f"
done
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
cd $L && tar czf $OUT/d14.tgz *.json *.log
