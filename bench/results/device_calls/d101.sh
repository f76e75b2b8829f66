#!/usr/bin/env bash
# Run 2026-12-05: 49 of 49 binaries, 59 Python tests (device_tests.md).
# Hundred-and-first call: the seventh session's final code (the learnings' outcomes counted,
# SessionInfo's budget bytes, no learning past --max_context_tokens; d100's failing budget test
# mended to a bf16 session and to what a GPU tier holds beyond its layers' memory). Every C++
# test binary and the Python client's tests.
# Carry: .device/b101/ship (every tests/*_test, kvrecalld, kvrecall, gpu_serving_bench),
# .device/model, client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 101
bash bench/device_test_suite.sh $B $L $S
grep -E "BudgetBytes|CodesLearningTest.*(OK|FAILED)" $L/service_errors_test.log \
  $L/codes_learning_test.log | tee -a $S
device_call_end
