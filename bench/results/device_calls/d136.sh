#!/usr/bin/env bash
# Written 2026-12-06 (sixteenth session) for kv_growth.md and device_tests.md.
# Hundred-and-thirty-sixth call: (1) review 15b's M3, measured: a short prompt's host KV
# arrays (under 512 KiB: a 64- or 160-token prompt, 128 / 320 KiB a bf16 array) are heap
# allocations that grow by a copy and a pin in the step, every layer at once, until they reach
# 512 KiB. bench/model_tokens.py, 32 layers, index, every token from the prompt's end to bulk
# 200 timed (bulk 0 until the static set is full); (2) the whole suite at b136 (84edc63: the
# fifteenth session's code, whose suite ran whole last at b131). Bundle .device/b136; carry
# its ship/ and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 136
for prompt in 64 160; do
  model_tokens_run short_$prompt $B/kvrecalld index --layers=32 --prompt=$prompt --from=0 \
    --to=200
  python3 - $R/short_$prompt.json <<'PY' 2>&1 | tee -a $S
import json, statistics as st, sys
d = json.load(open(sys.argv[1]))
s = d["server_us_by_token"]
held = [d["prompt"] + 1 + i for i in range(len(s))]  # tokens held after each timed token
worst = sorted(range(len(s)), key=lambda i: -s[i])[:10]
print("prompt", d["prompt"], "median %.1f ms" % (st.median(s) / 1000), "slowest (held, ms)",
      [(held[i], round(s[i] / 1000, 1)) for i in worst])
PY
done
bash bench/device_test_suite.sh $B $L $S
tar -C $L -czf $OUT/d136_out.tgz out
device_call_end
