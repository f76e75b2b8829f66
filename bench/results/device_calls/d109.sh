#!/usr/bin/env bash
# Run 2026-12-05 on an H100 machine (asked for an H200): tiered_serving.md ("The step at a
# take-over"), device_tests.md. Its take-over runs and rows are written with
# bench/device_call.sh's takeover_run and tiered_rows since it ran: the same commands.
# Hundred-and-ninth call (eleventh session, 2026-12-05): kvrecalld's --cuda_module_loading
# (default eager), after d108 found that CUDA_MODULE_LOADING=EAGER took a take-over's plan and
# launch from 1-3 ms to ~0.3 ms and most slow steps out of a codes learning's window (the
# latter not repeated here: tiered_serving.md). (The flag's default became empty after this
# call, "the environment's, else eager": eager for the runs below.)
#   1. What eager loading costs at start: seconds to "listening" and the process's GPU memory,
#      eager and lazy alternating, three each; the start-up line (the driver's own mode).
#   2. The whole test suite (KvrecalldProcessTest.TheLogSaysHowCudaLoadsTheKernels asks the
#      driver under the flag, the environment and both).
#   3. d108's take-over run, the flag's default (eager) against --cuda_module_loading=lazy,
#      alternating, twice each: the take-over step and the slow steps in the learning window.
#   4. Issue 15's headline rows (d104's: 128K and 512K, retopk and index, batch 1).
# Bundle: .device/b109 (device_tests.md's recipe: every test, kvrecalld, kvrecall,
# gpu_serving_bench). Carry: .device/b109/ship, client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 109

for rep in 1 2 3; do
  for mode in eager lazy; do
    t0=$(date +%s.%N)
    start_kvrecalld $B/kvrecalld $L/start_$mode$rep.log --address=127.0.0.1:0 \
      --cuda_module_loading=$mode || continue
    t1=$(date +%s.%N)
    used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader |
      grep "^$kvrecalld_pid,")
    echo "start $mode $rep: $(awk "BEGIN{printf \"%.2f\", $t1 - $t0}") s to listen;" \
      "GPU [pid, used] $used; $(grep 'GPU placements' $L/start_$mode$rep.log)" | tee -a $S
    kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  done
done

bash bench/device_test_suite.sh $B $L $S
$B/service_process_test --gtest_filter='*TheLogSaysHowCudaLoadsTheKernels' 2>&1 |
  grep -E "^\[ +(OK|FAILED) +\]|Failure|Expected|Which is|Actual" | head -12 | tee -a $S

for rep in 1 2; do
  takeover_run eager$rep $B/kvrecalld --cuda_module_loading=eager
  takeover_run lazy$rep $B/kvrecalld --cuda_module_loading=lazy
done

tiered_rows $B/kvrecalld 131072 524288
device_call_end
