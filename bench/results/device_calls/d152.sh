#!/usr/bin/env bash
# Written 2026-12-06 (nineteenth session) for device_tests.md and tiered_serving.md.
# Hundred-and-fifty-second call, at 3dfc503 (uploads that a non-blocking stream reads wait until
# their bytes land): (1) cuda_step_io_test 30 times over (d151 failed it once); (2) the whole
# suite; (3) issue 15's rows at 512K, 100 steps. Bundle .device/b152; carry its ship/ and
# client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 152
passes=0
for i in $(seq 30); do
  "$B/cuda_step_io_test" > "$L/step_io_$i.log" 2>&1 && passes=$((passes + 1))
done
echo "cuda_step_io_test: $passes of 30 runs pass" | tee -a "$S"
bash bench/device_test_suite.sh $B $L $S
rows_steps=100 tiered_rows "$B/kvrecalld" 524288
device_call_end
