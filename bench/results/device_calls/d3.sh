#!/usr/bin/env bash
# Third call: the served 128K tiered index build with the announced prompt staged in place, and
# ReTopK beside it; 512K index.
set -u
tar -C .device/lead -xJf .device/lead/ship/bundle.tar.xz
SERVING_TIMEOUT=200 SERVING_RUNS="--placement=tiered --contexts=131072 --batches=1 --selectors=index --steps=30 --warmup=5
--placement=tiered --contexts=131072 --batches=1 --selectors=index,retopk --auto_tau --steps=60 --warmup=10
--placement=tiered --contexts=524288 --batches=1 --selectors=index --steps=30 --warmup=5" \
  timeout 500 bash bench/placement_device_run.sh serving 2>&1 | grep -vE "^\s*$" | tail -n 30
for f in $OUT/gpu_serving_*.json; do python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[1].split("/")[-1], r["selector"], r["context"], "build", r.get("build_seconds_first"), "prefill", r.get("prefill_seconds"), "host", r.get("session_host_bytes"), "server_p50", r.get("server_p50_us"), "mix", r.get("path_mix"))' "$f"; done
cd "$OUT" && tar czf /tmp/d3_out.tgz . && find . -mindepth 1 -maxdepth 1 -exec rm -rf {} + ; mv /tmp/d3_out.tgz "$OUT/d3_out.tgz"
