#!/usr/bin/env bash
# Thirty-seventh call: a48c93e as committed (the PQ table and collect kernels of d36, the scan
# as before) on the H200. GPU tests (the PQ test also under memcheck); the kernels under ncu;
# driver_call_bench on an idle host and with every core busy; served 128K N = 1024 retopk
# auto_tau + index, new / base (327b55b) alternated four times with pauses; 512K index N = 2048
# new / base once each.
set -u
tar -C .device/b30 -xJf .device/b30/ship/bundle.tar.xz
B=$PWD/.device/b30/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b30/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d37; mkdir -p $L
S=$OUT/d37_summary.txt
cat /proc/loadavg | tee -a $S
for t in cuda_pq_shortlist_test cuda_exact_topk_test cuda_retopk_test index_batch_topk_test tiered_shortlist_test tiered_placement_test gpu_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/cuda_pq_shortlist_test > $L/memcheck.log 2>&1; echo "memcheck cuda_pq_shortlist_test rc $?" | tee -a $S
grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck.log | head -4 | tee -a $S
echo "t=$SECONDS tests done" | tee -a $S
K128="--context=131072 --graph=false --shortlists=1024 --steps=6 --warmup=2"
timeout 100 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --log-file $L/ncu.csv $B/pq_shortlist_bench $K128 > /dev/null 2> $L/ncu.err; echo "ncu rc $?" | tee -a $S
python3 -c 'import csv,sys,statistics as st,collections as c
rows=[r for r in csv.reader(open(sys.argv[1])) if len(r)>10]
h=rows[0]; ki=h.index("Kernel Name"); vi=h.index("Metric Value"); ui=h.index("Metric Unit")
t=c.defaultdict(list)
for r in rows[1:]:
  t[r[ki].split("(")[0][-40:]].append(float(r[vi].replace(",",""))*{"ns":1e-3,"nsecond":1e-3,"us":1.0,"usecond":1.0,"ms":1e3,"msecond":1e3}[r[ui]])
for k,v in t.items(): print("ncu", k, "n", len(v), "median_us", round(st.median(v),2), "min", round(min(v),2))' $L/ncu.csv 2>&1 | tee -a $S
drv() {  # TAG
  timeout 60 $B/driver_call_bench > $L/$1.json 2> $L/$1.log; echo "$1 rc $?" | tee -a $S
  python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
print(sys.argv[2], {k: (round(v["p50"],1), round(v["p99"],1)) for k,v in d["host_us"].items()}, "round_trip", round(d["graph_round_trip_us"]["p50"],1), "device", round(d["graph_device_us"]["p50"],1))' $L/$1.json $1 2>&1 | tee -a $S
}
drv driver_idle
busy=()
for i in $(seq 16); do timeout 20 sh -c 'while :; do :; done' & busy+=($!); done
sleep 1
drv driver_busy16
kill "${busy[@]}" 2>/dev/null; wait "${busy[@]}" 2>/dev/null
echo "t=$SECONDS driver done" | tee -a $S
n=0
run() {  # BINARY-NAME SHORTLIST [CONTEXT SELECTORS]
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=${3:-131072} --batches=1 --selectors=${4:-retopk,index} --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_busy_p50_us","heads_concurrency_p50")], "launch", round(r.get("launch_p50_us",0)), "codes", round(r.get("new_codes_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "build", round(r["build_seconds_max"],3), "gpuB", r["session_gpu_bytes"])' $L/s$n.json "$n $1 N=$2" 2>&1 | tee -a $S
  grep -i "error\|host" $L/k$n.log | head -3 | tee -a $S
}
for spec in "kvrecalld 1024" "kvrecalld-base 1024" "kvrecalld-base 1024" "kvrecalld 1024" "kvrecalld 1024" "kvrecalld-base 1024" "kvrecalld-base 1024" "kvrecalld 1024" "kvrecalld 2048 524288 index" "kvrecalld-base 2048 524288 index"; do
  [ $SECONDS -lt 480 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  sleep 5
  cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS served done" | tee -a $S
cd $L && tar czf $OUT/d37.tgz *.json *.log *.csv *.err
