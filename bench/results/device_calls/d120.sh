#!/usr/bin/env bash
# Run 2026-12-05 (twelfth session): tiered_serving.md ("Targets").
# Hundred-and-twentieth call: issue 15's headline rows (tiered retopk and index, batch 1, 60
# steps, 128K and 512K) with a4e6522's kvrecalld on a machine where nothing ran before them
# (the session's other rows came after the suite and take-over runs).
# Bundle: .device/b120 (kvrecalld, gpu_serving_bench). Carry .device/b120/ship.
set -u
. bench/device_call.sh
device_call_begin 120
R=$L/out
mkdir -p $R
tiered_rows $B/kvrecalld 131072 524288
mv $OUT/*.json $R/ 2>/dev/null
tar -C $L -czf $OUT/d120_out.tgz out
device_call_end
