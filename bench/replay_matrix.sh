#!/usr/bin/env bash
# Replays one trace through a fresh kvrecalld once per policy and collects the JSON lines:
#   bench/replay_matrix.sh TRACE OUT.jsonl "REPLAY FLAGS" ["REPLAY FLAGS" ...]
# e.g. bench/replay_matrix.sh t.safetensors out.jsonl "--policy=full" "--policy=retopk --k=128"
# Each line of OUT.jsonl is `kvrecall replay --json`'s object plus the flags that made it;
# bench/replay_table.py renders the lines as a markdown table. Binaries: ${BUILD:-build}.
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,6p "$0" >&2; exit 2; }
trace=$1 out=$2; shift 2
build=${BUILD:-build}
log=$(mktemp)
kvrecalld_pid=""
trap 'kill "$kvrecalld_pid" 2>/dev/null; rm -f "$log"' EXIT
. "$(dirname "$0")/../scripts/kvrecalld.sh"
start_kvrecalld "$build/server/kvrecalld" "$log" --address=127.0.0.1:0
address=$kvrecalld_address
for flags in "$@"; do
  echo "replay $flags" >&2
  # shellcheck disable=SC2086  # the flags are words on purpose
  line=$("$build/client/kvrecall" replay --server="$address" --trace="$trace" $flags --json)
  /usr/bin/python3 -c 'import json,sys; o=json.loads(sys.argv[1]); o["flags"]=sys.argv[2]; print(json.dumps(o))' \
    "$line" "$flags" >> "$out"
done
