#!/usr/bin/env bash
# Seventieth call, an experiment (not committed): d39b219 with stderr averages of the parts of a
# tiered step's finish (the tier's Finish: its query+sync and the rest; EndBulk and the balance;
# the merge and commit), 128K retopk and index at batch 1 and retopk at batch 8.
set -u
tar -C .device/b70 -xJf .device/b70/ship/bundle.tar.xz
B=$PWD/.device/b70/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b70/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d70; mkdir -p $L
S=$OUT/d70_summary.txt
n=0
for spec in "1 retopk,index" "8 retopk"; do
  set -- $spec
  n=$((n + 1))
  start_kvrecalld $B/kvrecalld-exp $L/k$n.log --address=127.0.0.1:0 || exit 1
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=131072 --batches=$1 --selectors=$2 --auto_tau --steps=40 --warmup=5 --shortlist=1024 > /dev/null 2> $L/s$n.log
  echo "rc $? batch $1 $2" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  grep EXP $L/k$n.log | tail -8 | tee -a $S
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(r["batch"], r["selector"], "srv", round(r["server_p50_us"]), "finish", round(r.get("finish_p50_us",0)), "fwait", round(r.get("finish_wait_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step"),2))' $L/s$n.json | tee -a $S
done
echo "t=$SECONDS all done" | tee -a $S
