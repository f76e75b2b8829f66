#!/usr/bin/env bash
# Thirty-eighth call: where the tier's Start and the new rows' coding spend their host time under
# a served step. kvrecalld-probe is fa15de0 with timing prints in GpuStaticSetTier::Start
# (cudaSetDevice; the upload's fills and copies into pinned memory; the graph key; the graph
# launch) and GpuBulkCodes::QueueNewRows (EncodeRows), not kept. Served 128K N = 1024 index and
# retopk auto_tau once; then driver_call_bench while host_gather_bench loads the memory from 15
# threads.
set -u
tar -C .device/b31 -xJf .device/b31/ship/bundle.tar.xz
B=$PWD/.device/b31/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b31/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d38; mkdir -p $L
S=$OUT/d38_summary.txt
cat /proc/loadavg | tee -a $S
n=0
for sel in index retopk; do
  n=$((n + 1))
  start_kvrecalld $B/kvrecalld-probe $L/k$n.log --address=127.0.0.1:0 || exit 1
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=131072 --batches=1 --selectors=$sel --auto_tau --steps=40 --warmup=5 --shortlist=1024 > /dev/null 2> $L/s$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["selector"], "srv", round(r["server_p50_us"]), "launch", round(r.get("launch_p50_us",0)), "codes", round(r.get("new_codes_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)))' $L/s$n.json $sel | tee -a $S
  python3 -c 'import sys,statistics as st,collections as c
v=c.defaultdict(list)
for line in open(sys.argv[1]):
  f=line.split()
  if not f or f[0]!="PROBE": continue
  if f[1]=="start":
    for k,x in zip(f[2::2],f[3::2]): v["start_"+k].append(float(x))
  elif f[1]=="encode": v["encode"].append(float(f[2])); v["encode_rows"].append(float(f[4]))
  else: v[f[1]].append(1)
print(sys.argv[2], {k:(len(x), round(st.median(x),1), round(sorted(x)[int(0.9*len(x))],1)) for k,x in v.items()})' $L/k$n.log $sel | tee -a $S
done
timeout 60 $B/host_gather_bench --tokens=131072 --threads=15 --steps=4000 --warmup=4 > $L/gather.json 2> $L/gather.log &
g=$!
sleep 3
timeout 60 $B/driver_call_bench > $L/driver_loaded.json 2> $L/driver_loaded.log; echo "driver_loaded rc $?" | tee -a $S
kill $g 2>/dev/null; wait $g 2>/dev/null
python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
print("driver_loaded", {k: (round(v["p50"],1), round(v["p99"],1)) for k,v in d["host_us"].items()}, "round_trip", round(d["graph_round_trip_us"]["p50"],1), "device", round(d["graph_device_us"]["p50"],1))' $L/driver_loaded.json | tee -a $S
echo "t=$SECONDS done" | tee -a $S
cd $L && tar czf $OUT/d38.tgz *.json *.log
