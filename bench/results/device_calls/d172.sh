#!/usr/bin/env bash
# Written 2026-12-07 (twenty-sixth session) for device_tests.md. Hundred-and-seventy-second call,
# at 4b19803 (the TLS files read again, review 30's mends, the alert; no GPU code changed since
# d170): the whole suite.
# Bundle .device/b172; carry its ship/ and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 172
bash bench/device_test_suite.sh $B $L $S
device_call_end
