#!/usr/bin/env bash
# Sixty-eighth call: batch 8 at 128K with the shortlist and the GPU's exact heads (6c0753c's
# binaries, b67): retopk and index, auto_tau, N = 1024; the benchmark asks for batch 1
# and 8, and the last batch-8 figure at 128K was the graph's (~9 ms, d-era 6afbf8d).
set -u
tar -C .device/b67 -xJf .device/b67/ship/bundle.tar.xz
B=$PWD/.device/b67/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b67/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d68; mkdir -p $L
S=$OUT/d68_summary.txt
cat /proc/loadavg | tee -a $S
start_kvrecalld $B/kvrecalld $L/k.log --address=127.0.0.1:0 || exit 1
timeout 480 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s8.json --placement=tiered --contexts=131072 --batches=8 --selectors=retopk,index --auto_tau --steps=40 --warmup=5 --shortlist=1024 > /dev/null 2> $L/s8.log
echo "rc $?" | tee -a $S
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(r["context"], r["batch"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "devx", round(r.get("device_exact_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "plan", round(r.get("plan_p50_us",0)), "launch", round(r.get("launch_p50_us",0)), "decide", round(r.get("decide_p50_us",0)), "fwait", round(r.get("finish_wait_p50_us",0)), "finish", round(r.get("finish_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step"),2), {k:(v["heads"], round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "gpu_bytes", r["session_gpu_bytes"], "build", round(r["build_seconds_max"],3), "prefill", round(r["prefill_seconds"],1))' $L/s8.json 2>&1 | tee -a $S
tail -5 $L/s8.log | tee -a $S
cat /proc/loadavg | tee -a $S
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/d68.tgz *.json *.log 2>/dev/null
