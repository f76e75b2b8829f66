#!/usr/bin/env bash
# Thirty-sixth call: the PQ shortlist's kernels reworked from d35's profile (the table kernel
# reads every part's centroids at once, the scan loads its tables as vectors and four keys'
# codes before scoring them, the collect pass skips warps with nothing at or above the
# threshold bin) and the step's begin event inside the captured step. New (scan chunk >= 4096
# keys), c2048 (>= 2048) and base (327b55b) binaries. GPU tests (the PQ test also under
# memcheck); per-kernel ncu times; the kernels alone alternated; served 128K N = 1024 retopk
# auto_tau + index, new / base alternated three times, then c2048.
set -u
tar -C .device/b29 -xJf .device/b29/ship/bundle.tar.xz
B=$PWD/.device/b29/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b29/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d36; mkdir -p $L
S=$OUT/d36_summary.txt
cat /proc/loadavg | tee -a $S
for t in cuda_pq_shortlist_test cuda_exact_topk_test cuda_retopk_test index_batch_topk_test tiered_shortlist_test tiered_placement_test gpu_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/cuda_pq_shortlist_test > $L/memcheck.log 2>&1; echo "memcheck cuda_pq_shortlist_test rc $?" | tee -a $S
grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck.log | head -4 | tee -a $S
echo "t=$SECONDS tests done" | tee -a $S
K128="--context=131072 --graph=false --shortlists=1024 --steps=6 --warmup=2"
for v in pq_shortlist_bench pq_shortlist_bench_base pq_shortlist_bench_c2048; do
  timeout 100 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --log-file $L/ncu_$v.csv $B/$v $K128 > /dev/null 2> $L/ncu_$v.err; echo "ncu $v rc $?" | tee -a $S
  python3 -c 'import csv,sys,statistics as st,collections as c
rows=[r for r in csv.reader(open(sys.argv[1])) if len(r)>10]
h=rows[0]; ki=h.index("Kernel Name"); vi=h.index("Metric Value"); ui=h.index("Metric Unit")
t=c.defaultdict(list)
for r in rows[1:]:
  t[r[ki].split("(")[0][-40:]].append(float(r[vi].replace(",",""))*{"ns":1e-3,"nsecond":1e-3,"us":1.0,"usecond":1.0,"ms":1e3,"msecond":1e3}[r[ui]])
for k,v in t.items(): print(sys.argv[2], k, "n", len(v), "median_us", round(st.median(v),2), "min", round(min(v),2))' $L/ncu_$v.csv $v 2>&1 | tee -a $S
done
echo "t=$SECONDS ncu done" | tee -a $S
kern() {  # BINARY TAG FLAGS...
  local bin=$1 tag=$2; shift 2
  timeout 100 $B/$bin "$@" > $L/$tag.json 2> $L/$tag.log; echo "$tag rc $?" | tee -a $S
  python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
for name, v in d["variants"].items():
  print(sys.argv[2], name, {k: round(v[k]["p50"], 2) for k in ("total_us","gpu_us","gpu_kernels_us","gpu_select_alone_us","host_us","recall_at_k") if k in v})' $L/$tag.json $tag 2>&1 | tee -a $S
}
KB="--context=131072 --graph=false --shortlists=1024,2048 --steps=40 --warmup=4"
for r in 1 2; do
  kern pq_shortlist_bench kn$r $KB
  kern pq_shortlist_bench_base kb$r $KB
  kern pq_shortlist_bench_c2048 kc$r $KB
done
K512="--context=524288 --graph=false --shortlists=2048 --steps=16 --warmup=2"
kern pq_shortlist_bench kn512 $K512
kern pq_shortlist_bench_base kb512 $K512
echo "t=$SECONDS kernels done" | tee -a $S
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
for spec in "kvrecalld 1024" "kvrecalld-base 1024" "kvrecalld 1024" "kvrecalld-base 1024" "kvrecalld 1024" "kvrecalld-base 1024" "kvrecalld-c2048 1024"; do
  [ $SECONDS -lt 500 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  cat /proc/loadavg | tee -a $S
  run $spec
done
echo "t=$SECONDS served done" | tee -a $S
cd $L && tar czf $OUT/d36.tgz *.json *.log *.csv *.err
