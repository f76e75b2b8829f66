#!/usr/bin/env bash
# Written 2026-12-07 (twenty-fifth session) for device_tests.md. Hundred-and-sixty-eighth call,
# at the session's code (review 27's server changes, the metrics token, the CLI's prefill and
# decode, review 28's mends, dead code out). (1) The whole suite; (2) the transformers backend
# end to end. (No rows: no step code changed since d165, and the session's device time had gone
# to refused starts.)
# Bundle .device/b168; carry its ship/, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 168
bash bench/device_test_suite.sh $B $L $S
hf_demo_check hf_demo_d168
device_call_end
