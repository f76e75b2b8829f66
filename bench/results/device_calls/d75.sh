#!/usr/bin/env bash
# Seventy-fifth call: what the default exact search (the shortlist of N = 2K on a GPU) keeps of
# full attention, beside the graph and N = 2048: gpu_serving_bench --fidelity_steps (untimed
# compare_exact steps after the timed ones: support recall, retained mass, output cosine), tiered,
# batch 1, auto_tau, the synthetic trace, 128K and 512K, one kvrecalld. Bundle: .device/b75.
set -u
tar -C .device/b75 -xJf .device/b75/ship/bundle.tar.xz
B=$PWD/.device/b75/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b75/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d75; mkdir -p $L
S=$OUT/d75_summary.txt
cat /proc/loadavg | tee -a $S
start_kvrecalld $B/kvrecalld $L/kvrecalld.log --address=127.0.0.1:0 || exit 1
n=0
run() {  # LABEL FLAG...
  n=$((n + 1))
  local label=$1
  shift
  [ $SECONDS -lt 500 ] || { echo "t=$SECONDS skip $label" | tee -a $S; return; }
  timeout 300 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json \
    --placement=tiered --batches=1 --auto_tau --steps=24 --warmup=4 --fidelity_steps=8 "$@" \
    > /dev/null 2> $L/s$n.log
  echo "$n $label rc $? t=$SECONDS" | tee -a $S
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], r.get("exact_search"), r.get("effective_shortlist"), "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "fidelity", {k: round(v, 4) for k, v in (r.get("fidelity") or {}).items()}, r.get("path_mix"), "build", round(r.get("build_seconds_max",0),3))' $L/s$n.json "$n $label" 2>&1 | tee -a $S
}
run default-128K --contexts=131072 --selectors=index,retopk
run graph-128K --contexts=131072 --selectors=index,retopk --exact_search=graph
run default-512K --contexts=524288 --selectors=index,retopk
run n2048-512K --contexts=524288 --selectors=index,retopk --shortlist=2048
run graph-512K --contexts=524288 --selectors=index --exact_search=graph
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/d75.tgz *.json *.log 2>/dev/null
