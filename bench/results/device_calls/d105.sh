#!/usr/bin/env bash
# NOT RUN: too little device time was left in the seventh session (2026-12-05). Its bundle is
# .device/b105 (HEAD c885d3b); a later session whose HEAD has moved rebuilds it and runs this first.
# Hundred-and-fifth call: the session's final code (probe 7's mends: a failed Prefill keeps an
# announced session's set-aside, on the host's and the GPU's grants alike; ListSessions' page
# token checked). Every C++ test binary and the Python client's tests.
# Carry: .device/b105/ship, .device/model, client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 105
bash bench/device_test_suite.sh $B $L $S
device_call_end
