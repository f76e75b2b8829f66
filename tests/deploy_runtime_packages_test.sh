#!/usr/bin/env bash
# Runs deploy/runtime-packages.sh (the Dockerfile's step that picks the runtime stage's
# packages) on the real binaries the image ships, on this Debian 12 machine.
# Usage: deploy_runtime_packages_test.sh BINARY...
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
script="$here/../deploy/runtime-packages.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }

# With CUDA on, the binaries load this machine's CUDA toolkit, NVIDIA's tarball under
# /usr/local/cuda that no package owns; the image installs NVIDIA's packages instead.
cuda_root="$(readlink -f /usr/local/cuda 2>/dev/null || true)"
if [ -n "$cuda_root" ] && ! dpkg-query -S "$cuda_root" >/dev/null 2>&1; then
  export KVRECALL_UNPACKAGED_PREFIXES="/usr/local/cuda:$cuda_root"
fi
packages="$("$script" "$@")" || fail "runtime-packages.sh failed on $*"
echo "$packages"
# kvrecalld links gRPC, protobuf, Abseil, OpenMP and BLAS; each must come with its package.
for required in libc6 libstdc++6 libgomp1 libgrpc++1.51 libprotobuf32 libabsl20220623; do
  grep -qx "$required" <<<"$packages" || fail "$required missing from: $(echo $packages)"
done
grep -qx 'libopenblas0-.*' <<<"$packages" || fail "no OpenBLAS runtime package (libblas.so.3 is an alternative)"
while read -r package; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
    || fail "$package is not an installed package"
  case "$package" in *-dev|build-essential|cmake|g++*|gcc*) fail "toolchain package $package in the runtime list";; esac
done <<<"$packages"

# The failure paths the Docker build relies on to stop early.
if "$script" /nonexistent 2>/dev/null; then fail "a missing binary was accepted"; fi
if "$script" "$script" 2>/dev/null; then fail "a script (not a dynamic binary) was accepted"; fi
# A binary that loads a library no package owns (as a hand-installed one would be).
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
echo 'int unpackaged(void) { return 7; }' >"$scratch/unpackaged.c"
echo 'int unpackaged(void); int main(void) { return unpackaged(); }' >"$scratch/main.c"
cc -shared -fPIC -o "$scratch/libunpackaged.so" "$scratch/unpackaged.c"
cc -o "$scratch/main" "$scratch/main.c" -L"$scratch" -lunpackaged -Wl,-rpath,"$scratch"
if out="$("$script" "$scratch/main" 2>&1)"; then fail "an unpackaged library was accepted: $out"; fi
grep -qF "no Debian package owns $scratch/libunpackaged.so" <<<"$out" || fail "unexpected message: $out"
echo "PASS: deploy runtime packages"
