#!/usr/bin/env bash
# Run 2026-12-05: tiered_serving.md, "Issue 15's headline rows on a fresh machine".
# Hundred-and-fourth call: issue 15's headline rows on a fresh machine (nothing run before them,
# unlike d102-d103), with d102's kvrecalld (ReTopK's build top-K on the GPU; its steps as the
# final code's): tiered, default policy, batch 1, 128K then 512K, retopk and index; the step
# and the build (d74 at 512K: retopk 22.75 s, index 0.82 s).
# Carry: .device/b102/ship.
set -u
. bench/device_call.sh
device_call_begin 102
S=$OUT/d104_summary.txt
start_kvrecalld $B/kvrecalld $L/kvrecalld.log --address=127.0.0.1:0 || exit 1
for context in 131072 524288; do
  cat /proc/loadavg | tee -a $S
  timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$context.json \
    --placement=tiered --contexts=$context --batches=1 --selectors=retopk,index --auto_tau \
    --steps=60 --warmup=8 > /dev/null 2> $L/s$context.log
  echo "$context rc $? t=$SECONDS" | tee -a $S
  serving_summary $L/s$context.json
  python3 - $L/s$context.json <<'PY' 2>&1 | tee -a $S
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    print(r["context"], r["selector"], "prefill s", round(r["prefill_seconds"], 2), "build s",
          round(r["build_seconds_max"], 3), "srv p50", round(r["server_p50_us"]), "p99",
          round(r["server_p99_us"]), "e2e p50", round(r["e2e_p50_us"]))
PY
done
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
cp $L/s*.json $OUT/ 2>/dev/null
(cd "$L" && tar czf "$OUT/d104_logs.tgz" ./*.log 2>/dev/null)
