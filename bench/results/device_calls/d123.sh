#!/usr/bin/env bash
# Run 2026-12-05 (thirteenth session): tiered_serving.md ("A model's layers in turn"),
# device_tests.md.
# Hundred-and-twenty-third call: d122 found a 32-layer session's layer-steps at 1.1-1.5 ms
# (retopk) once every layer had codes, against ~0.3 ms for one layer: the static tier kept one
# captured step per Decode stream, keyed by the layer's codes, so each layer captured anew.
# (1) bench/model_tokens.py, 32 layers, a 640-token prompt, bulk 900 -> 1600 (the codes
# take-over at 1536), index and retopk, with d122's kvrecalld (before: one captured step per
# stream) and this bundle's (after: a captured step per key, up to 256), alternating;
# (2) the whole suite (TieredShortlistTest.LayersSteppingInTurnEachAttendTheirOwnBulk on the
# device).
# Bundles: .device/b122 (before), .device/b123 (every *_test, kvrecalld, kvrecall,
# gpu_serving_bench). Carry .device/b122/ship, .device/b123/ship and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
tar -C .device/b122 -xJf .device/b122/ship/bundle.tar.xz
device_call_begin 123
for selector in retopk index; do
  model_tokens_run ${selector}_before .device/b122/bundle/bin/kvrecalld $selector \
    --layers=32 --prompt=640 --from=900 --to=1600
  model_tokens_run ${selector}_after $B/kvrecalld $selector \
    --layers=32 --prompt=640 --from=900 --to=1600
done
bash bench/device_test_suite.sh $B $L $S
tar -C $L -czf $OUT/d123_out.tgz out
device_call_end
