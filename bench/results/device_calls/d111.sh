#!/usr/bin/env bash
# Run 2026-12-05 on an H100 machine: pq_encode.md, tiered_serving.md.
# Hundred-and-eleventh call (eleventh session, 2026-12-05): where the GPU tier's coding of a few
# bulk rows should switch from one PqEncodeRows launch to a PqEncode launch per KV head. d110's
# take-over (under the shim) coded 1020 rows by rows and its errors' download waited 3.5 ms
# under the shim,
# where d108's ~500 rows took ~0.65 ms of reserve in all.
#   1. bench/pq_encode_bench: both kernels' device time at 8 to 2048 rows (8 KV heads, d = 128,
#      M = 8, bf16), and the jobs' upload.
#   2. d98's take-over run with the session's kvrecalld, without the shim.
# Bundle: .device/b111 (pq_encode_bench, kvrecalld, gpu_serving_bench). Carry: .device/b111/ship.
set -u
. bench/device_call.sh
device_call_begin 111
timeout 120 $B/pq_encode_bench > $OUT/pq_encode_d111.json 2> $L/pq_encode.log
echo "pq_encode_bench rc $?" | tee -a $S
cat $L/pq_encode.log | tee -a $S
takeover_run final $B/kvrecalld
device_call_end
