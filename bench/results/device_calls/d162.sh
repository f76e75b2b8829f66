#!/usr/bin/env bash
# Written 2026-12-06 (twenty-first session), run in the twenty-second. Hundred-and-sixty-second
# call, at d14e212: the twenty-first session's last code (84f6469: review 21's second form of
# probe 23's mend, only the session whose selector grew past its budget refused, max_tokens
# setting aside the state its selector keeps; the tenant-aware device choice; the read-through)
# and per-tenant memory on /metrics. (1) The whole suite; (2) issue 15's rows at 128K and 512K,
# 100 steps; (3) the transformers backend end to end. Bundle .device/b162; carry its ship/,
# client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 162
bash bench/device_test_suite.sh $B $L $S
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
hf_demo_check hf_demo_d162
device_call_end
