#!/usr/bin/env bash
# Written 2026-12-08 (thirty-first session). Hundred-and-eightieth call: review 40's mends of the
# GPU backends on a device (a stream's pinned buffers charged to the host budget and sized to
# what comes down, GpuHostBudgetTest; workspaces' charges following what is allocated; a gpu
# step whose queuing failed drained; a late host UNAVAILABLE, cuda_step_io_test; ReTopK's cache
# entries of a tiered step pushed once it cannot fail; the outliers of a drained step's rows;
# codes uploaded from pageable memory waited for; static sets and codes freed on their device).
# (1) The whole suite; (2) issue 15's rows at 128K and 512K, 100 steps (ReTopK's pushes moved
# to EndBulk: the step's time against d175 / d170); (3) the transformers backend end to end.
# Bundle .device/b180; carry its ship/, client/python/kvrecall/_gen and .device/model.
# Run 2026-12-08 00:28 UTC on an H100 (a4ff962's tree): device_tests.md, d180.
set -u
. bench/device_call.sh
device_call_begin 180
bash bench/device_test_suite.sh $B $L $S
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
hf_demo_check hf_demo_d180
device_call_end
