#!/usr/bin/env bash
# Run 2026-12-06 (fifteenth session): tiered_serving.md (Targets).
# Hundred-and-thirty-third call: issue 15's headline rows (tiered retopk and index, batch 1,
# K = 512, auto_tau, 60 steps) at 128K and 512K with b131's kvrecalld (616f751's server:
# captured steps charged to the GPU budget and dropped when stale, arrays reserved for their
# most tokens), on an H200 as d104 and d128 ran them. Bundle .device/b131; carry its ship/ and
# client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 131
tiered_rows $B/kvrecalld 131072 524288
device_call_end
