#!/usr/bin/env bash
# Written 2026-12-06 (twentieth session) for device_tests.md. Hundred-and-fifty-eighth call: the
# whole suite at the twentieth session's last code. Written for 3a02a64 and not run then (its
# starts were refused until too little device time was left). The twenty-first session rebuilt its
# bundle at ad720fd, but its one start was refused; d159 ran the suite at that session's code
# instead (device_tests.md), so this call was never run.
set -u
. bench/device_call.sh
device_call_begin 158
bash bench/device_test_suite.sh $B $L $S
device_call_end
