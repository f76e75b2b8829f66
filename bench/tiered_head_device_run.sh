#!/usr/bin/env bash
# Runs on the GPU machine (device tool) from the repository root: bench/tiered_head_bench on the
# host's cores, the base build against this one, interleaved, with the binaries bundled here into
# .device/bulk/bundle (shipped compressed as .device/bulk/ship/bundle.tar.xz):
#   bin/tiered_head_bench_base (built at e3c41fb, the bench before the kernel changes) and
#   bin/tiered_head_bench (this branch).
#   bench/tiered_head_device_run.sh [ROUNDS]
# HEAD_FLAGS: the bench's flags (default: 128K, 24 steps, the whole team). Outputs go to $OUT as
# tiered_head_<base|new>_<round>.json; logs to $OUT/tiered_head_logs.tgz.
set -uo pipefail
dir=$PWD/.device/bulk
. bench/device_env.sh
device_env "$dir" "$dir/bundle" tiered_head_logs
flags=${HEAD_FLAGS:---context=131072 --steps=24 --warmup=4}
nproc
for round in $(seq 1 "${1:-2}"); do
  for build in base new; do
    name=tiered_head_bench; [ "$build" = base ] && name=tiered_head_bench_base
    timeout 280 "$bin/$name" $flags > "$out/tiered_head_${build}_$round.json" \
      2> "$logs/${build}_$round.log" || { status=1; tail -n 5 "$logs/${build}_$round.log"; }
    echo "$build $round: $(head -c 300 "$out/tiered_head_${build}_$round.json")"
  done
done
tar -C "$(dirname "$logs")" -czf "$out/tiered_head_logs.tgz" "$(basename "$logs")"
exit $status
