#!/usr/bin/env bash
# Run 2026-12-05 on an H100 machine: tiered_serving.md ("The step at a take-over").
# Hundred-and-thirteenth call (eleventh session, 2026-12-05): d112's take-over run counted 1-34
# slow steps in the learning's window where d109 counted 0-6 (one run of 37). The learning's
# k-means assigns through PqEncode, whose new kernel may fill every SM for ~160 us a round where
# the old one took a quarter of them (a guess, not measured at the training's 16384 keys; d113
# found noise). d98's take-over run, kvrecalld before the new kernel
# (d110's bundle) and after (d112's), alternating, twice each.
# Carry: .device/b112/ship, .device/b110/ship.
set -u
. bench/device_call.sh
device_call_begin 112  # d112's bundle (B) and logs' folder (L); this call's N and summary:
N=113
S=$OUT/d113_summary.txt
tar -C .device/b110 -xJf .device/b110/ship/bundle.tar.xz
for rep in 1 2; do
  takeover_run old$rep $PWD/.device/b110/bundle/bin/kvrecalld
  takeover_run new$rep $B/kvrecalld
done
device_call_end
