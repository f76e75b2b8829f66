#!/usr/bin/env bash
# Run 2026-12-05 (thirteenth session): tiered_serving.md ("A model's layers in turn").
# Hundred-and-twenty-fourth call: d123's A/B at a long prompt, where every layer has codes from
# its prefill: bench/model_tokens.py, 8 layers of a 128K prompt (N(0, 1) keys and values, the
# Llama-3-8B layer geometry, bf16), 40 tokens (the last 34 timed), retopk and index, d122's
# kvrecalld (one captured step per stream) against d123's (one per key), alternating; then the
# same at 1 layer with d123's, the per-layer figure without other layers between.
# Did not return: the device machine stopped answering during the call (no output came back,
# ~400 s of the session's device time spent); not run again.
# Bundles: .device/b122, .device/b123. Carry both ships and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
tar -C .device/b122 -xJf .device/b122/ship/bundle.tar.xz
device_call_begin 123
# (This call's files are d124's: the bundle is d123's.)
N=124 L=/tmp/d124 R=/tmp/d124/out
mv "$S" "$OUT/d124_summary.txt"
S=$OUT/d124_summary.txt
mkdir -p $R
long=(--prompt=131072 --from=130438 --to=130472)
for selector in retopk index; do
  model_tokens_run ${selector}_8l_before .device/b122/bundle/bin/kvrecalld $selector \
    --layers=8 "${long[@]}"
  model_tokens_run ${selector}_8l_after $B/kvrecalld $selector --layers=8 "${long[@]}"
  model_tokens_run ${selector}_1l_after $B/kvrecalld $selector --layers=1 "${long[@]}"
done
tar -C $L -czf $OUT/d124_out.tgz out
device_call_end
