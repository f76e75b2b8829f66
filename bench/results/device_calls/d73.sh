#!/usr/bin/env bash
# Seventy-third call: the current build's whole table for issue 15 in one call. Tiered retopk
# (auto_tau) and index with the PQ shortlist (N = 1024 up to 128K, 2048 from 256K) at 16K-512K
# batch 1 and 128K batch 8, the `gpu` placement (whole KV on the GPU) at 128K and 512K, then
# tiered retopk at 1M, all on one kvrecalld; then the kernels alone and in-process PyTorch SDPA.
# Bundle: .device/lead (kvrecalld, gpu_serving_bench, cuda_decode_bench), as
# bench/placement_device_run.sh expects.
set -u
S=$OUT/d73_summary.txt
cat /proc/loadavg | tee -a $S
export SERVING_TIMEOUT=200
export TORCH_FLAGS="--contexts=16384,65536,131072,262144,524288 --batches=1,8"
export KERNEL_FLAGS="--contexts=131072,524288 --batches=1,8"
export SERVING_RUNS="--placement=tiered --contexts=16384,65536,131072 --batches=1 --selectors=retopk,index --auto_tau --shortlist=1024 --steps=60 --warmup=8
--placement=tiered --contexts=262144,524288 --batches=1 --selectors=retopk,index --auto_tau --shortlist=2048 --steps=60 --warmup=8
--placement=tiered --contexts=131072 --batches=8 --selectors=retopk,index --auto_tau --shortlist=1024 --steps=30 --warmup=5
--placement=gpu --contexts=131072,524288 --batches=1 --selectors=retopk,full --auto_tau --steps=60 --warmup=8
--placement=tiered --contexts=1048576 --batches=1 --selectors=retopk --auto_tau --shortlist=4096 --steps=40 --warmup=5"
bash bench/placement_device_run.sh kernels serving > $OUT/d73_run.txt 2>&1
echo "rc $?" | tee -a $S
echo "t=$SECONDS" | tee -a $S
for f in $OUT/gpu_serving_*.json; do
  python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
for r in d["records"]: print(sys.argv[1].split("/")[-1], r.get("placement", d.get("placement")), r["context"], r["batch"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), round(r["e2e_p99_us"]), "static", round(r.get("static_set_p50_us",0)), "devx", round(r.get("device_exact_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r.get("bulk_p50_us",0)), "decide", round(r.get("decide_p50_us",0)), "finish", round(r.get("finish_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step",0),2), r.get("path_mix"), "gpuB", r.get("session_gpu_bytes"), "hostB", r.get("session_host_bytes"), "build", round(r.get("build_seconds_max",0),3))' $f 2>&1 | tee -a $S
done
grep -E "sdpa|SDPA|torch" -i $OUT/d73_run.txt | tail -20 | tee -a $S
