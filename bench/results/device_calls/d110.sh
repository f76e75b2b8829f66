#!/usr/bin/env bash
# Run 2026-12-05 on an H100 machine: device_tests.md, tiered_serving.md ("The step at a
# take-over"). The take-over under the shim read -1 for its breakdown (not among the slowest
# steps); its heaviest window was index batch 1's take-over (1020 rows coded by rows).
# Hundred-and-tenth call (eleventh session, 2026-12-05): 95956e6's code on a GPU.
#   1. The whole test suite: CodesLearningTest.CodedRowsAreTheQuantizersEncodingFewOrMany now
#      plants far keys in one KV head, in rows the GPU tier codes by each kernel, and asks that
#      they be that head's outliers alone (the rows kernel's error indexing); the start-up log's
#      test under the flag's new default (empty: the environment's, else eager).
#   2. What is left of a take-over's reserve (~0.7 ms a layer after d108's fix): d107's run
#      (bench/cuda_api_timer.c at 20 us; index and retopk, batches 1 and 8) with this code,
#      the three heaviest 10 ms windows of CUDA calls on the stepping threads.
# Bundle: .device/b110 (device_tests.md's recipe, the shim in bin/). Carry: .device/b110/ship,
# client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 110
bash bench/device_test_suite.sh $B $L $S
$B/codes_learning_test --gtest_filter='*FewOrMany*:*AStoppedCoding*' 2>&1 |
  grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|Failure|Which is|row" | head -12 | tee -a $S
$B/service_process_test --gtest_filter='*TheLogSaysHowCudaLoadsTheKernels' 2>&1 |
  grep -E "^\[ +(OK|FAILED) +\]|Failure|Expected|Which is|Actual" | head -12 | tee -a $S
timed_kvrecalld $B/libkvrecall_cuda_api_timer.so $L/api_calls_20us.txt 20
takeover_run api $L/kvrecalld_timed
api_windows $L/api_calls_20us.txt
cp $L/api_calls_20us.txt $OUT/
device_call_end
