#!/usr/bin/env bash
# Written 2026-12-07 (twenty-eighth session) for device_tests.md. Hundred-and-seventy-fourth
# call, at 283b527 (SIGHUP's reads on their own thread, reads again refusing pipes at the
# read itself, stalled reads never holding the exit; review 33's tests: the tiered graph search
# and ReTopK's reuse path against brute force, which run on the GPU tier here; no GPU code
# changed since d170): the whole suite.
# Bundle .device/b174; carry its ship/ and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 174
bash bench/device_test_suite.sh $B $L $S
device_call_end
