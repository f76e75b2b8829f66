#!/usr/bin/env bash
# Written 2026-12-07 (twenty-sixth session) for device_tests.md. Hundred-and-seventy-first call,
# on d170's machine (an H100) a minute after it, its host idle: issue 15's rows at 128K and
# 512K, 100 steps, with d170's bundle (19440cd), to set beside d170's rows taken right after
# the suite.
# Bundle .device/b170; carry its ship/.
set -u
. bench/device_call.sh
device_call_begin 170
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
device_call_end
