#!/usr/bin/env bash
# Run 2026-12-05 (thirteenth session): tiered_serving.md ("A model's layers in turn"),
# device_tests.md.
# Hundred-and-twenty-fifth call, review 13's mends and the host KV's growth in place
# (HostMemory::Grow, kv_growth.md): (1) bench/model_tokens.py, 32 layers, a
# 640-token prompt, bulk 900 -> 1600, index: learned codes now sized for the rows they serve
# (the token after the take-over grew them before), and the same with max_tokens announced
# (2300: the KV set aside at creation, so the host-KV growth stall of d123 cannot come);
# (2) the whole suite (the captured steps keyed by the softmax scale too:
# TieredPlacementTest.SessionsOfOneShapeKeepTheirOwnSoftmaxScale; LayersSteppingInTurn with
# each layer's own key that only its codes shortlist).
# Not run: no device machine was lent for the rest of the session. Run it first next time.
# (The growth run now also measures HostMemory::Grow's pinned path: unpinned, grown without a
# copy, pinned again whole.)
# Bundle: .device/b125, built at 40319d3 (every *_test, kvrecalld, kvrecall, gpu_serving_bench). Carry
# .device/b125/ship and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 125
model_tokens_run index_grown $B/kvrecalld index --layers=32 --prompt=640 --from=900 --to=1600
model_tokens_run index_announced $B/kvrecalld index --layers=32 --prompt=640 --from=900 \
  --to=1600 --max-tokens=2300
bash bench/device_test_suite.sh $B $L $S
tar -C $L -czf $OUT/d125_out.tgz out
device_call_end
