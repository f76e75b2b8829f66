#!/usr/bin/env bash
# Run 2026-12-05 (fourteenth session): tiered_serving.md (Targets).
# Hundred-and-twenty-eighth call: issue 15's headline rows (tiered retopk and index, batch 1,
# K = 512, auto_tau, 60 steps) at 128K and 512K with b127's kvrecalld (88e0f8e: the host KV
# reserved and grown ahead; one-layer sessions announcing max_tokens, so no growth here), on an
# H200 as d104 ran them (285 / 364 us retopk). Bundle .device/b127; carry its ship/ and
# client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 127
tiered_rows $B/kvrecalld 131072 524288
device_call_end
