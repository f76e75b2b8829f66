#!/usr/bin/env bash
# Run 2026-12-05 (thirteenth session): device_tests.md.
# Hundred-and-twenty-first call: the whole suite at b032922, the first run on a GPU of
# f5a0ad7's code (gpu::CapturedScanBound as a named function, Update in gpu_support.h,
# ChargedBufferTest), 6f39a22's Gpu case of CodedRowsAreTheQuantizersEncodingFewOrMany (4700
# rows: three 2048-row chunks, the last partial) and b032922's test helper.
# Bundle: .device/b121 (every *_test, kvrecalld, kvrecall). Carry .device/b121/ship and
# client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 121
bash bench/device_test_suite.sh $B $L $S
device_call_end
