#!/usr/bin/env bash
# Second call: the warm-up (cuda_retopk_test), the served 128K build in the server's first and
# second session, 1M tokens tiered, and the empty round trip alone (TCP).
set -u
start=$SECONDS
tar -C .device/lead -xJf .device/lead/ship/bundle.tar.xz
mkdir -p .device/hop && ln -sfn ../lead/bundle .device/hop/bundle
BUNDLE=.device/lead/bundle timeout 90 bash bench/device_run.sh tests 2>&1 | tail -n 8
echo "== t=$((SECONDS-start)) serving"
SERVING_TIMEOUT=330 SERVING_RUNS="--placement=tiered --contexts=131072 --batches=1 --selectors=index --steps=30 --warmup=5
--placement=tiered --contexts=131072 --batches=1 --selectors=index --steps=30 --warmup=5
--placement=tiered --contexts=1048576 --batches=1 --selectors=index,retopk --auto_tau --steps=40 --warmup=5" \
  timeout 420 bash bench/placement_device_run.sh serving 2>&1 | grep -vE "^\s*$" | tail -n 40
for f in $OUT/gpu_serving_*.json; do python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[1].split("/")[-1], r["selector"], r["context"], "build", r.get("build_seconds_first"), "host", r.get("session_host_bytes"), "gpu", r.get("session_gpu_bytes"), "mix", r.get("path_mix"))' "$f"; done
echo "== t=$((SECONDS-start)) alone"
BUDGET_S=80 ITERATIONS=3000 timeout 80 bash bench/echo_floor_device.sh alone 2>&1 | tail -n 8
echo "== t=$((SECONDS-start)) done"
cd "$OUT" && tar czf /tmp/d2_out.tgz --exclude='*.tgz' . && find . -mindepth 1 -maxdepth 1 -exec rm -rf {} + ; mv /tmp/d2_out.tgz "$OUT/d2_out.tgz"
