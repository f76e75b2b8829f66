#!/usr/bin/env bash
# Written 2026-12-06 (nineteenth session) for device_tests.md and tiered_serving.md.
# Hundred-and-fifty-first call, at 66697f9: (1) bench/host_stalls on the idle host, twice (the
# host's own single-thread stalls, against the ~3 ms ones left in the tiered 128K tail); (2)
# issue 15's rows at 128K, 100 steps; (3) the whole suite (the GPU sessions of a request now step
# before the CPU's, ddd1ee8); (4) the transformers backend end to end. Bundle .device/b151; carry
# its ship/, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 151
host_stalls_run host_stalls_d151_a --seconds=30 --threshold_us=200
rows_steps=100 tiered_rows "$B/kvrecalld" 131072
host_stalls_run host_stalls_d151_b --seconds=30 --threshold_us=200
bash bench/device_test_suite.sh $B $L $S
hf_demo_check hf_demo_d151
device_call_end
