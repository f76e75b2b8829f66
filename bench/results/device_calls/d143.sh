#!/usr/bin/env bash
# Written 2026-12-06 (seventeenth session) for device_tests.md. Hundred-and-forty-third call, at
# dc728aa (review 17b's mends: a Prefill's take-back decided under the call's lock, the commit
# no longer reading gRPC's context from the build threads): the whole suite, and the transformers
# backend end to end. Bundle .device/b143; carry its ship/, client/python/kvrecall/_gen and
# .device/model.
set -u
. bench/device_call.sh
device_call_begin 143
bash bench/device_test_suite.sh $B $L $S
hf_demo_check hf_demo_d143
device_call_end
