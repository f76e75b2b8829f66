#!/usr/bin/env bash
# Written 2026-12-06 (twentieth session) for device_tests.md. Hundred-and-fifty-eighth call, at
# 3a02a64 (the session's last code: review 20b's mends of the TLS file check and the listener
# check, the benches' address check): the whole suite. Bundle .device/b158; carry its ship/ and
# client/python/kvrecall/_gen. Not run in the twentieth session: its starts were refused until
# too little device time was left. The next session runs it (rebuild the bundle: .device/ is not
# kept).
set -u
. bench/device_call.sh
device_call_begin 158
bash bench/device_test_suite.sh $B $L $S
device_call_end
