#!/usr/bin/env bash
# Eleventh call: the narrow beam at 512K (retopk auto_tau, batch 1) against fa8d2b3's clamp.
set -u
tar -C .device/b10 -xJf .device/b10/ship/bundle.tar.xz
B=$PWD/.device/b10/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b10/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d11; mkdir -p $L
n=0
for v in exp200 prev; do
  n=$((n + 1))
  case $v in prev) k=$B/kvrecalld-prev;; exp200) k=$B/kvrecalld-exp;; esac
  start_kvrecalld $k $L/k$n.log --address=127.0.0.1:0 || continue
  timeout 270 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/serving$n.json --placement=tiered --contexts=524288 --batches=1 --selectors=retopk --auto_tau --steps=40 --warmup=5 > /dev/null 2> $L/serving$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "mix", r.get("path_mix"), "build", round(r["build_seconds_max"],3))' $L/serving$n.json "$n $v" | tee -a $OUT/d11_summary.txt
done
cd $L && tar czf $OUT/d11.tgz *.json *.log
