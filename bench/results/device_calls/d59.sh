#!/usr/bin/env bash
# Fifty-ninth call: ReTopK's exact-path heads on the GPU (Decide before the step, up to half the
# heads, supports back into the caches) and the host KV's page size (b13155d). Tests (the new
# ReTopK device test, the widened AShortShortlists comparison), memcheck on both; served tiered
# retopk + index auto_tau at 128K (N = 1024): a warm-up, then --tiered_gpu_exact_share 0.5 / 0 /
# 0 / 0.5; pcie_gather_bench --huge_pages=both at 512K and 128K; 512K retopk 0.5 / 0 if time.
set -u
tar -C .device/b59 -xJf .device/b59/ship/bundle.tar.xz
B=$PWD/.device/b59/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b59/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d59; mkdir -p $L
S=$OUT/d59_summary.txt
cat /proc/loadavg /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag | tee -a $S
for t in tiered_shortlist_test tiered_codes_test tiered_placement_test gpu_placement_test host_memory_test service_kv_store_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/tiered_shortlist_test --gtest_filter='*ReTopKsExactPaths*:*AShortShortlists*' > $L/memcheck.log 2>&1
echo "memcheck rc $?" | tee -a $S
grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck.log | head -4 | tee -a $S
echo "t=$SECONDS tests done" | tee -a $S
n=0
run() {  # SHARE SHORTLIST CONTEXT SELECTORS
  n=$((n + 1))
  start_kvrecalld $B/kvrecalld $L/k$n.log --address=127.0.0.1:0 --tiered_gpu_exact_share=$1 || return 1
  timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=$3 --batches=1 --selectors=$4 --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  echo "rc $?" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "devx", round(r.get("device_exact_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "devheads", r.get("device_exact_heads_per_step"), "mix", {k:round(v,3) for k,v in r.get("path_mix",{}).items()}, {k:(v["heads"], round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_busy_p50_us","heads_concurrency_p50")], "launch", round(r.get("launch_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "build", round(r["build_seconds_max"],3), "gpuB", r["session_gpu_bytes"])' $L/s$n.json "$n share=$1 N=$2" 2>&1 | tee -a $S
  grep -i "error\|pin\|cannot" $L/k$n.log | head -3 | tee -a $S
}
for spec in "0.5 1024 131072 retopk,index" "0.5 1024 131072 retopk,index" "0 1024 131072 retopk,index" "0 1024 131072 retopk,index" "0.5 1024 131072 retopk,index"; do
  [ $SECONDS -lt 330 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 2; cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS served 128K done" | tee -a $S
p=0
for t in 524288 131072; do
  [ $SECONDS -lt 420 ] || { echo "t=$SECONDS skip pcie $t" | tee -a $S; continue; }
  p=$((p + 1))
  timeout 120 $B/pcie_gather_bench --tokens=$t --huge_pages=both --gpu_heads=8 --split_heads=0,16 > $OUT/d59_pcie_${p}_$t.json 2> $L/pcie_${p}_$t.err
  echo "pcie $p tokens $t rc $?" | tee -a $S
  grep -E "^host pages|^pages|gpu  8|split 16" $L/pcie_${p}_$t.err | tee -a $S
done
for spec in "0.5 2048 524288 retopk" "0 2048 524288 retopk"; do
  [ $SECONDS -lt 470 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 2; cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/d59.tgz *.json *.log *.err 2>/dev/null
