#!/usr/bin/env bash
# One device call: the hop (TCP / Unix / shared memory), the CUDA tests, the 128K index build
# (bench-index, f32 and served keys) and the served tiered 128K rows.
set -u
start=$SECONDS
tar -C .device/lead -xJf .device/lead/ship/bundle.tar.xz
mkdir -p .device/hop && ln -sfn ../lead/bundle .device/hop/bundle
echo "== floor"
BUDGET_S=230 FLOOR_S=210 ITERATIONS=3000 PY_ITERATIONS=1000 SERVERS="echo-sync echo-callback kvrecalld" \
  CLIENTS="c++ python-numpy" bash bench/echo_floor_device.sh floor 2>&1 | tail -n 40
echo "== t=$((SECONDS-start)) tests + index_llama"
BUNDLE=.device/lead/bundle INDEX_QUERIES=4096 INDEX_SCOPES=kv_head INDEX_KEYS="f32 served" \
  timeout 200 bash bench/device_run.sh tests index_llama 2>&1 | tail -n 40
for f in $OUT/index_llama128k_*.json; do
  python3 -c 'import json,sys
d=json.load(open(sys.argv[1])); m=d["methods"]["graph"]; g=m["graph"]
print(sys.argv[1].split("/")[-1], "build_by_layer", m["build_seconds_by_layer"], "topk_gpu", d.get("graph_topk_gpu",{}).get("seconds"), d.get("graph_topk_gpu",{}).get("calls"), "graph_per_index", round(g["graph_seconds_per_index"],3), {k: round(v,3) for k,v in g["graph_steps_seconds_per_index"].items()}, "topk_per_index", round(g["topk_seconds_per_index"],4))
pts=m.get("points",[])
for p in pts[:8]: print("  ", {k:p[k] for k in p if k in ("list_size","recall","scanned_fraction","search_microseconds")})' "$f"
done
echo "== t=$((SECONDS-start)) serving"
SERVING_TIMEOUT=170 SERVING_RUNS="--placement=tiered --contexts=131072 --batches=1 --selectors=index,retopk --auto_tau --steps=60 --warmup=10" \
  timeout 190 bash bench/placement_device_run.sh serving 2>&1 | tail -n 45
echo "== t=$((SECONDS-start)) done"
cd "$OUT" && tar czf /tmp/d1_out.tgz --exclude='*.tgz' . && find . -mindepth 1 -maxdepth 1 ! -name '*.md' -exec rm -rf {} + ; mv /tmp/d1_out.tgz "$OUT/d1_out.tgz"; ls -la "$OUT"
