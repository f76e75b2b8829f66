#!/usr/bin/env bash
# Written 2026-12-06 (eighteenth session) for tiered_serving.md ("One slow head a step").
# Hundred-and-forty-sixth call. d145 refuted preemption: with 12 pool threads (no involuntary
# switches) retopk at 512K still had 11-12 of 100 steps over twice the p50, each with one host
# head 1.5-2 ms long. The suspect now: ShortlistSelector::Select's thread-local table of the
# bulk's positions (4 bytes each, 2 MiB at 512K), allocated and zeroed, then grown, by each pool
# thread's first Selects at a new length. b146 takes a table sized to the Select's ids instead.
# b144's kvrecalld (before) and b146's (after), the rows at 128K and 512K (100 steps), twice in
# turn; then b146's shortlist and tiered tests on the device.
set -u
. bench/device_call.sh
device_call_begin 146
tar -C .device/b144 -xJf .device/b144/ship/bundle.tar.xz
for round in 1 2; do
  for build in 144 146; do
    name=r${round}_b$build
    LD_LIBRARY_PATH=$PWD/.device/b$build/bundle/lib start_kvrecalld \
      "$PWD/.device/b$build/bundle/bin/kvrecalld" "$L/kvrecalld_$name.log" \
      --address=127.0.0.1:0 || continue
    for context in 131072 524288; do
      rows_run "${name}_$context" "$context" 100
      cp "$L/${name}_$context.json" "$R/"
    done
    kill "$kvrecalld_pid"; wait "$kvrecalld_pid" 2>/dev/null
  done
done
tar -C "$R" -czf "$OUT/d146_rows.tgz" .
for t in shortlist_selector_test tiered_placement_test tiered_shortlist_test; do
  timeout 240 "$B/$t" --gtest_brief=1 > "$L/$t.log" 2>&1
  echo "$t rc $? $(tail -1 "$L/$t.log")" | tee -a "$S"
done
device_call_end
