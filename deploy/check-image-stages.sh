#!/usr/bin/env bash
# Runs the image's two stages without Docker, for machines that have none. Each stage gets a
# fresh copy of a minimal Debian 12 root (debootstrap --variant=minbase, what
# debian:bookworm-slim is made of), used as a chroot, and the same scripts the Dockerfile runs:
#   build stage   (--build only) scripts/install_deps.sh and deploy/build-binaries.sh on the
#                 working tree less deploy/Dockerfile.dockerignore, as docker build sends it
#   runtime stage deploy/install-runtime.sh
# Then kvrecalld runs in the runtime root as user 10001, must answer Health/Check SERVING for
# "" and kvrecall.v1.KvRecall, and must exit 0 on SIGTERM. Needs root, debootstrap and the
# Debian mirror; takes minutes (about half an hour with --build on 2 cores): a manual check,
# not a CTest. CPU variant only: NVIDIA's repository is not reachable from the dev machines.
# Usage: deploy/check-image-stages.sh --build | --prebuilt BUILD_DIR
#   --prebuilt stages server/kvrecalld and client/kvrecall from a local build instead.
# Environment: KVRECALL_BASE_ROOTFS (default /tmp/kvrecall-bookworm-minbase), bootstrapped
# once and copied for every stage.
set -euo pipefail
deploy="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$deploy/.." && pwd)"
usage="usage: $0 --build | --prebuilt BUILD_DIR"
case "${1:-}" in
  --build) mode=build ;;
  --prebuilt) mode=prebuilt; build_dir="$(cd "${2:?$usage}" && pwd)" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
base="${KVRECALL_BASE_ROOTFS:-/tmp/kvrecall-bookworm-minbase}"
[ "$(id -u)" -eq 0 ] || { echo "needs root (chroot, mounts)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "needs debootstrap: apt-get install debootstrap" >&2; exit 1; }
if [ ! -x "$base/bin/bash" ]; then
  debootstrap --variant=minbase bookworm "$base" http://deb.debian.org/debian
fi

roots=()
server=""
cleanup() {
  [ -z "$server" ] || kill "$server" 2>/dev/null || true
  for root in "${roots[@]}"; do
    # Never remove a root whose /dev is still the host's: --one-file-system alone would skip it,
    # but stopping here is plainer.
    umount "$root/proc" "$root/dev" || { echo "could not unmount in $root; left in place" >&2; continue; }
    rm -rf --one-file-system "$root"
  done
}
trap cleanup EXIT
# Sets $new_root to a fresh copy of the base root with /proc and /dev mounted. Not called in
# a subshell: `roots` must record it for the cleanup.
new_root() {
  new_root="$(mktemp -d /tmp/kvrecall-stage.XXXXXX)"
  roots+=("$new_root")
  cp -a "$base/." "$new_root/"
  cp /etc/resolv.conf "$new_root/etc/resolv.conf"
  mount -t proc proc "$new_root/proc"
  mount --bind /dev "$new_root/dev"
}

new_root
runtime="$new_root"
if [ "$mode" = build ]; then
  new_root
  build_root="$new_root"
  mkdir -p "$build_root/src"
  # The build context: the ignore file's patterns (comments and blank lines dropped), anchored
  # at the repository root as Docker reads them.
  grep -Ev '^(#|$)' "$deploy/Dockerfile.dockerignore" >"$build_root/context-excludes"
  (cd "$repo" && tar --anchored --exclude-from="$build_root/context-excludes" -cf - -- * .[!.]*) \
    | tar -x -C "$build_root/src"
  echo "== build stage: scripts/install_deps.sh"
  chroot "$build_root" /src/scripts/install_deps.sh
  echo "== build stage: deploy/build-binaries.sh"
  chroot "$build_root" /src/deploy/build-binaries.sh /src /build /opt/kvrecall
  cp -a "$build_root/opt/kvrecall" "$runtime/opt/kvrecall"
else
  "$deploy/build-binaries.sh" --prebuilt "$repo" "$build_dir" "$runtime/opt/kvrecall"
fi

echo "== runtime stage: deploy/install-runtime.sh"
chroot "$runtime" /opt/kvrecall/bin/install-runtime.sh /opt/kvrecall
echo "== runtime root: $(du -sh --exclude=proc --exclude=dev "$runtime" | cut -f1)," \
  "$(chroot "$runtime" dpkg-query -W -f='.\n' | wc -l) packages"
toolchain="$(chroot "$runtime" dpkg-query -W -f='${Package}\n' \
  | grep -E -- '-dev$|^(gcc|g\+\+|cpp|cmake|make|binutils)(-[0-9]+)?$' || true)"
[ -z "$toolchain" ] || { echo "FAIL: toolchain packages in the runtime root: $toolchain" >&2; exit 1; }

# The image's USER 10001:10001 and CMD --address=0.0.0.0:50051, on a free loopback port.
port="$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
log="$runtime/kvrecalld.log"
chroot --userspec=10001:10001 "$runtime" /usr/local/bin/kvrecalld --address="127.0.0.1:$port" \
  --metrics_address=127.0.0.1:0 >"$log" 2>&1 &
server=$!
/usr/bin/python3 - "$port" "$repo/tests" <<'EOF'
import sys, time, grpc
sys.path.insert(0, sys.argv[2])
from deploy_server_test import health_check, SERVING
address = f"127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 30
while True:
    try:
        status = health_check(address, "", timeout_s=1)
        break
    except grpc.RpcError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
assert status == SERVING, status
assert health_check(address, "kvrecall.v1.KvRecall", timeout_s=1) == SERVING
print(f"== Health/Check on {address}: SERVING")
EOF
uid="$(awk '/^Uid:/ {print $2}' "/proc/$server/status")"
[ "$uid" = 10001 ] || { echo "FAIL: kvrecalld runs as uid $uid, not 10001" >&2; exit 1; }
kill -TERM "$server"
status=0
wait "$server" || status=$?
server=""
cat "$log"
[ "$status" -eq 0 ] || { echo "FAIL: kvrecalld exited $status after SIGTERM" >&2; exit 1; }
echo "PASS: image stages ($mode): kvrecalld ran as uid 10001 in the runtime root, served, stopped cleanly"
