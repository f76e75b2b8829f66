#!/usr/bin/env bash
# The transport's floor and kvrecalld side by side, in one run (bench/results/rpc_floor.md):
# echo_floor in the sync and the callback API and kvrecalld, each listening on TCP loopback and
# on a Unix socket, each measured by the C++ client (rpc_overhead) and the Python client
# (rpc_overhead.py with numpy inputs; kvrecalld also with torch bf16 inputs where torch
# imports). The sync echo server is also measured as one unary call per round trip (C++ and
# Python) and through Python's grpc.aio: what other shapes of the API would cost.
#
#   bench/echo_floor.sh BIN_DIR PY_DIR OUT_DIR
#
# BIN_DIR holds echo_floor, kvrecalld and rpc_overhead; PY_DIR the Python modules the build
# generates (kvrecall/v1/*_pb2*.py from client/python/kvrecall/_gen and bench/echo_floor_pb2.py);
# empty PY_DIR: no Python runs. Environment: ITERATIONS (pairs per C++ run, default 10000),
# PY_ITERATIONS (default 4000), SERVERS (default "echo-sync echo-callback kvrecalld"; also
# kvrecalld-base, an earlier build to compare with in the same run (KVRECALLD_BASE, default
# BIN_DIR/kvrecalld-base), and kvrecalld-1t, kvrecalld with OMP_NUM_THREADS=1: every step's
# attention on the one thread that serves it), CLIENTS (default "c++ python-numpy python-torch
# c++-unary python-unary python-aio"; each server runs those that apply to it), KVRECALLD_FLAGS
# (more kvrecalld flags), KVRECALLD (another kvrecalld binary than BIN_DIR's).
# Writes OUT_DIR/<server>_<transport>_<client>.json, logs beside them, and
# OUT_DIR/rpc_floor_table.md (bench/echo_floor_table.py).
set -uo pipefail
bin=${1:?usage: echo_floor.sh BIN_DIR PY_DIR OUT_DIR}
py=${2?usage: echo_floor.sh BIN_DIR PY_DIR OUT_DIR}
out=${3:?usage: echo_floor.sh BIN_DIR PY_DIR OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
iterations=${ITERATIONS:-10000}
py_iterations=${PY_ITERATIONS:-4000}
python=${PYTHON:-python3}
mkdir -p "$out"
sockets=$(mktemp -d)
. "$root/scripts/kvrecalld.sh"
status=0

clients=${CLIENTS:-c++ python-numpy python-torch c++-unary python-unary python-aio}
have_torch=0
[ -n "$py" ] && "$python" -c 'import torch' 2>/dev/null && have_torch=1
# applies SERVER CLIENT: whether the run is made.
applies() {
  case $2 in
    python-*) [ -n "$py" ] || return 1 ;;
  esac
  case $1:$2 in
    *:python-torch) [ "$1" = kvrecalld ] && [ $have_torch = 1 ] ;;
    echo-sync:*-unary | echo-sync:python-aio) return 0 ;;
    *:*-unary | *:python-aio) return 1 ;;
    *) return 0 ;;
  esac
}
export PYTHONPATH="$root/client/python${py:+:$py}${PYTHONPATH:+:$PYTHONPATH}"

# start SERVER TRANSPORT: starts one server; sets pid and address.
start() {
  local server=$1 transport=$2 listen log=$out/${1}_$2.server.log
  if [ "$transport" = unix ]; then listen=unix:$sockets/$server.sock; else listen=127.0.0.1:0; fi
  # shm: DecodeShared's regions in a directory of their own (the call that opens one goes over TCP).
  local shm=()
  if [ "$transport" = shm ]; then
    mkdir -p "$sockets/shm-$server"
    shm=(--shared_memory_dir="$sockets/shm-$server")
  fi
  case $server in
    kvrecalld | kvrecalld-base | kvrecalld-1t)
      local binary=${KVRECALLD:-$bin/kvrecalld}
      [ "$server" = kvrecalld-base ] && binary=${KVRECALLD_BASE:-$bin/kvrecalld-base}
      if [ "$server" = kvrecalld-1t ]; then
        # shellcheck disable=SC2086
        OMP_NUM_THREADS=1 start_kvrecalld "$binary" "$log" --address="$listen" "${shm[@]}" \
          ${KVRECALLD_FLAGS:-} || return 1
      else
        # shellcheck disable=SC2086
        start_kvrecalld "$binary" "$log" --address="$listen" "${shm[@]}" ${KVRECALLD_FLAGS:-} \
          || return 1
      fi
      pid=$kvrecalld_pid address=$kvrecalld_address ;;
    echo-*)
      "$bin/echo_floor" --api="${server#echo-}" --address="$listen" >"$log" 2>&1 &
      pid=$!
      address=
      for _ in $(seq 100); do
        address=$(sed -n 's/^echo_floor listening on \([^ ]*\).*/\1/p' "$log")
        [ -z "$address" ] && kill -0 "$pid" 2>/dev/null && sleep 0.1 && continue
        break
      done
      [ -n "$address" ] || { cat "$log" >&2; return 1; } ;;
  esac
}

for transport in ${TRANSPORTS:-tcp unix shm}; do
  for server in ${SERVERS:-echo-sync echo-callback kvrecalld}; do
    # Shared memory is kvrecalld's own transport (DecodeShared); the echo has none.
    [ "$transport" = shm ] && [ "${server#kvrecalld}" = "$server" ] && continue
    start "$server" "$transport" || { status=1; continue; }
    protocol=echo
    [ "${server#kvrecalld}" != "$server" ] && protocol=kvrecall
    for client in $clients; do
      applies "$server" "$client" || continue
      name=${server}_${transport}_${client}
      common=(--server="$address" --server_pid="$pid" --label="$server" --json_out="$out/$name.json")
      [ "$transport" = shm ] && common+=(--shared_memory)
      case $client in
        c++)
          "$bin/rpc_overhead" --protocol=$protocol "${common[@]}" --iterations="$iterations" \
            > "$out/$name.log" 2>&1 ;;
        c++-unary)
          "$bin/rpc_overhead" --protocol=echo-unary "${common[@]}" --iterations="$iterations" \
            > "$out/$name.log" 2>&1 ;;
        python-unary)
          PYTHONUNBUFFERED=1 "$python" "$here/rpc_overhead.py" --protocol=echo-unary \
            "${common[@]}" --iterations="$py_iterations" > "$out/$name.log" 2>&1 ;;
        python-aio)
          PYTHONUNBUFFERED=1 "$python" "$here/rpc_overhead.py" --protocol=echo --api=aio \
            "${common[@]}" --iterations="$py_iterations" > "$out/$name.log" 2>&1 ;;
        python-*)
          PYTHONUNBUFFERED=1 "$python" "$here/rpc_overhead.py" --protocol=$protocol \
            "${common[@]}" --inputs="${client#python-}" --iterations="$py_iterations" \
            > "$out/$name.log" 2>&1 ;;
      esac
      rc=$?
      [ $rc -eq 0 ] || status=1
      echo "== $name (rc $rc)"
      grep -vE '^\{' "$out/$name.log" | head -n 12
    done
    kill "$pid"
    wait "$pid" 2>/dev/null
  done
done
rm -rf "$sockets"
"$python" "$here/echo_floor_table.py" "$out"/*_*_*.json > "$out/rpc_floor_table.md" || status=1
cat "$out/rpc_floor_table.md"
exit $status
