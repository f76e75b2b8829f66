#!/usr/bin/env bash
# Ninth call: heads selected together (graph searches interleaved) against one by one.
# 1. tiered_head_bench at 128K, 16 threads: --heads_together=1 vs the server's grouping (0),
#    each with the phases pass's alone / pairs / fours interleaved searches on one thread.
# 2. kvrecalld-prev (fa8d2b3) against kvrecalld (this change), tiered 128K retopk auto_tau and
#    index, ABAB.
set -u
tar -C .device/b9 -xJf .device/b9/ship/bundle.tar.xz
B=$PWD/.device/b9/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b9/bundle/lib
. scripts/kvrecalld.sh
L=$OUT/d9; mkdir -p $L
echo "host: $(nproc) CPUs; $(lscpu | grep -E 'Model name|Thread|Core|Socket|L1d|L2|L3' | tr -s ' ' | tr '\n' ';')"
summ() { python3 -c 'import json,sys
d=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
p=lambda k: round(d[k]["p50"],1)
print(sys.argv[2], "together", d["heads_together"], "build", round(d["build_s"],2), "reuse", round(d["reuse_fraction"],2), "team p50", p("step_team_us"), "p90", round(d["step_team_us"]["p90"]), "exact head", p("step_exact_head_us"), "reuse head", p("step_reuse_head_us"), "| 1-thread search/head alone", p("search_per_head_alone_us"), "pairs", p("search_per_head_in_pairs_us"), "fours", p("search_per_head_in_fours_us"), "phases search", p("exact_search_us"), "keys", p("exact_search_keys"))' "$@"; }
for t in 1 0; do
  timeout 150 $B/tiered_head_bench --context=131072 --steps=30 --warmup=4 --heads_together=$t > $L/head_$t.json 2> $L/head_$t.log
  summ $L/head_$t.json "head bench"
done
n=0
for v in prev new prev new; do
  n=$((n + 1))
  case $v in prev) k=$B/kvrecalld-prev;; new) k=$B/kvrecalld;; esac
  start_kvrecalld $k $L/k$n.log --address=127.0.0.1:0 || continue
  timeout 110 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/serving$n.json --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau --steps=40 --warmup=5 > /dev/null 2> $L/serving$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "mix", r.get("path_mix"), "build", round(r["build_seconds_max"],3))' $L/serving$n.json "$n $v"
done
