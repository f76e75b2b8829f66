#!/usr/bin/env bash
# Run 2026-12-06 (fifteenth session) for kv_growth.md and device_tests.md.
# Hundred-and-thirty-fifth call: a short prompt's host KV arrays (640 tokens staged as 512 +
# 128: 1.25 MiB a bf16 array) were heap allocations, and the first decode token past them
# copied each into a mapping in the step, every layer at once (bulk 129). Since then an
# allocation that reserves room to grow past 2 MiB is a mapping from the start, which the
# growth ahead grows. (1) bench/model_tokens.py, 32 layers, index, bulk 1 -> 300, b131's
# kvrecalld against b135's, once each (the session's last device minutes); (2) the test of
# the pinned growth on the device (cuda_candidate_attention_test). Bundles .device/b131 and .device/b135 (b135:
# kvrecalld, cuda_candidate_attention_test and tiered_shortlist_test only); carry both ship/ and
# client/python/kvrecall/_gen. Trimmed to the session's last device minutes. Then, on the same
# warm machine, a call of its own ran b135's tiered_shortlist_test:
#   tar -C .device/b135 -xJf .device/b135/ship/bundle.tar.xz &&
#   LD_LIBRARY_PATH=$PWD/.device/b135/bundle/lib && cd tests &&
#   ../.device/b135/bundle/bin/tiered_shortlist_test --gtest_brief=1      # 14 of 14 passed
set -u
. bench/device_call.sh
tar -C .device/b131 -xJf .device/b131/ship/bundle.tar.xz
OLD=$PWD/.device/b131/bundle/bin
device_call_begin 135
for round in 1; do
  for binary in heap:$OLD mapped:$B; do
    model_tokens_run ${binary%%:*}_$round ${binary#*:}/kvrecalld index --layers=32 --prompt=640 \
      --from=1 --to=300
  done
done
python3 - $R <<'PY' 2>&1 | tee -a $S
import json, statistics as st, sys
for name in ("heap_1", "mapped_1"):
    d = json.load(open(f"{sys.argv[1]}/{name}.json"))
    s = d["server_us_by_token"]
    print(name, "median %.1f ms" % (st.median(s) / 1000), "slowest",
          [(t["bulk"], round(t["server_us"] / 1000, 1)) for t in d["slowest_tokens"][:4]])
PY
for t in cuda_candidate_attention_test; do
  (cd tests && timeout 200 $B/$t --gtest_brief=1 > $L/$t.log 2>&1; echo "$t rc $?") | tee -a $S
  grep -E "^\[  (PASSED|FAILED)" $L/$t.log | tee -a $S
done
tar -C $L -czf $OUT/d135_out.tgz out
device_call_end
