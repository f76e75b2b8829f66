#!/usr/bin/env bash
# Thirty-fifth call: 58406f3 (QueueNewRows) and the tier's launch split from the new rows' coding
# (TierMicros.new_codes) on the H200. GPU tests; the PQ shortlist's kernels one by one under ncu
# (durations at 128K N = 1024 and 512K N = 2048; the full set for one scan and one collect
# launch at 128K); served 128K N = 1024 retopk auto_tau + index, twice, for where the time
# before the shortlists goes.
set -u
tar -C .device/b28 -xJf .device/b28/ship/bundle.tar.xz
B=$PWD/.device/b28/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b28/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d35; mkdir -p $L
S=$OUT/d35_summary.txt
cat /proc/loadavg | tee -a $S
for t in cuda_pq_shortlist_test bulk_codes_test tiered_shortlist_test tiered_placement_test gpu_placement_test cuda_exact_topk_test cuda_retopk_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
echo "t=$SECONDS tests done" | tee -a $S
K128="--context=131072 --graph=false --shortlists=1024 --steps=6 --warmup=2"
K512="--context=524288 --graph=false --shortlists=2048 --steps=4 --warmup=1"
NCU="ncu --clock-control none --cache-control none"
timeout 150 $NCU --metrics gpu__time_duration.sum --csv $B/pq_shortlist_bench $K128 > $L/ncu128.csv 2> $L/ncu128.err; echo "ncu128 rc $?" | tee -a $S
timeout 150 $NCU --metrics gpu__time_duration.sum --csv $B/pq_shortlist_bench $K512 > $L/ncu512.csv 2> $L/ncu512.err; echo "ncu512 rc $?" | tee -a $S
for f in ncu128 ncu512; do
  python3 -c 'import csv,sys,statistics as st,collections as c
rows=[r for r in csv.reader(open(sys.argv[1])) if len(r)>10]
h=rows[0]; ki=h.index("Kernel Name"); vi=h.index("Metric Value"); ui=h.index("Metric Unit")
t=c.defaultdict(list)
for r in rows[1:]:
  v=float(r[vi].replace(",",""))*{"ns":1e-3,"nsecond":1e-3,"us":1.0,"usecond":1.0,"ms":1e3,"msecond":1e3}[r[ui]]
  t[r[ki].split("(")[0][:60]].append(v)
for k,v in t.items(): print(sys.argv[2], k, "n", len(v), "median_us", round(st.median(v),2), "max", round(max(v),2))' $L/$f.csv $f 2>&1 | tee -a $S
done
echo "t=$SECONDS ncu times done" | tee -a $S
timeout 150 $NCU --set full -k regex:PqScanKernel --launch-skip 4 --launch-count 1 $B/pq_shortlist_bench $K128 > $OUT/d35_ncu_scan.txt 2> $L/ncu_scan.err; echo "ncu scan rc $?" | tee -a $S
timeout 150 $NCU --set full -k regex:RowCollectKernel --launch-skip 4 --launch-count 1 $B/pq_shortlist_bench $K128 > $OUT/d35_ncu_collect.txt 2> $L/ncu_collect.err; echo "ncu collect rc $?" | tee -a $S
timeout 150 $NCU --set full -k regex:PqTableKernel --launch-skip 4 --launch-count 1 $B/pq_shortlist_bench $K128 > $OUT/d35_ncu_table.txt 2> $L/ncu_table.err; echo "ncu table rc $?" | tee -a $S
echo "t=$SECONDS ncu full done" | tee -a $S
timeout 100 $B/pq_shortlist_bench --context=131072 --graph=false --shortlists=1024,2048 --steps=40 --warmup=4 > $L/kn1.json 2> $L/kn1.log; echo "kn1 rc $?" | tee -a $S
python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
for name, v in d["variants"].items():
  print("kn1", name, {k: round(v[k]["p50"], 2) for k in ("total_us","gpu_us","gpu_kernels_us","gpu_select_alone_us","host_us","recall_at_k") if k in v})' $L/kn1.json 2>&1 | tee -a $S
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
for spec in "kvrecalld 1024" "kvrecalld 1024"; do
  [ $SECONDS -lt 420 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS served done" | tee -a $S
cd $L && tar czf $OUT/d35.tgz *.json *.log *.csv *.err
