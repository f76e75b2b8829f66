#!/usr/bin/env bash
# Written 2026-12-06 (twenty-second session) for device_tests.md; run in the twenty-third, at
# 7b8b0a9 (the twenty-second session's last code; HEAD d473d50 adds documentation only).
# Hundred-and-sixty-third call: per-tenant and per-device metrics, the probe 25 and 26 mends
# (the effective policy's search list with the GPU's shortlist, health and DecodeShared request
# caps, a revoked token's idle streams ended, region files removed once mapped, refusals that
# hide the shared budgets' use), reviews 22 and 23's. (1) The whole suite; (2) issue 15's rows
# at 128K and 512K, 100 steps; (3) the transformers backend end to end. Bundle .device/b163
# (built at 7b8b0a9); carry its ship/, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 163
bash bench/device_test_suite.sh $B $L $S
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
hf_demo_check hf_demo_d163
device_call_end
