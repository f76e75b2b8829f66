#!/usr/bin/env bash
# Written 2026-12-05 (fourteenth session) for kv_growth.md, tiered_serving.md, device_tests.md.
# NEVER RUN: no device machine could be started for the rest of that session. The next session
# ran its bundle's kvrecalld in d130 (as the take-over's "before") and the suite at b130, which
# holds all of it; kept as written. It read: run it first next time (its bundle is
# .device/b129, at 32e36bd; the code after it, 8c1bfff and ebecf22, adds a refusal that the
# steps never reach, asserts and a comment).
# Hundred-and-twenty-ninth call, review 14's mends (32e36bd: an in-place growth refused rather
# than copied, one mapping after a move, a growth ahead taken without a system call, a refused
# pin kept registered, a queued growth dropped when needed, heap arrays in pages of their own):
# (1) the whole suite; (2) bench/model_tokens.py, 32 layers, a 640-token prompt, bulk 900 ->
# 1600, no max_tokens, index and retopk, grown ahead (the default). (Trimmed to fit the
# session's last device minutes: the in-step runs are d127's.) Bundle .device/b129 (32e36bd);
# carry its ship/ and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 129
bash bench/device_test_suite.sh $B $L $S
for selector in index retopk; do
  model_tokens_run ${selector}_ahead $B/kvrecalld $selector --layers=32 --prompt=640 \
    --from=900 --to=1600
done
model_tokens_stretches index_ahead retopk_ahead
tar -C $L -czf $OUT/d129_out.tgz out
device_call_end
