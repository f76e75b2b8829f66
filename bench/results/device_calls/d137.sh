#!/usr/bin/env bash
# Written 2026-12-06 (sixteenth session) for kv_growth.md and device_tests.md.
# Hundred-and-thirty-seventh call: review 15b's M3 mended. d136 measured a short prompt's host
# KV arrays (under 512 KiB) growing on the heap in the step: tokens 65, 97, 145 and 217 of a
# 64-token prompt cost 29-44 ms against a 2.9 ms median, 161 and 241 of a 160-token prompt
# 41-44 ms. Now any array that reserves room to grow past 2 MiB is a mapping from its first
# allocation, which the growth ahead grows off the step. (1) bench/model_tokens.py as in d136,
# b136's kvrecalld (84edc63) against b137's, alternating, twice; (2) the whole suite at b137.
# Bundles .device/b136 and .device/b137; carry both ship/ and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
tar -C .device/b136 -xJf .device/b136/ship/bundle.tar.xz
OLD=$PWD/.device/b136/bundle/bin
device_call_begin 137
for round in 1 2; do
  for binary in heap:$OLD mapped:$B; do
    for prompt in 64 160; do
      name=${binary%%:*}_${prompt}_$round
      model_tokens_run $name ${binary#*:}/kvrecalld index --layers=32 --prompt=$prompt \
        --from=0 --to=200 > /dev/null
      model_tokens_slowest_held $name  # (its lines were written out here when d137 ran)
    done
  done
done
bash bench/device_test_suite.sh $B $L $S
tar -C $L -czf $OUT/d137_out.tgz out
device_call_end
