#!/usr/bin/env bash
# The project's dependencies point down (server -> index -> kernels; proto beside them for the
# wire; client and server never include each other): every #include "dir/..." of a project
# folder must name a folder that folder may depend on. One include root (the repository) lets
# any file include any other, so this is where the layering is held.
#
#   tests/layering_test.sh [REPOSITORY_ROOT]
set -u
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$root" || exit 2

# Folder: the project folders its files may include ("kvrecall/" is the generated protobuf).
declare -A allowed=(
  [kernels]="kernels"
  [index]="index kernels"
  [proto]="proto kernels kvrecall"
  [server]="server index kernels proto kvrecall"
  [client]="client index kernels proto kvrecall"
)
project_dirs="kernels index proto server client bench tests deploy scripts kvrecall"

failures=0
for dir in "${!allowed[@]}"; do
  while IFS= read -r hit; do
    file="${hit%%:*}"
    rest="${hit#*:}"
    line="${rest%%:*}"
    [[ "${rest#*:}" =~ \#[[:space:]]*include[[:space:]]+\"([^/\"]+)/ ]] || continue
    target="${BASH_REMATCH[1]}"
    case " $project_dirs " in *" $target "*) ;; *) continue ;; esac  # a third-party path
    case " ${allowed[$dir]} " in
      *" $target "*) ;;
      *)
        echo "FAIL: $file:$line includes $target/, which $dir/ may not depend on" \
             "(allowed: ${allowed[$dir]})"
        failures=$((failures + 1))
        ;;
    esac
  done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"[^/"]+/' "$dir" \
             --include="*.h" --include="*.cc" --include="*.cu" --include="*.cuh" 2>/dev/null || true)
done

# The check itself must see what it checks: a forbidden include in a scratch copy is caught.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/kernels"
printf '#include "server/session.h"\n' >"$scratch/kernels/bad.h"
if [ -z "${LAYERING_SELF_CHECK:-}" ] &&
    LAYERING_SELF_CHECK=1 bash "$0" "$scratch" >/dev/null 2>&1; then
  echo "FAIL: the check passed a kernels/ header that includes server/"
  failures=$((failures + 1))
fi

if [ "$failures" -gt 0 ]; then
  echo "$failures forbidden include(s)"
  exit 1
fi
echo "PASS: every project include points down the layers"
