#!/usr/bin/env bash
# Run 2026-12-05 (fourteenth session): tiered_serving.md ("A model's layers in turn"),
# kv_growth.md, device_tests.md.
# Hundred-and-twenty-seventh call: the host KV grown where it is (address space reserved, 4x;
# only the added pages pinned; a learning in flight not waited for) and ahead of need on a
# thread of its own (--host_kv_growth_ahead, default on):
# (1) bench/kv_growth_bench with the device: copy, Grow (moved), Grow within the reservation,
# and the pinning beside (unpin + whole re-pin, against the added pages alone);
# (2) bench/model_tokens.py, 32 layers, a 640-token prompt, bulk 900 -> 1600, no max_tokens
# (the growth at bulk 1089 / 1143 inside the learning window), index then retopk, each with
# b126's kvrecalld (the growth moves, re-pins whole, waits for the learning), b127's with
# --host_kv_growth_ahead=false (in place, in the step) and b127's default (ahead);
# (3) the whole suite (TieredShortlistTest.AHostKvGrownWhereItIsIsReadAcrossItsPins reads a
# grown pinned array across its two pins on the device; KvGrowthAheadTest).
# Bundles: .device/b126 (fe2b8a4) and .device/b127 (88e0f8e).
# Carry both ship/ and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
tar -C .device/b126 -xJf .device/b126/ship/bundle.tar.xz
OLD=$PWD/.device/b126/bundle/bin
device_call_begin 127
kv_growth_run $B
for selector in index retopk; do
  model_tokens_run ${selector}_moved $OLD/kvrecalld $selector --layers=32 --prompt=640 \
    --from=900 --to=1600
  KVRECALLD_FLAGS=--host_kv_growth_ahead=false model_tokens_run ${selector}_in_place \
    $B/kvrecalld $selector --layers=32 --prompt=640 --from=900 --to=1600
  model_tokens_run ${selector}_ahead $B/kvrecalld $selector --layers=32 --prompt=640 \
    --from=900 --to=1600
done
model_tokens_stretches index_moved index_in_place index_ahead retopk_moved retopk_in_place \
  retopk_ahead
bash bench/device_test_suite.sh $B $L $S
tar -C $L -czf $OUT/d127_out.tgz out
device_call_end
