#!/usr/bin/env bash
# Eightieth call: d79's 16K and 64K tiered retopk rows at batch 1 (643 and 536 us, against 307
# at 16K in d73-d74) ran with the batch-8 run's eight sessions open. The same policy, batch 1
# alone (one session a context), then 16K with batches 1,8 again (eight sessions) to see whether
# the open sessions are what slowed it. Bundle: .device/b79 (d79's).
set -u
tar -C .device/b79 -xJf .device/b79/ship/bundle.tar.xz
B=$PWD/.device/b79/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b79/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d80; mkdir -p $L
S=$OUT/d80_summary.txt
start_kvrecalld $B/kvrecalld $L/kvrecalld.log --address=127.0.0.1:0 || exit 1
n=0
run() {
  n=$((n + 1))
  cat /proc/loadavg | tee -a $S
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json "$@" \
    > /dev/null 2> $L/s$n.log
  echo "$n rc $? t=$SECONDS: $*" | tee -a $S
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["batch"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "devx", round(r.get("device_exact_p50_us",0)), "bulk", round(r.get("bulk_p50_us",0)), "decide", round(r.get("decide_p50_us",0)), "finish", round(r.get("finish_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step",0),2), "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_concurrency_p50")])' $L/s$n.json "$n" 2>&1 | tee -a $S
}
run --placement=tiered --contexts=16384,65536,131072 --batches=1 --selectors=retopk --auto_tau --steps=40 --warmup=5
run --placement=tiered --contexts=16384 --batches=1,8 --selectors=retopk --auto_tau --steps=30 --warmup=5
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
echo "t=$SECONDS all done" | tee -a $S
