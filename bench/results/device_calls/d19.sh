#!/usr/bin/env bash
# Nineteenth call: the reuse heads start while the shortlists are computed (they need none; ordered first).
# the static set's). Tests on the GPU tier, then tiered 128K retopk auto_tau and index with
# N = 1024, 2048 and the graph, one kvrecalld.
set -u
tar -C .device/b12 -xJf .device/b12/ship/bundle.tar.xz
B=$PWD/.device/b12/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b12/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d19; mkdir -p $L
for t in tiered_shortlist_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $OUT/d19_summary.txt
  grep -E "PASSED|FAILED|Failure" $L/$t.log | head -6 | tee -a $OUT/d19_summary.txt
done
start_kvrecalld $B/kvrecalld $L/k.log --address=127.0.0.1:0 || exit 1
n=0
for f in 1024 2048 0 1024 2048; do
  n=$((n + 1))
  timeout 100 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau --steps=40 --warmup=5 --shortlist=$f > /dev/null 2> $L/s$n.log
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "ss", round(r["static_set_p50_us"]), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "build", round(r["build_seconds_max"],3))' $L/s$n.json "$n shortlist=$f" 2>&1 | tee -a $OUT/d19_summary.txt
done
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
cd $L && tar czf $OUT/d19.tgz *.json *.log
