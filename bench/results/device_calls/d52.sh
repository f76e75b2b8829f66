#!/usr/bin/env bash
# Fifty-second call: (1) pcie_gather_bench, the host's keys read by a GPU kernel over PCIe
# (mapped) against device memory, a contiguous copy and the host's 16 threads, and a step's
# heads split between them, at 128K and 512K; (2) d51 again with the fixed host_gather_bench
# (the pool woken before every timed pass): a KV group's union scored once, shares 0.7 and 0.96;
# (3) served tiered at 512K, index and retopk auto_tau (N = 2048), after a 128K warm-up, on a
# quiet host (d49's 512K retopk ran on a busy one). All from fc30691 (+ the new bench).
set -u
tar -C .device/b52 -xJf .device/b52/ship/bundle.tar.xz
B=$PWD/.device/b52/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b52/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d52; mkdir -p $L
S=$OUT/d52_summary.txt
cat /proc/loadavg | tee -a $S
nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv | tee -a $S
for t in 131072 524288; do
  timeout 120 $B/pcie_gather_bench --tokens=$t > $OUT/d52_pcie_$t.json 2> $L/pcie_$t.err
  echo "pcie tokens $t rc $?" | tee -a $S
  cat $L/pcie_$t.err | tee -a $S
done
echo "t=$SECONDS pcie done" | tee -a $S
for share in 0.7 0.96; do
  timeout 90 $B/host_gather_bench --tokens=131072 --threads=1,4,8,16 --steps=30 --warmup=4 \
    --group_union=$share > $OUT/d52_union_$share.json 2> $L/union_$share.err
  echo "share $share rc $?" | tee -a $S
  cat $L/union_$share.err | tee -a $S
done
echo "t=$SECONDS union done" | tee -a $S
n=0
run() {  # SHORTLIST CONTEXT SELECTORS
  n=$((n + 1))
  start_kvrecalld $B/kvrecalld $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=$2 --batches=1 --selectors=$3 --auto_tau --steps=40 --warmup=5 --shortlist=$1 > /dev/null 2> $L/s$n.log
  echo "rc $?" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), round(r["e2e_p99_us"]), "ss", round(r["static_set_p50_us"]), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), {k:(v["heads"], round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_busy_p50_us","heads_concurrency_p50")], "launch", round(r.get("launch_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "build", round(r["build_seconds_max"],3), "gpuB", r["session_gpu_bytes"])' $L/s$n.json "$n N=$1" 2>&1 | tee -a $S
  grep -i "error" $L/k$n.log | head -3 | tee -a $S
}
for spec in "1024 131072 index" "2048 524288 index,retopk"; do
  [ $SECONDS -lt 330 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 2
  cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS served done" | tee -a $S
cd $L && tar czf $OUT/d52.tgz *.json *.log *.err
