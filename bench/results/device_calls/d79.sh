#!/usr/bin/env bash
# Seventy-ninth call: issue 15's table at the final code (1485ed4) with the default policy (the
# exact search unset: the GPU shortlist of N = 2K), one kvrecalld: tiered retopk (auto_tau) and
# index, batch 1 and 8 at 16K-128K, batch 1 at 256K-512K; the `gpu` placement at 128K and 512K;
# then in-process PyTorch SDPA (bench/cuda_torch_baseline.py) in the same call. Bundle:
# .device/b79 (kvrecalld, gpu_serving_bench).
set -u
tar -C .device/b79 -xJf .device/b79/ship/bundle.tar.xz
B=$PWD/.device/b79/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b79/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d79; mkdir -p $L
S=$OUT/d79_summary.txt
cat /proc/loadavg | tee -a $S
start_kvrecalld $B/kvrecalld $L/kvrecalld.log --address=127.0.0.1:0 || exit 1
n=0
run() {  # LATEST_START FLAG...
  n=$((n + 1))
  local latest=$1
  shift
  [ $SECONDS -lt $latest ] || { echo "t=$SECONDS skip $n $*" | tee -a $S; return; }
  cat /proc/loadavg | tee -a $S
  timeout 260 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json "$@" \
    > /dev/null 2> $L/s$n.log
  echo "$n rc $? t=$SECONDS: $*" | tee -a $S
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r.get("placement"), r["context"], r["batch"], r["selector"], r.get("exact_search"), r.get("effective_shortlist"), "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), round(r["e2e_p99_us"]), "static", round(r.get("static_set_p50_us",0)), "devx", round(r.get("device_exact_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r.get("bulk_p50_us",0)), "decide", round(r.get("decide_p50_us",0)), "finish", round(r.get("finish_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step",0),2), r.get("path_mix"), "gpuB", r.get("session_gpu_bytes"), "hostB", r.get("session_host_bytes"), "build", round(r.get("build_seconds_max",0),3))' $L/s$n.json "$n" 2>&1 | tee -a $S
}
run 300 --placement=tiered --contexts=16384,65536,131072 --batches=1,8 --selectors=retopk,index --auto_tau --steps=30 --warmup=5
run 380 --placement=tiered --contexts=262144,524288 --batches=1 --selectors=retopk,index --auto_tau --steps=40 --warmup=5
run 470 --placement=gpu --contexts=131072,524288 --batches=1 --selectors=retopk,full --auto_tau --steps=40 --warmup=5
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
if [ $SECONDS -lt 530 ]; then
  PYTHONUNBUFFERED=1 timeout 60 python3 bench/cuda_torch_baseline.py --out=$OUT/cuda_decode_torch.json \
    --contexts=16384,65536,131072,262144,524288 --batches=1,8 > $L/torch.log 2>&1
  echo "torch rc $? t=$SECONDS" | tee -a $S
  grep -E "sdpa" $L/torch.log | tail -12 | tee -a $S
fi
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/d79.tgz *.json *.log 2>/dev/null
