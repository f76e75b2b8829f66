#!/usr/bin/env bash
# Run 2026-12-05 (thirteenth session): device_tests.md, tiered_serving.md ("What a step costs
# beside its bytes").
# Hundred-and-twenty-second call: (1) the whole suite with the proto3-optional sinks, recent
# and recent_window (a zero served as sent; TieredPlacementTest.AStaticSetWithoutSinksIsTheRing
# Alone on the GPU tier); (2) issue 15's step taken apart by its bytes, on a fresh kvrecalld:
# tiered streaming (the static set alone: every fixed cost of a step but the bulk's) and
# retopk / index at K = 128, 256, 512 (shortlist N = 2K: a head's rows scale with K), batch 1,
# 128K and 512K, 60 steps each; (3) bench/model_tokens.py: a 32-layer session's tokens
# across the layers' codes take-over (index, retopk).
# Bundle: .device/b122 (every *_test, kvrecalld, kvrecall, gpu_serving_bench). Carry
# .device/b122/ship and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 122
start_kvrecalld $B/kvrecalld "$L/kvrecalld_k.log" --address=127.0.0.1:0 || exit 1
for context in 131072 524288; do
  for k in 512 256 128; do
    selectors=retopk,index
    [ $k = 512 ] && selectors=streaming,retopk,index
    timeout 200 "$B/gpu_serving_bench" --server="$kvrecalld_address" \
      --out="$R/k${k}_s$context.json" --placement=tiered --contexts=$context --batches=1 \
      --selectors=$selectors --top_k=$k --auto_tau --steps=60 --warmup=8 \
      > /dev/null 2> "$L/k${k}_s$context.log"
    echo "K=$k $context rc $? t=$SECONDS" | tee -a "$S"
    serving_summary "$R/k${k}_s$context.json"
  done
done
kill "$kvrecalld_pid"
wait "$kvrecalld_pid" 2>/dev/null
# (3) A 32-layer model's token across its layers' codes take-over (bulk 1024 -> 1536), a
# kvrecalld of its own per selector. (The script ran as bench/takeover_layers.py, renamed
# bench/model_tokens.py after this call with the same stepping and timing; its prompt is now
# prefilled a layer at a time.)
for selector in index retopk; do
  start_kvrecalld $B/kvrecalld "$L/kvrecalld_layers_$selector.log" --address=127.0.0.1:0 || exit 1
  PYTHONPATH=client/python timeout 240 python3 bench/model_tokens.py \
    --server="$kvrecalld_address" --layers=32 --selector=$selector --from=900 --to=1600 \
    --out="$R/takeover_layers_$selector.json" > "$L/takeover_layers_$selector.txt" 2>&1
  echo "takeover_layers $selector rc $? t=$SECONDS" | tee -a "$S"
  grep -E '"token_|"bulk"|"server_us"' "$L/takeover_layers_$selector.txt" | head -20 | tee -a "$S"
  kill "$kvrecalld_pid"
  wait "$kvrecalld_pid" 2>/dev/null
done
bash bench/device_test_suite.sh $B $L $S
tar -C $L -czf $OUT/d122_out.tgz out
device_call_end
