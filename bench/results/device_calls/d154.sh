#!/usr/bin/env bash
# Written 2026-12-06 (nineteenth session) for device_tests.md. Hundred-and-fifty-fourth call:
# gpu_placement_test with GpuBudgetTest.ARequestTheGpuRefusesInItsStepAppendsNoToken (new: a
# cpu + gpu request whose batch workspace the GPU budget refuses in the Step appends no token),
# and tiered_placement_test. Bundle .device/b154 (those two tests); carry its ship/.
# Not run in the nineteenth session: no device time was left to start a machine. The next
# session runs it (or the whole suite, which holds the test).
set -u
. bench/device_call.sh
device_call_begin 154
for t in gpu_placement_test tiered_placement_test; do
  "$B/$t" > "$L/$t.log" 2>&1
  echo "$t rc $?: $(grep -E '^\[  (PASSED|FAILED)  \]' "$L/$t.log" | tr '\n' ' ')" | tee -a "$S"
  grep -E "RefusesInItsStep|FAILED|Failure" -A3 "$L/$t.log" | head -30 | tee -a "$S"
done
device_call_end
