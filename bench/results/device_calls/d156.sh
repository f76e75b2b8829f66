#!/usr/bin/env bash
# Written 2026-12-06 (twentieth session) for device_tests.md and tiered_serving.md.
# Hundred-and-fifty-sixth call, at 7c3bc0d (the twentieth session's code: the operator surface
# of probe 20, the read-through's mends, probe 21's; no step code changed since d151): (1) the
# whole suite; (2) issue 15's rows at 128K and 512K, 100 steps; (3) the transformers backend end
# to end. Bundle .device/b156; carry its ship/, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 156
bash bench/device_test_suite.sh $B $L $S
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
hf_demo_check hf_demo_d156
device_call_end
