#!/usr/bin/env bash
# Forty-third call: why a served step's graph launch costs ~40 us against 12.8 us for a graph
# spelled with the same kinds of node (d40). driver_call_bench with graphs of distinct kernel
# functions, kernels of 2 KB of parameters and of 100 KB of shared memory; a probe build of
# kvrecalld (bench/results/device_calls/d43_probe.patch, not the server's code) that lists each
# captured step's nodes and times 300 launches of it on its idle stream, under a served 128K
# index N = 1024 run.
set -u
tar -C .device/b43 -xJf .device/b43/ship/bundle.tar.xz
B=$PWD/.device/b43/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b43/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d43; mkdir -p $L
S=$OUT/d43_summary.txt
cat /proc/loadavg | tee -a $S
timeout 120 $B/driver_call_bench --reps=1000 --pool_graphs=served,served_distinct > $L/driver_idle.json 2> $L/driver_idle.log; echo "driver rc $?" | tee -a $S
python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
for k,v in d["graph_launch_us"].items(): print("launch", k, v["nodes"], v["graph_nodes"], "p50", round(v["p50"],1), "p99", round(v["p99"],1))
for k,v in d.get("pool_launch_us",{}).items(): print("pool launch", k, "p50", round(v["p50"],1), "p99", round(v["p99"],1))' $L/driver_idle.json 2>&1 | tee -a $S
KVRECALL_PROBE_GRAPH=1 start_kvrecalld $B/kvrecalld-probe $L/k1.log --address=127.0.0.1:0 || exit 1
timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s1.json --placement=tiered --contexts=131072 --batches=1 --selectors=index --steps=10 --warmup=2 --shortlist=1024 > /dev/null 2> $L/s1.log
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
grep "probe graph" $L/k1.log | head -8 | tee -a $S
python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(r["context"], r["selector"], "srv", round(r["server_p50_us"]), "launch", round(r.get("launch_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)))' $L/s1.json 2>&1 | tee -a $S
echo "t=$SECONDS done" | tee -a $S
cd $L && tar czf $OUT/d43.tgz *.json *.log
