#!/usr/bin/env bash
# The server's instructions per Decode round trip, kvrecalld beside the echo floor, counted by
# callgrind: repeatable on a noisy machine where the round trips' wall time is not
# (bench/results/rpc_floor.md, "dev-machine figures"). Each server runs under callgrind twice
# per kind of round trip, serving LO and then HI round trips of bench/rpc_overhead
# --count_only (one stream, the C++ client); (Ir(HI) - Ir(LO)) / (HI - LO) is the server's
# instructions per round trip, its start, the session's prefill and the stream's setup cancelled
# out. The HI run's profile is kept for callgrind_annotate.
#
#   bench/callgrind_hop.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds echo_floor, kvrecalld and rpc_overhead. Environment: SERVERS (default
# "echo-callback echo-sync kvrecalld"), KINDS (default "empty layer_step"), LO / HI (default 200
# / 2200), TRANSPORT (tcp or unix, default tcp), KVRECALLD_FLAGS (more kvrecalld flags; metrics
# are off unless they set --metrics_address), KVRECALLD (another kvrecalld binary), LABEL (names
# kvrecalld's rows). Prints one line per server and kind; OUT_DIR/callgrind_hop.tsv holds them.
set -uo pipefail
bin=${1:?usage: callgrind_hop.sh BIN_DIR OUT_DIR}
out=${2:?usage: callgrind_hop.sh BIN_DIR OUT_DIR}
lo=${LO:-200}
hi=${HI:-2200}
mkdir -p "$out"
sockets=$(mktemp -d)
status=0

# run SERVER KIND N: one server under callgrind serving N round trips of KIND; prints its Ir.
run() {
  local server=$1 kind=$2 n=$3 name=$1_$2_$3 listen log address pid protocol=echo
  log=$out/$name.server.log
  if [ "${TRANSPORT:-tcp}" = unix ]; then listen=unix:$sockets/$name.sock; else listen=127.0.0.1:0; fi
  local cmd=("$bin/echo_floor" --api="${server#echo-}" --address="$listen")
  if [ "$server" = kvrecalld ]; then
    protocol=kvrecall
    # shellcheck disable=SC2206
    cmd=("${KVRECALLD:-$bin/kvrecalld}" --address="$listen" --metrics_address= ${KVRECALLD_FLAGS:-})
  fi
  valgrind --tool=callgrind --callgrind-out-file="$out/$name.callgrind" "${cmd[@]}" >"$log" 2>&1 &
  pid=$!
  address=
  for _ in $(seq 300); do
    address=$(sed -n 's/^\(kvrecalld\|echo_floor\) listening on \([^ ]*\).*/\2/p' "$log")
    [ -n "$address" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$address" ]; then
    cat "$log" >&2
    return 1
  fi
  "$bin/rpc_overhead" --protocol=$protocol --server="$address" --count_only="$kind" --warmup=0 \
    --iterations="$n" > "$out/$name.client.log" 2>&1 || { cat "$out/$name.client.log" >&2; status=1; }
  kill "$pid"
  wait "$pid" 2>/dev/null
  sed -n 's/^==[0-9]*== Collected : \([0-9]*\)/\1/p' "$log"
}

printf 'server\tkind\tinstructions per round trip\n' > "$out/callgrind_hop.tsv"
for server in ${SERVERS:-echo-callback echo-sync kvrecalld}; do
  for kind in ${KINDS:-empty layer_step}; do
    a=$(run "$server" "$kind" "$lo") && b=$(run "$server" "$kind" "$hi") || { status=1; continue; }
    per=$(( (b - a) / (hi - lo) ))
    name=$server
    [ "$server" = kvrecalld ] && name="kvrecalld${LABEL:+ ($LABEL)}"
    printf '%s\t%s\t%s\n' "$name" "$kind" "$per" | tee -a "$out/callgrind_hop.tsv"
  done
done
rm -rf "$sockets"
exit $status
