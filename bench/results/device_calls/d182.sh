#!/usr/bin/env bash
# Written 2026-12-08 (thirty-first session). Hundred-and-eighty-second call: review 41's mends on
# a device (GpuStepContext::Remake moving a workspace's charge in one step; a static-set step's
# workspace pointers reset in Prepare), through the binaries that step the gpu and tiered
# placements there, four at a time. Bundle .device/b182 (gpu_placement_test,
# tiered_shortlist_test, tiered_placement_test, gpu_support_test, kvrecalld); carry its ship/.
# Not run yet: the session's device time ran out (d180-d181 spent it). Its bundle holds
# b2728f0's binaries: rebuild it (the usual recipe) at 5c1ac83 or later, whose read-through moved
# the shared-memory refusal into AllowDynamicSharedMemory, so that the call covers that too.
set -u
. bench/device_call.sh
device_call_begin 182
test_binaries
device_call_end
