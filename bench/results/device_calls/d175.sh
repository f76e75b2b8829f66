#!/usr/bin/env bash
# Written 2026-12-07 (twenty-ninth session). Hundred-and-seventy-fifth call, at 7777b7d (the
# step's code as d165's, c3304d4): issue 15's whole benchmark again, replacing d79's (1485ed4,
# before the step's changes of d80-d165). One kvrecalld: tiered retopk (auto_tau) and index at
# 16K-128K batch 1 and 8, 256K and 512K batch 1 (100 steps), the `gpu` placement at 128K and
# 512K, in-process PyTorch SDPA in the same call, then as time allows tiered 1M batch 1, tiered
# 256K batch 8 and the `gpu` placement at 1M. Bundle .device/b175 (kvrecalld,
# gpu_serving_bench); carry its ship/.
set -u
. bench/device_call.sh
device_call_begin 175
start_kvrecalld "$B/kvrecalld" "$L/kvrecalld.log" --address=127.0.0.1:0 || exit 1
n=0
run() {  # LATEST_START TIMEOUT FLAG...
  n=$((n + 1))
  local latest=$1 limit=$2
  shift 2
  [ $SECONDS -lt "$latest" ] || { echo "t=$SECONDS skip $n $*" | tee -a "$S"; return; }
  cat /proc/loadavg | tee -a "$S"
  timeout "$limit" "$B/gpu_serving_bench" --server="$kvrecalld_address" --out="$R/s$n.json" \
    "$@" > /dev/null 2> "$L/s$n.log"
  echo "$n rc $? t=$SECONDS: $*" | tee -a "$S"
  [ -s "$R/s$n.json" ] && serving_summary "$R/s$n.json"
}
common="--auto_tau --warmup=8"
run 120 200 --placement=tiered --contexts=16384,65536,131072 --batches=1,8 \
  --selectors=retopk,index --steps=40 $common
run 260 150 --placement=tiered --contexts=262144,524288 --batches=1 --selectors=retopk,index \
  --steps=100 $common
run 360 120 --placement=gpu --contexts=131072,524288 --batches=1 --selectors=retopk,full \
  --steps=100 $common
if [ $SECONDS -lt 400 ]; then
  PYTHONUNBUFFERED=1 timeout 60 python3 bench/cuda_torch_baseline.py \
    --out="$R/torch_baseline.json" --contexts=16384,65536,131072,262144,524288,1048576 \
    --batches=1,8 > "$L/torch.log" 2>&1
  echo "torch rc $? t=$SECONDS" | tee -a "$S"
  grep -E "sdpa" "$L/torch.log" | tail -12 | tee -a "$S"
fi
run 440 100 --placement=tiered --contexts=1048576 --batches=1 --selectors=retopk,index \
  --steps=60 $common
run 500 60 --placement=gpu --contexts=1048576 --batches=1 --selectors=full --steps=60 $common
run 510 70 --placement=tiered --contexts=262144 --batches=8 --selectors=index --steps=40 $common
kill "$kvrecalld_pid"
wait "$kvrecalld_pid" 2>/dev/null
echo "t=$SECONDS all done" | tee -a "$S"
tar -C "$R" -czf "$OUT/d175_raw.tgz" . 2>/dev/null
device_call_end
