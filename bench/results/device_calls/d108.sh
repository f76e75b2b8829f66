#!/usr/bin/env bash
# Run 2026-12-05 on an H100 machine (no H200 could be started): device_tests.md,
# tiered_serving.md ("The step at a take-over"). The patch it measured landed with its results
# (the commit after 6f23f93), so it is no longer beside this file (git show
# 6f23f93:bench/results/device_calls/d108_takeover_rows.patch). Its take-over runs and rows
# are written with bench/device_call.sh's takeover_run and tiered_rows since it ran: the same
# commands (the summary line then added the slow steps' counts).
# Hundred-and-eighth call (eleventh session, 2026-12-05): the code since 8258121 on a GPU, and
# d108_takeover_rows.patch: a take-over's catch-up coding by one launch of a
# block per (row, KV head) (cuda::PqEncodeRows) instead of a PqEncode launch per KV head, which
# for the few hundred rows a take-over codes ran ~1 ms a layer on the step's path (d107: the
# errors' 16 KB download waiting ~985 us for eight launches of one or two blocks).
#   1. The whole test suite, built with the patch (codes_learning_test's new cases compare the
#      GPU tier's codes, few rows and many, with the quantizers' encoding, and stop a coding).
#   2. d107's take-over run (index and retopk, batches 1 and 8) against kvrecalld before
#      (6f23f93, without the patch) and after: the take-over step (bulk 1536) and p50.
#   2b. The patched binary again with CUDA_MODULE_LOADING=EAGER: is the take-over's host time in
#      plan and launch the driver's lazy loading of kernels launched for the first time?
#   3. Issue 15's headline rows (d104's: 128K and 512K, retopk and index, batch 1) with the
#      patched kvrecalld (the patch does not touch a step that codes nothing).
# Bundle: .device/b108 (device_tests.md's recipe: every test, kvrecalld, kvrecall,
# gpu_serving_bench, the shim; kvrecalld_before built at 6f23f93 without the patch).
# Carry: .device/b108/ship, client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 108
echo "THP $(cat /sys/kernel/mm/transparent_hugepage/enabled)" | tee -a $S
bash bench/device_test_suite.sh $B $L $S
for t in codes_learning_test tiered_codes_test cuda_pq_encode_test; do
  grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $L/$t.log | tr '\n' ' ' | sed "s/^/$t: /" | tee -a $S
  echo | tee -a $S
done

takeover_run before $B/kvrecalld_before
takeover_run after $B/kvrecalld
# Whether the take-over's 1-3 ms of host work in plan and launch (d106-d107: in no CUDA runtime
# call) is the CUDA driver loading, on their first launch, kernels no step had launched before
# (lazy module loading, CUDA's default): the same binary with every module loaded at start.
CUDA_MODULE_LOADING=EAGER takeover_run after_eager $B/kvrecalld
echo "profilers: $(command -v perf nsys ncu gdb | tr '\n' ' ')" | tee -a $S

tiered_rows $B/kvrecalld 131072 524288
device_call_end
