#!/usr/bin/env bash
# Written 2026-12-06 (fifteenth session) for tiered_serving.md ("A model's layers in turn"),
# device_tests.md, and review 13's L5 (the device memory of cached captured steps).
# Hundred-and-thirtieth call:
# (1) bench/model_tokens.py, 32 layers, a 640-token prompt, bulk 900 -> 1600, no max_tokens,
# index then retopk, with b129's kvrecalld (32e36bd: every layer takes over its learned codes
# at bulk 1536) and b130's (415213f on: layer l at 1536 + l, one a token), alternating;
# (1b) the same, index, b130's, to bulk 4100: the host KV's move past its reservation;
# (2) driver_call_bench's spelled graphs, 256 executable copies each: the device memory one
# takes (the launch timings trimmed: --reps=200, no pool loops);
# (3) the whole suite at b130 (review 14's mends, 32e36bd on, and the staggered take-over on
# the GPU tier: TieredCodesTest.CodesOfAShortPromptBulkAreLearnedAgain in layer 7).
# Bundles: .device/b129 (32e36bd) and .device/b130. Carry both ship/ and
# client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
tar -C .device/b129 -xJf .device/b129/ship/bundle.tar.xz
OLD=$PWD/.device/b129/bundle/bin
device_call_begin 130
for selector in index retopk; do
  model_tokens_run ${selector}_at_once $OLD/kvrecalld $selector --layers=32 --prompt=640 \
    --from=900 --to=1600
  model_tokens_run ${selector}_one_a_token $B/kvrecalld $selector --layers=32 --prompt=640 \
    --from=900 --to=1600
done
model_tokens_stretches index_at_once index_one_a_token retopk_at_once retopk_one_a_token
# Past its reserved address space (4x the allocation that first mapped it) a host KV array
# still moves in the step: the index prompt's arrays, mapped at 1152 rows, reserve 4608, so
# the token of 4609 rows (bulk 3969) moves all 64 arrays and pins them again whole.
model_tokens_run index_past_reserve $B/kvrecalld index --layers=32 --prompt=640 \
  --from=900 --to=4100
python3 - $R/index_past_reserve.json <<'PY' 2>&1 | tee -a $S
import json, statistics as st, sys
d = json.load(open(sys.argv[1]))
s, f = d["server_us_by_token"], d["bulk_from"]
print("past_reserve median %.1f ms" % (st.median(s) / 1000), "slowest",
      [(t["bulk"], round(t["server_us"] / 1000, 1)) for t in d["slowest_tokens"][:6]])
PY
$B/driver_call_bench --reps=200 --warmup=20 --pool_graphs= --graph_copies=256 \
  > $R/graph_memory.json 2> $L/graph_memory.err
echo "driver_call_bench rc $? t=$SECONDS" | tee -a $S
python3 - $R/graph_memory.json <<'PY' 2>&1 | tee -a $S
import json, sys
d = json.load(open(sys.argv[1]))
for name, m in d.get("graph_device_bytes", {}).items():
    print(name, d["graph_launch_us"][name]["graph_nodes"], "nodes", m["bytes_each"], "B each")
PY
bash bench/device_test_suite.sh $B $L $S
tar -C $L -czf $OUT/d130_out.tgz out
device_call_end
