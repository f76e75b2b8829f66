# Sourced by the device-call scripts (bench/results/device_calls/dNN.sh, from d98 on): what every
# call to the H200 machine does around its measurements, so that a script holds only those.
#
#   . bench/device_call.sh
#   device_call_begin 98        # unpacks .device/b98/ship/bundle.tar.xz; sets B (its bin/),
#                               # L (/tmp/d98, the logs), S ($OUT/d98_summary.txt), N (98)
#   bash bench/device_test_suite.sh $B $L $S
#   serving_summary $L/x.json   # one line per gpu_serving_bench record, into $S
#   hf_demo_check NAME          # the transformers backend end to end, into $OUT/NAME.json
#   device_call_end             # the logs to $OUT/dNN_logs.tgz
#
# Run from the repository root on the device machine, where the device tool sets $OUT.

. scripts/kvrecalld.sh

device_call_begin() {
  N=$1
  tar -C ".device/b$N" -xJf ".device/b$N/ship/bundle.tar.xz"
  B=$PWD/.device/b$N/bundle/bin
  export LD_LIBRARY_PATH=$PWD/.device/b$N/bundle/lib
  L=/tmp/d$N
  S=$OUT/d${N}_summary.txt
  mkdir -p "$L"
  cat /proc/loadavg | tee -a "$S"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$S"
}

# One line per record of a gpu_serving_bench --out JSON: server and end-to-end p50 (p99), the
# bulk's p50, the device's exact heads, GPU bytes, build seconds, and per path a head's mean
# candidates and bulk p50.
serving_summary() {
  python3 - "$1" <<'PY' 2>&1 | tee -a "$S"
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    paths = " ".join("%s:%dc/%dus" % (k, v["candidates_mean"], v["bulk_p50_us"])
                     for k, v in r.get("head_bulk_by_path", {}).items())
    print(r["context"], r["batch"], r["selector"], r.get("exact_search"),
          "srv", round(r["server_p50_us"]), round(r["server_p99_us"]),
          "e2e", round(r["e2e_p50_us"]), "bulk", round(r.get("bulk_p50_us", 0)),
          "devheads", round(r.get("device_exact_heads_per_step", 0), 2),
          "gpuB", r.get("session_gpu_bytes"), "build", round(r.get("build_seconds_max", 0), 2),
          paths)
PY
}

# kvrecall.hf_demo against a kvrecalld of its own (tinylm-a from .device/model, 2 rows of an
# 8192-byte prompt, 64 greedy bytes, bf16; index and retopk in the cpu and tiered placements):
# whether each run's bytes are SDPA's and, tiered, the cpu placement's. Raw: $OUT/NAME.json.
hf_demo_check() {
  local name=$1
  start_kvrecalld "$B/kvrecalld" "$L/kvrecalld_hf.log" --address=127.0.0.1:0 || return 1
  PYTHONPATH=client/python timeout 150 python3 -m kvrecall.hf_demo \
    --server "$kvrecalld_address" --model .device/model/tinylm-a.npz \
    --text .device/model/prompt.txt --prompt 8192 --new 64 --batch 2 --dtype bf16 --auto-tau \
    --policies index:512 tiered/index:512 retopk:512 tiered/retopk:512 \
    --out "$OUT/$name.json" > "$L/hf.log" 2>&1
  echo "hf_demo rc $? t=$SECONDS" | tee -a "$S"
  python3 - "$OUT/$name.json" <<'PY' 2>&1 | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
print("ok", d.get("ok"))
for r in d["runs"]:
    print(r["placement"], r["policy"], r["k"], "same_as_sdpa", r.get("same_bytes"),
          r.get("first_divergence"), "same_as_cpu", r.get("same_as_cpu"),
          r.get("first_divergence_from_cpu"), "s", round(r.get("seconds", 0), 2),
          "error" if "error" in r else "")
PY
  kill "$kvrecalld_pid"
  wait "$kvrecalld_pid" 2>/dev/null
}

device_call_end() {
  (cd "$L" && tar czf "$OUT/d${N}_logs.tgz" ./*.log ./*.txt 2>/dev/null)
}
