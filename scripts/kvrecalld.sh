# Sourced by the scripts that need a kvrecalld beside them (scripts/demo.sh, bench/*.sh).
# start_kvrecalld BINARY LOG [FLAG...]: starts BINARY with FLAGs (e.g. --address=127.0.0.1:0;
# metrics go to a free loopback port unless a FLAG sets --metrics_address), its output in LOG,
# and waits up to 10 s for its "kvrecalld listening on ADDR" line; sets kvrecalld_pid and
# kvrecalld_address, or prints LOG and returns 1 if it exits or stays silent.
start_kvrecalld() {
  local binary=$1 log=$2
  shift 2
  "$binary" --metrics_address=127.0.0.1:0 "$@" >"$log" 2>&1 &
  kvrecalld_pid=$!
  for _ in $(seq 100); do
    kvrecalld_address=$(sed -n 's/^kvrecalld listening on //p' "$log")
    [ -z "$kvrecalld_address" ] || return 0
    kill -0 "$kvrecalld_pid" 2>/dev/null || break
    sleep 0.1
  done
  cat "$log" >&2
  return 1
}
