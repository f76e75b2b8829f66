#!/usr/bin/env bash
# Prints the Debian packages that own the shared libraries the given binaries load, one per
# line, so the image's runtime stage installs exactly those (and nothing of the toolchain).
# Usage: deploy/runtime-packages.sh BINARY...   Fails naming any library no package owns.
# KVRECALL_UNPACKAGED_PREFIXES (colon-separated directories, unset in the image build): libraries
# under them that no package owns are reported and left out instead of failing, for a machine
# whose CUDA toolkit is NVIDIA's tarball (the image installs NVIDIA's packages, which dpkg knows).
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }

under_unpackaged_prefix() {
  local lib="$1" real prefix
  real="$(readlink -f "$lib")"
  IFS=: read -ra prefixes <<<"${KVRECALL_UNPACKAGED_PREFIXES:-}"
  for prefix in "${prefixes[@]}"; do
    [ -n "$prefix" ] || continue
    case "$lib/" in "${prefix%/}"/*) return 0 ;; esac
    case "$real/" in "${prefix%/}"/*) return 0 ;; esac
  done
  return 1
}

# Mounted into the container from the host driver by the NVIDIA container runtime; never
# installed in the image.
host_provided='^\s*(libcuda\.so\.1|libnvidia-ml\.so\.1) => not found'

libs="$(for bin in "$@"; do
  out="$(ldd "$bin")" || { echo "ldd failed on $bin" >&2; exit 1; }
  unresolved="$(grep "not found" <<<"$out" | grep -Ev "$host_provided" || true)"
  if [ -n "$unresolved" ]; then
    echo "$bin has unresolved libraries:" >&2; echo "$unresolved" >&2; exit 1
  fi
  # "libx.so.1 => /path (0x..)" or "/lib64/ld-linux-x86-64.so.2 (0x..)"; linux-vdso has no file.
  awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' <<<"$out"
done | sort -u)"

# dpkg records a library under the path its package shipped; on a merged-/usr system ldd may
# report the other spelling (/lib vs /usr/lib) or a symlink (the libblas.so.3 alternative), so
# every spelling is asked about, in one dpkg-query call (each call reads dpkg's whole database).
spellings() {
  local lib="$1" real
  real="$(readlink -f "$lib")"
  printf '%s\n' "$lib" "$real" "/usr${lib}" "/usr${real}" "${lib#/usr}" "${real#/usr}"
}
# "libfoo1:amd64: /path" -> "/path libfoo1"
owners="$(for lib in $libs; do spellings "$lib"; done | sort -u \
  | xargs dpkg-query -S 2>/dev/null | sed -n 's/^\([^:,]*\)\(:[^:]*\)\?: \(\/.*\)$/\3 \1/p' || true)"

packages=()
missing=0
for lib in $libs; do
  pkg=""
  for path in $(spellings "$lib"); do
    pkg="$(awk -v p="$path" '$1 == p {print $2; exit}' <<<"$owners")"
    [ -z "$pkg" ] || break
  done
  if [ -n "$pkg" ]; then packages+=("$pkg")
  elif under_unpackaged_prefix "$lib"; then
    echo "left out (under KVRECALL_UNPACKAGED_PREFIXES): $lib" >&2
  else
    echo "no Debian package owns $lib" >&2; missing=1
  fi
done
[ "$missing" -eq 0 ] || exit 1
printf '%s\n' "${packages[@]}" | sort -u
