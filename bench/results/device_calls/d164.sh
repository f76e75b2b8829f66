#!/usr/bin/env bash
# Written 2026-12-06 (twenty-third session) for device_tests.md. Hundred-and-sixty-fourth call,
# at the session's code (review 23's items, probes 27 and 28, reviews 24 and 25: CreateSession's
# request_id, DecodeRequest.max_reply_bytes, the clients' mends). (1) The whole suite;
# (2) issue 15's rows at 128K and 512K, 100 steps; (3) the transformers backend end to end.
# Bundle .device/b164; carry its ship/, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 164
bash bench/device_test_suite.sh $B $L $S
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
hf_demo_check hf_demo_d164
device_call_end
