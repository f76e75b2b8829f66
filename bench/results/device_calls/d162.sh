#!/usr/bin/env bash
# Written 2026-12-06 (twenty-first session) for device_tests.md. Hundred-and-sixty-second call,
# at 0e26174, the twenty-first session's last code (review 21's second form of probe 23's mend: only the
# session whose selector grew past its budget is refused; max_tokens sets aside the state its
# selector keeps, the graphs reserved to that length): (1) the whole suite; (2) the transformers
# backend end to end. Bundle .device/b162; carry its ship/, client/python/kvrecall/_gen and
# .device/model. Not run in the twenty-first session: every start was refused until too little
# device time was left. The next session runs it (rebuild the bundle: .device/ is not kept).
set -u
. bench/device_call.sh
device_call_begin 162
bash bench/device_test_suite.sh $B $L $S
hf_demo_check hf_demo_d162
device_call_end
