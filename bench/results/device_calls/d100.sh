#!/usr/bin/env bash
# Run 2026-12-05 (results: tiered_serving.md, "The step at a take-over"): nice 19 did worse and
# was not kept; service_errors_test's new budget test failed here (an f32 tiered session, which
# a GPU tier refuses), mended and run again in d101.
# Hundredth call: a codes learning on its queue runs at the lowest priority (nice 19, its OpenMP
# team too), so that the decode steps' pool workers preempt it; the learnings' outcomes counted
# (kvrecall_codes_learnings_total), none started past --max_context_tokens, SessionInfo's
# budget bytes. 1. Every C++ test binary and the Python client's tests. 2. The take-over run of
# d98 as an A/B in one call: d98's kvrecalld (90810ec, the learning at nice 0) against this one,
# twice each, alternating: each step's server time, the steps over twice p50 inside the window
# where learnings run (bulk 1024-1535) and outside it, and the take-over step.
# Carry: .device/b100/ship (every tests/*_test, kvrecalld, kvrecall, gpu_serving_bench),
# .device/b98/ship (d98's bundle), .device/model, client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 100
bash bench/device_test_suite.sh $B $L $S
tar -C .device/b98 -xJf .device/b98/ship/bundle.tar.xz
for rep in 1 2; do
  for arm in nice0 nice19; do
    root=$PWD/.device/b100/bundle
    [ $arm = nice0 ] && root=$PWD/.device/b98/bundle
    export LD_LIBRARY_PATH=$root/lib
    start_kvrecalld $root/bin/kvrecalld $L/kvrecalld_$arm$rep.log --address=127.0.0.1:0 || exit 1
    timeout 200 $root/bin/gpu_serving_bench --server=$kvrecalld_address \
      --out=$L/takeover_$arm$rep.json --placement=tiered --contexts=640 --batches=1,8 \
      --selectors=index,retopk --auto_tau --steps=700 --warmup=900 > /dev/null \
      2> $L/takeover_$arm$rep.log
    echo "$arm rep $rep rc $? t=$SECONDS" | tee -a $S
    kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
    python3 - $L/takeover_$arm$rep.json $arm <<'PY' 2>&1 | tee -a $S
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    t = r["server_us_by_step"]
    p50 = sorted(t)[len(t) // 2]
    # Timed step i carries bulk row 900 + i; learnings run from bulk 1024 to the take-over at 1536.
    inside = [x for i, x in enumerate(t) if 1024 <= 900 + i < 1536]
    outside = [x for i, x in enumerate(t) if not 1024 <= 900 + i <= 1536]
    slow = lambda xs: sum(x > 2 * p50 for x in xs)
    print(sys.argv[2], r["selector"], "batch", r["batch"], "p50", round(p50),
          "p99", round(r["server_p99_us"]), "over 2x p50: inside", slow(inside), "of",
          len(inside), "outside", slow(outside), "of", len(outside),
          "inside max", round(max(inside)), "take-over", round(t[1536 - 900]))
PY
  done
done
cp $L/takeover_*.json $OUT/ 2>/dev/null
device_call_end
