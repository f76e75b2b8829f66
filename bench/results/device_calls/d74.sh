#!/usr/bin/env bash
# Seventy-fourth call: the tiered exact search's new default (policy.index.exact_search unset:
# the shortlist of N = 2K on a GPU). The GPU tests first (tiered_shortlist_test holds the
# default's served test), then on one kvrecalld, batch 1, auto_tau: tiered retopk + index at
# 128K and 512K with the default policy (no --shortlist, no --exact_search), the graph asked
# for by name at 128K (what the default was), and 512K with N = 2048 (d73's setting) beside
# the default's N = 1024. Bundle: .device/b74.
set -u
tar -C .device/b74 -xJf .device/b74/ship/bundle.tar.xz
B=$PWD/.device/b74/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b74/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d74; mkdir -p $L
S=$OUT/d74_summary.txt
cat /proc/loadavg | tee -a $S
for t in tiered_shortlist_test tiered_placement_test gpu_placement_test gpu_exact_heads_test \
         backend_seam_test; do
  timeout 240 $B/$t --gtest_brief=1 > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED|tests ran" $L/$t.log | head -8 | tee -a $S
done
echo "t=$SECONDS tests done" | tee -a $S
start_kvrecalld $B/kvrecalld $L/kvrecalld.log --address=127.0.0.1:0 || exit 1
n=0
run() {  # LABEL FLAG...
  n=$((n + 1))
  local label=$1
  shift
  [ $SECONDS -lt 520 ] || { echo "t=$SECONDS skip $label" | tee -a $S; return; }
  cat /proc/loadavg | tee -a $S
  timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json \
    --placement=tiered --batches=1 --selectors=retopk,index --auto_tau "$@" > /dev/null 2> $L/s$n.log
  echo "$n $label rc $? t=$SECONDS" | tee -a $S
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["context"], r["selector"], r.get("exact_search"), r.get("effective_shortlist"), "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), round(r["e2e_p99_us"]), "static", round(r.get("static_set_p50_us",0)), "devx", round(r.get("device_exact_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "bulk", round(r["bulk_p50_us"]), "decide", round(r.get("decide_p50_us",0)), "finish", round(r.get("finish_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step",0),2), r.get("path_mix"), "cand", {k:round(v.get("candidates_mean",0)) for k,v in r.get("head_bulk_by_path",{}).items()}, "gpuB", r.get("session_gpu_bytes"), "hostB", r.get("session_host_bytes"), "build", round(r.get("build_seconds_max",0),3))' $L/s$n.json "$n $label" 2>&1 | tee -a $S
}
run default-128K --contexts=131072 --steps=60 --warmup=8
run graph-128K --contexts=131072 --steps=40 --warmup=5 --exact_search=graph
run default-512K --contexts=524288 --steps=60 --warmup=8
run n2048-512K --contexts=524288 --steps=60 --warmup=8 --shortlist=2048
run default-128K-again --contexts=131072 --steps=60 --warmup=8
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/d74.tgz *.json *.log 2>/dev/null
