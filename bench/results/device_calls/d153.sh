#!/usr/bin/env bash
# Written 2026-12-06 (nineteenth session) for tiered_serving.md ("The host's own stalls") and
# device_tests.md. Hundred-and-fifty-third call, at c066065: (1) bench/host_stalls as review 19
# mended it (each stall's class from the involuntary switches read at every turn; per CPU,
# /proc/stat's steal, irq and softirq over the run beside the stalls' time; overlaps per class),
# 60 s on the idle host; (2) the whole suite (the Decode changes of 0ad679a and c066065). Bundle
# .device/b153; carry its ship/ and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 153
host_stalls_run host_stalls_d153 --seconds=60 --threshold_us=200
bash bench/device_test_suite.sh $B $L $S
device_call_end
