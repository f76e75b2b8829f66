#!/usr/bin/env bash
# Written 2026-12-07 (thirtieth session). Hundred-and-seventy-eighth call: gpu_placement_test on
# the device, for the tenants' per-device GPU gauges (kvrecall_tenant_gpu_device_memory_bytes and
# _budget_bytes {tenant, device}: GpuTenantBudgetTest reads them from a real device's budget) and
# the rest of that binary with them. Bundle .device/b178 (dad975a: gpu_placement_test,
# kvrecalld; rebuild it with the usual recipe where .device is missing); carry its ship/. Run in
# the same call as d176.
# Run 2026-12-07 on an H100, after d176 in the same call: device_tests.md, d178.
set -u
. bench/device_call.sh
device_call_begin 178
KVRECALLD=$B/kvrecalld KVRECALL_SOURCE_DIR=$PWD timeout 280 "$B/gpu_placement_test" \
  --gtest_brief=1 > "$L/gpu_placement_test.log" 2>&1
echo "gpu_placement_test rc $? t=$SECONDS" | tee -a "$S"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran" "$L/gpu_placement_test.log" | head -20 | tee -a "$S"
device_call_end
