#!/usr/bin/env bash
# Fifth call: batch 8 at 16K and 64K (tiered retopk auto_tau and index), 2e114c8.
set -u
tar -C .device/lead -xJf .device/lead/ship/bundle.tar.xz
SERVING_TIMEOUT=250 SERVING_RUNS="--placement=tiered --contexts=16384,65536 --batches=8 --selectors=retopk,index --auto_tau --steps=40 --warmup=5" \
  timeout 280 bash bench/placement_device_run.sh serving 2>&1 | grep -vE "^\s*$" | tail -n 30
for f in $OUT/gpu_serving_*.json; do python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(r["selector"], r["context"], "b", r["batch"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, r.get("path_mix"), "build", round(r["build_seconds_max"],3), "host MiB", round(r["session_host_bytes"]/2**20))' "$f"; done
cd "$OUT" && tar czf /tmp/d5_out.tgz . && find . -mindepth 1 -maxdepth 1 -exec rm -rf {} + ; mv /tmp/d5_out.tgz "$OUT/d5_out.tgz"
