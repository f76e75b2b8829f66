# Sourced by the scripts that run on the device machine (device_run.sh, placement_device_run.sh,
# echo_floor_device.sh): `device_env DIR BUNDLE LOGS` unpacks the carried DIR/ship/bundle.tar.xz
# into DIR unless BUNDLE/bin is there already, and sets bundle (BUNDLE), bin, LD_LIBRARY_PATH,
# out ($OUT, default /tmp/out, created), logs (a fresh folder named LOGS) and status (0).
device_env() {
  local dir=$1
  bundle=$2
  if [ ! -d "$bundle/bin" ] && [ -f "$dir/ship/bundle.tar.xz" ]; then
    tar -C "$dir" -xJf "$dir/ship/bundle.tar.xz"
  fi
  export LD_LIBRARY_PATH=$bundle/lib
  bin=$bundle/bin
  out=${OUT:-/tmp/out}
  logs=$(mktemp -d)/$3
  mkdir -p "$out" "$logs"
  status=0
}
