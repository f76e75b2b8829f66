#!/usr/bin/env bash
# Written 2026-12-06 (twentieth session) for tiered_serving.md ("Where issue 15's targets
# stand"). Hundred-and-fifty-seventh call, at 7c3bc0d (bundle .device/b156): issue 15's
# comparison on one machine in one call: the tiered rows (retopk, index) at 128K and 512K, the
# gpu placement's (retopk, full: the whole KV on the GPU) at the same contexts, both served by
# one kvrecalld over loopback gRPC, and in-process PyTorch SDPA (and torch top-K) on the same
# shapes. Carry .device/b156/ship and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 156  # the bundle of d156; this call's logs and summary under its own number
N=157 L=/tmp/d157 S=$OUT/d157_summary.txt R=/tmp/d157/out
mkdir -p "$R"
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
start_kvrecalld "$B/kvrecalld" "$L/kvrecalld_gpu.log" --address=127.0.0.1:0 || exit 1
timeout 240 "$B/gpu_serving_bench" --server="$kvrecalld_address" --out="$L/gpu.json" \
  --placement=gpu --contexts=131072,524288 --batches=1 --selectors=retopk,full --auto_tau \
  --steps=100 --warmup=8 > /dev/null 2> "$L/gpu.log"
echo "gpu rows rc $? t=$SECONDS" | tee -a "$S"
serving_summary "$L/gpu.json"
steps_tail "$L/gpu.json"
cp "$L/gpu.json" "$OUT/gpu_rows.json"
kill "$kvrecalld_pid"
wait "$kvrecalld_pid" 2>/dev/null
timeout 120 python3 bench/cuda_torch_baseline.py --contexts=131072,524288 --batches=1 \
  --out="$OUT/torch_baseline.json" > "$L/torch.log" 2>&1
echo "torch rc $? t=$SECONDS" | tee -a "$S"
tail -12 "$L/torch.log" | tee -a "$S"
device_call_end
