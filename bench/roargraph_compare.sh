#!/usr/bin/env bash
# RoarGraph (github.com/matchyc/RoarGraph, the VLDB 2024 code) against kvrecall's graph index on
# the same data, one thread each: recall@100, keys scored, hops, us per query, ns per scored key.
#
#   bench/roargraph_compare.sh ROARGRAPH_BUILD [KVRECALL[,KVRECALL...]]
#
# ROARGRAPH_BUILD: a folder holding RoarGraph's test_build_roargraph and test_search_roargraph,
# built outside this project. Its DiskANN submodule is needed only for its ground-truth tool,
# which this script replaces, so the two programs can be built alone (Boost.ProgramOptions and
# OpenMP; the flags are RoarGraph's own Release flags):
#   for t in test_build_roargraph test_search_roargraph; do
#     g++ -std=c++17 -O3 -Ofast -DNDEBUG -march=native -mtune=native -ftree-vectorize -DINFO \
#       -fopenmp -fno-builtin-malloc -fno-builtin-calloc -fno-builtin-realloc -fno-builtin-free \
#       -g -Iinclude -Ithirdparty/robin-map/include src/index.cpp src/index_bipartite.cpp \
#       tests/$t.cpp -o build/$t -lboost_program_options -lpthread
#   done
# KVRECALL: the kvrecall binary (default build/client/kvrecall); several, separated by commas
# (e.g. before and after a change), each run in every round and tabulated under its file name.
#
# Environment: WORK (scratch folder, default /tmp/roargraph_compare), LISTS (search-list sizes,
# default 200,500,1000,2000), RUNS (rounds, default 3), KEYS_HELD (bench-index's --keys for
# ours, default "f32 served"), REPEAT (how many times RoarGraph's test queries are tiled: its
# clock counts milliseconds; default 20), M_PJBP / L_PJPQ (RoarGraph's degree and build list,
# default 32, as kvrecall's max_degree, and 500, the paper's).
#
# The data: one synthetic 32K layer (d = 128, 8 query heads over 2 KV heads), as in
# bench/results/index_bench.md's "Search loop cost per scored key". Each KV head's keys, the
# build queries kvrecall's graph samples with their causal top-100 lists (RoarGraph's bipartite
# input) and the test queries go to RoarGraph's files (bench/roargraph_compare.py export).
# RoarGraph builds one graph per KV head with those lists (inner product); kvrecall bench-index
# builds its own. Then, per round, RoarGraph searches (both KV heads' queries) and bench-index
# searches (every list size twice, the first pass a warm-up), alternately, one thread each, and
# the table gives medians over the rounds (ns per key: median, min-max).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rg="${1:?usage: $0 ROARGRAPH_BUILD [KVRECALL[,KVRECALL...]]}"
IFS=, read -r -a kvrecalls <<< "${2:-$root/build/client/kvrecall}"
for k in "${kvrecalls[@]}"; do
  [[ -x "$k" ]] || { echo "no kvrecall binary $k (pass it as the second argument)" >&2; exit 1; }
done
kvrecall="${kvrecalls[0]}"
work="${WORK:-/tmp/roargraph_compare}"
lists="${LISTS:-200,500,1000,2000}"
runs="${RUNS:-3}"
keys_held="${KEYS_HELD:-f32 served}"
repeat="${REPEAT:-20}"
m_pjbp="${M_PJBP:-32}"
l_pjpq="${L_PJPQ:-500}"
py=/usr/bin/python3
mkdir -p "$work"
trace="$work/synth32k.safetensors"
kv_heads=2

[[ -f "$trace" ]] || "$kvrecall" synth --out="$trace" --context=32768 --decode_steps=32 \
  --layers=1 --q_heads=8 --kv_heads=$kv_heads --head_dim=128

for h in $(seq 0 $((kv_heads - 1))); do
  d="$work/kv$h"
  mkdir -p "$d"
  if [[ ! -f "$d/test_gt.bin" ]]; then
    $py "$root/bench/roargraph_compare.py" export --trace "$trace" --out "$d" --kv_head "$h" \
      --repeat "$repeat"
  fi
  if [[ ! -f "$d/roar.index" ]]; then
    "$rg/test_build_roargraph" --data_type float --dist ip --base_data_path "$d/base.fbin" \
      --sampled_query_data_path "$d/train.fbin" --learn_base_nn_path "$d/train_gt.bin" \
      --projection_index_save_path "$d/roar.index" --M_sq 100 --M_pjbp "$m_pjbp" \
      --L_pjpq "$l_pjpq" -T "$(nproc)" > "$d/build.log" 2>&1
  fi
  grep -E "indexing time|average degree|max degree" "$d/build.log" | sed "s/^/kv$h: /"
done

# One thread each; raised priority where permitted (the machine may be shared).
nice_cmd=()
nice -n -10 true 2>/dev/null && nice_cmd=(nice -n -10)
export OMP_NUM_THREADS=1
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
roar_csvs=()
declare -A ours_jsons
for r in $(seq 1 "$runs"); do
  for h in $(seq 0 $((kv_heads - 1))); do
    d="$work/kv$h"
    "${nice_cmd[@]}" "$rg/test_search_roargraph" --data_type float --dist ip \
      --base_data_path "$d/base.fbin" --projection_index_save_path "$d/roar.index" \
      --gt_path "$d/test_gt.bin" --query_path "$d/test.fbin" --L_pq ${lists//,/ } --k 100 -T 1 \
      --evaluation_save_path "$work/roar_r${r}_kv$h.csv" > "$work/roar_r${r}_kv$h.log" 2>&1
    roar_csvs+=("$work/roar_r${r}_kv$h.csv")
  done
  for keys in $keys_held; do
    for i in "${!kvrecalls[@]}"; do
      json="$work/ours${i}_${keys}_r$r.json"
      "${nice_cmd[@]}" "${kvrecalls[$i]}" bench-index --trace="$trace" --methods=graph \
        --graph_topk=cpu --k=100 --keys="$keys" --lists="$lists,$lists" --json > "$json"
      ours_jsons[$i,$keys]+=" $json"
    done
  done
  echo "round $r done, load average $(cut -d' ' -f1-3 /proc/loadavg)"
done

echo "RoarGraph, both KV heads' graphs, and kvrecall (--keys=${keys_held// /, then --keys=}):"
for keys in $keys_held; do
  echo
  echo "kvrecall keys held: $keys"
  ours_args=()
  for i in "${!kvrecalls[@]}"; do
    # shellcheck disable=SC2206
    ours_args+=(--ours "$(basename "${kvrecalls[$i]}")" ${ours_jsons[$i,$keys]})
  done
  $py "$root/bench/roargraph_compare.py" table --heads "$kv_heads" --roargraph "${roar_csvs[@]}" \
    "${ours_args[@]}"
done
