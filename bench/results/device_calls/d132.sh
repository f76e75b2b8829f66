#!/usr/bin/env bash
# Written and run 2026-12-06 (fifteenth session) for device_tests.md. Hundred-and-thirty-second
# call: gpu_placement_test alone (bundle .device/b132), after d131 found its new
# AKeptCapturedStepIsChargedToTheGpuBudget expecting the sessions' GPU bytes of before the
# steps once the streams closed (the steps had grown the sessions' KV: the charge difference
# while the streams were open held in both modes). Carry .device/b132/ship.
set -u
tar -C .device/b132 -xJf .device/b132/ship/bundle.tar.xz
export LD_LIBRARY_PATH=$PWD/.device/b132/bundle/lib
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
.device/b132/bundle/bin/gpu_placement_test 2>&1 | tee $OUT/d132_gpu_placement_test.log | \
  grep -E "^\[  (PASSED|FAILED|SKIPPED)|Failure" | head -30
