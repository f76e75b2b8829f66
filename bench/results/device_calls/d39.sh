#!/usr/bin/env bash
# Thirty-ninth call: the tier's step captured as two graphs when it has shortlists (the
# shortlists' part launched first, on its own; d38 measured ~40 us for the whole step's
# launch). GPU tests of the tiered and gpu placements; served 128K N = 1024 retopk auto_tau +
# index, new / base (a48c93e) alternated three times.
set -u
tar -C .device/b32 -xJf .device/b32/ship/bundle.tar.xz
B=$PWD/.device/b32/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b32/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d39; mkdir -p $L
S=$OUT/d39_summary.txt
cat /proc/loadavg | tee -a $S
for t in tiered_shortlist_test tiered_placement_test gpu_placement_test; do
  timeout 120 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
echo "t=$SECONDS tests done" | tee -a $S
n=0
run() {  # BINARY-NAME SHORTLIST
  n=$((n + 1))
  start_kvrecalld $B/$1 $L/k$n.log --address=127.0.0.1:0 || return 1
  timeout 100 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s$n.json --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau --steps=40 --warmup=5 --shortlist=$2 > /dev/null 2> $L/s$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "bulk", round(r["bulk_p50_us"]), "heads", [round(r.get(k,0),1) for k in ("heads_first_start_p50_us","heads_last_end_p50_us","heads_busy_p50_us","heads_concurrency_p50")], "launch", round(r.get("launch_p50_us",0)), "codes", round(r.get("new_codes_p50_us",0)), "ready", round(r.get("shortlists_ready_p50_us",0)), "shortlist", round(r.get("shortlist_p50_us",0)), "ss", round(r["static_set_p50_us"]))' $L/s$n.json "$n $1" 2>&1 | tee -a $S
}
for spec in "kvrecalld 1024" "kvrecalld-base 1024" "kvrecalld-base 1024" "kvrecalld 1024" "kvrecalld 1024" "kvrecalld-base 1024"; do
  [ $SECONDS -lt 170 ] || { echo "t=$SECONDS skip $spec" | tee -a $S; continue; }
  run $spec
done
echo "t=$SECONDS served done" | tee -a $S
cd $L && tar czf $OUT/d39.tgz *.json *.log
