#!/usr/bin/env bash
# What serving Prometheus metrics costs a decode step (bench/results/metrics_overhead.md): two
# kvrecalld, one with --metrics_address= (no metrics: no interceptor on the calls) and one with
# metrics on a loopback port (every call and Decode request counted and timed, the layer-step
# counters and histograms recorded), measured by rpc_overhead in alternating rounds so that
# both see the same machine load. The layer-step counters are recorded in both (they are
# plain atomics); the difference is the interceptor and the scrapes' absence/presence.
#
#   bench/metrics_overhead.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds kvrecalld and rpc_overhead. Environment: ROUNDS (default 3), ITERATIONS (pairs
# per run, default 5000). Writes OUT_DIR/metrics_{off,on}_r<N>.json and
# OUT_DIR/metrics_overhead.json (per round and the medians, bench/metrics_overhead_table.py).
set -euo pipefail
bin=${1:?usage: metrics_overhead.sh BIN_DIR OUT_DIR}
out=${2:?usage: metrics_overhead.sh BIN_DIR OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
rounds=${ROUNDS:-3}
iterations=${ITERATIONS:-5000}
mkdir -p "$out"
. "$root/scripts/kvrecalld.sh"

start_kvrecalld "$bin/kvrecalld" "$out/kvrecalld_off.log" --address=127.0.0.1:0 --metrics_address=
off_pid=$kvrecalld_pid off_address=$kvrecalld_address
start_kvrecalld "$bin/kvrecalld" "$out/kvrecalld_on.log" --address=127.0.0.1:0
on_pid=$kvrecalld_pid on_address=$kvrecalld_address
metrics_url=$(sed -n 's/^kvrecalld metrics on //p' "$out/kvrecalld_on.log")
trap 'kill "$off_pid" "$on_pid" 2>/dev/null; wait "$off_pid" "$on_pid" 2>/dev/null' EXIT

for round in $(seq "$rounds"); do
  for mode in off on; do
    if [ "$mode" = off ]; then address=$off_address pid=$off_pid; else address=$on_address pid=$on_pid; fi
    "$bin/rpc_overhead" --server="$address" --server_pid="$pid" --iterations="$iterations" \
      --label="metrics_$mode" --json_out="$out/metrics_${mode}_r$round.json" \
      >"$out/metrics_${mode}_r$round.txt" 2>&1
  done
  # A scrape between rounds, as Prometheus would make one every few seconds.
  /usr/bin/python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1]).read()" \
    "$metrics_url"
done
/usr/bin/python3 "$here/metrics_overhead_table.py" "$out" "$rounds" >"$out/metrics_overhead.json"
cat "$out/metrics_overhead.json"
