#!/usr/bin/env bash
# Run 2026-12-06 (fifteenth session): tiered_serving.md (Targets).
# Hundred-and-thirty-fourth call, right after d133 on the same H200: d133's rows read 25-55 %
# over d128's (retopk 410 / 573 us at 128K / 512K), so b129's kvrecalld (32e36bd, the last
# session's code) and b131's (this session's) alternate, twice each, the same rows. Bundles
# .device/b129 and .device/b131; carry both ship/ and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
tar -C .device/b129 -xJf .device/b129/ship/bundle.tar.xz
OLD=$PWD/.device/b129/bundle/bin
device_call_begin 131
for round in 1 2; do
  for binary in before:$OLD after:$B; do
    echo "round $round ${binary%%:*}" | tee -a $S
    tiered_rows ${binary#*:}/kvrecalld 131072 524288
    for c in 131072 524288; do mv $OUT/s$c.json $OUT/s${c}_${binary%%:*}_$round.json; done
  done
done
device_call_end
