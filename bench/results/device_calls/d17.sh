#!/usr/bin/env bash
# Seventeenth call: the shortlist's prefill after its serial parts went parallel (the k-means
# centroid update per codebook, the outliers' reconstruction errors): tiered 128K index build
# and step, N = 2048 against the graph, one kvrecalld; the shortlist's tests on the GPU tier.
set -u
tar -C .device/b12 -xJf .device/b12/ship/bundle.tar.xz
B=$PWD/.device/b12/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b12/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d17; mkdir -p $L
timeout 200 $B/tiered_shortlist_test > $L/tiered_shortlist_test.log 2>&1; echo "tiered_shortlist_test rc $?" | tee -a $OUT/d17_summary.txt
start_kvrecalld $B/kvrecalld $L/k.log --address=127.0.0.1:0 || exit 1
n=0
for f in 2048 0 2048; do
  n=$((n + 1))
  timeout 100 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=131072 --batches=1 --selectors=index --steps=40 --warmup=5 --shortlist=$f > /dev/null 2> $L/s$n.log
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "build", round(r["build_seconds_max"],3), "gpu_bytes", r.get("session_gpu_bytes"))' $L/s$n.json "$n shortlist=$f" 2>&1 | tee -a $OUT/d17_summary.txt
done
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
cd $L && tar czf $OUT/d17.tgz *.json *.log
