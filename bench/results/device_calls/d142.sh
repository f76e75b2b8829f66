#!/usr/bin/env bash
# Written 2026-12-06 (seventeenth session) for ppl_hf_backend_gpu.md. Hundred-and-forty-second
# call: d141's end-to-end run read 3.1 s for tiered index against d139's 1.8 (and the cpu
# placement's 4.2 against 3.4); nothing this session changed is on a decode step's path, so
# the two kvrecalld (b139 = 70121ee, the last session's; b141 = this session's) alternate on one
# machine, twice each, to tell a change from the machine (b139k: b139's kvrecalld alone). Carry
# .device/b139k/ship,
# .device/b141/ship, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 141
N=142 S=$OUT/d142_summary.txt  # (bundle b141 unpacked; this call's own names)
tar -C .device/b139k -xJf .device/b139k/ship/bundle.tar.xz
for round in 1 2; do
  for n in 139k 141; do
    B=$PWD/.device/b$n/bundle/bin
    export LD_LIBRARY_PATH=$PWD/.device/b$n/bundle/lib
    echo "round $round kvrecalld b$n" | tee -a $S
    hf_demo_check hf_demo_d142_b${n}_r$round
  done
done
device_call_end
