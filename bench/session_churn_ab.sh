#!/usr/bin/env bash
# bench/session_churn.py against two kvrecalld binaries in turn, twice each (a kvrecalld of its
# own per run, on a loopback port), one JSON line per run (bench/results/session_churn.jsonl):
#   bench/session_churn_ab.sh BEFORE_KVRECALLD AFTER_KVRECALLD [ROUNDS]
set -u
before=$1 after=$2 rounds=${3:-60}
run() {  # LABEL BINARY PORT
  "$2" --address=127.0.0.1:"$3" > "/tmp/session_churn_$1.log" 2>&1 &
  local pid=$!
  sleep 2
  PYTHONPATH=client/python /usr/bin/python3 bench/session_churn.py --server 127.0.0.1:"$3" \
    --rounds "$rounds" --label "$1"
  kill "$pid"
  wait "$pid" 2>/dev/null
}
for round in 1 2; do
  run before "$before" 50161
  run after "$after" 50162
done
