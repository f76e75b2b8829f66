#!/usr/bin/env bash
# Twenty-ninth call: the PQ shortlist's parity test under compute-sanitizer memcheck after its
# misfit case stopped writing its outputs over its inputs (d28 found the second successful run
# reading codebooks at the first run's ids as sets), and whether the build ran on the GPU.
set -u
tar -C .device/b22 -xJf .device/b22/ship/bundle.tar.xz
B=$PWD/.device/b22/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b22/bundle/lib
S=$OUT/d29_summary.txt
# The build's GPU paths: kvrecalld says once on stderr when the training or the prompt's coding
# falls back to the host; one 128K index session with N = 1024 (its build time).
. scripts/kvrecalld.sh
start_kvrecalld $B/kvrecalld /tmp/k.log --address=127.0.0.1:0 && {
  timeout 100 $B/gpu_serving_bench --server=$kvrecalld_address --out=$OUT/d29_s1.json --placement=tiered --contexts=131072 --batches=1 --selectors=index --steps=10 --warmup=2 --shortlist=1024 > /dev/null 2> /tmp/s.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print("served", r["selector"], "srv", round(r["server_p50_us"]), "shortlist", round(r.get("shortlist_p50_us",0)), "build", round(r["build_seconds_max"],3))' $OUT/d29_s1.json | tee -a $S
  echo "kvrecalld stderr:" | tee -a $S; cat /tmp/k.log | tee -a $S
}
timeout 60 $B/cuda_pq_shortlist_test > /tmp/t.log 2>&1; echo "cuda_pq_shortlist_test rc $?" | tee -a $S
grep -E "PASSED|FAILED" /tmp/t.log | head -4 | tee -a $S
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/cuda_pq_shortlist_test > /tmp/m.log 2>&1; echo "memcheck cuda_pq_shortlist_test rc $?" | tee -a $S
grep -E "ERROR SUMMARY|PASSED|FAILED" /tmp/m.log | head -4 | tee -a $S
