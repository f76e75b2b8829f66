#!/usr/bin/env bash
# Runs the image's runtime stage without Docker, for machines that have none: a minimal Debian
# 12 root (debootstrap --variant=minbase, what debian:bookworm-slim is made of) gets the
# binaries of a local build through deploy/install-runtime.sh, exactly as the Dockerfile's
# runtime stage does; then kvrecalld runs in it as user 10001 and must answer Health/Check
# SERVING and exit 0 on SIGTERM. Needs root, debootstrap and the Debian mirror; takes minutes,
# so it is a manual check, not a CTest.
# Usage: deploy/check-runtime-stage.sh BUILD_DIR [BASE_ROOTFS]
#   BUILD_DIR holds server/kvrecalld and client/kvrecall; BASE_ROOTFS (default
#   /tmp/kvrecall-bookworm-minbase) is bootstrapped once and copied for every run.
set -euo pipefail
deploy="$(cd "$(dirname "$0")" && pwd)"
build="$(cd "${1:?usage: $0 BUILD_DIR [BASE_ROOTFS]}" && pwd)"
base="${2:-/tmp/kvrecall-bookworm-minbase}"
[ "$(id -u)" -eq 0 ] || { echo "needs root (chroot, mounts)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "needs debootstrap: apt-get install debootstrap" >&2; exit 1; }

if [ ! -x "$base/bin/bash" ]; then
  debootstrap --variant=minbase bookworm "$base" http://deb.debian.org/debian
fi
root="$(mktemp -d /tmp/kvrecall-runtime.XXXXXX)"
cleanup() {
  [ -z "${server:-}" ] || kill "$server" 2>/dev/null || true
  umount "$root/proc" "$root/dev" 2>/dev/null || true
  rm -rf --one-file-system "$root"
}
trap cleanup EXIT
cp -a "$base/." "$root/"
cp /etc/resolv.conf "$root/etc/resolv.conf"
mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"

# The build stage's last steps: stage the binaries and list their runtime packages.
staged="$root/opt/kvrecall"
install -D -m 0755 -t "$staged/bin" "$build/server/kvrecalld" "$build/client/kvrecall" \
  "$deploy/runtime-packages.sh" "$deploy/install-runtime.sh"
"$staged/bin/runtime-packages.sh" "$staged/bin/kvrecalld" "$staged/bin/kvrecall" \
  >"$staged/runtime-packages.txt"

# The runtime stage.
chroot "$root" /opt/kvrecall/bin/install-runtime.sh /opt/kvrecall

echo "== runtime root: $(du -sh --exclude=proc --exclude=dev "$root" | cut -f1)," \
  "$(chroot "$root" dpkg-query -W -f='.\n' | wc -l) packages"
toolchain="$(chroot "$root" dpkg-query -W -f='${Package}\n' \
  | grep -E -- '-dev$|^(gcc|g\+\+|cpp|cmake|make|binutils)(-[0-9]+)?$' || true)"
[ -z "$toolchain" ] || { echo "FAIL: toolchain packages in the runtime root: $toolchain" >&2; exit 1; }

# USER 10001:10001 and CMD --address=0.0.0.0:50051, on a free loopback port instead.
port="$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
log="$root/kvrecalld.log"
chroot --userspec=10001:10001 "$root" /usr/local/bin/kvrecalld --address="127.0.0.1:$port" \
  >"$log" 2>&1 &
server=$!
/usr/bin/python3 - "$port" "$deploy/../tests" <<'EOF'
import sys, time, grpc
sys.path.insert(0, sys.argv[2])
from deploy_server_test import health_check, SERVING
address = f"127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 30
while True:
    try:
        status = health_check(address, "", timeout_s=1)
        break
    except grpc.RpcError as error:
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
wait "$server" && status=0 || status=$?
server=""
cat "$log"
[ "$status" -eq 0 ] || { echo "FAIL: kvrecalld exited $status after SIGTERM" >&2; exit 1; }
echo "PASS: runtime stage (kvrecalld ran as uid 10001, served, stopped cleanly)"
