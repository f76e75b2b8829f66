#!/usr/bin/env bash
# Tenth call: a narrow graph-search beam (branch experiment/narrow-beam: a search list L below K
# returns the best K of every key the beam scored) against fa8d2b3 (L = K), tiered 128K.
set -u
tar -C .device/b10 -xJf .device/b10/ship/bundle.tar.xz
B=$PWD/.device/b10/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b10/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d10; mkdir -p $L
n=0
for v in prev exp200 exp128 prev exp200 exp128; do
  n=$((n + 1))
  case $v in prev) k=$B/kvrecalld-prev f="";; exp128) k=$B/kvrecalld-exp f=--search_list_size=128;; exp200) k=$B/kvrecalld-exp f="";; esac
  start_kvrecalld $k $L/k$n.log --address=127.0.0.1:0 || continue
  timeout 90 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/serving$n.json --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau --steps=40 --warmup=5 $f > /dev/null 2> $L/serving$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "mix", r.get("path_mix"), "build", round(r["build_seconds_max"],3))' $L/serving$n.json "$n $v" | tee -a $OUT/d10_summary.txt
done
cd $L && tar czf $OUT/d10.tgz *.json *.log
