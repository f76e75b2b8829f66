#!/usr/bin/env bash
# The image's runtime stage (deploy/Dockerfile), run as root on a fresh Debian 12: installs the
# packages the build stage listed, puts kvrecalld and kvrecall in /usr/local/bin, proves that
# they resolve every library and start, and adds the unprivileged user 10001.
# Usage: install-runtime.sh [STAGED_DIR]   (default /opt/kvrecall, removed at the end) holding
#   bin/{kvrecalld,kvrecall,runtime-packages.sh}, runtime-packages.txt and, for a CUDA build,
#   cuda-keyring.deb (NVIDIA's apt repository, where the CUDA runtime packages come from).
set -euo pipefail
staged="${1:-/opt/kvrecall}"
export DEBIAN_FRONTEND=noninteractive

apt-get update -qq
if [ -f "$staged/cuda-keyring.deb" ]; then
  apt-get install -y -qq --no-install-recommends ca-certificates
  dpkg -i "$staged/cuda-keyring.deb"
  apt-get update -qq
fi
xargs -a "$staged/runtime-packages.txt" apt-get install -y -qq --no-install-recommends
rm -rf /var/lib/apt/lists/*

install -m 0755 "$staged/bin/kvrecalld" "$staged/bin/kvrecall" /usr/local/bin/
# Fails naming any library the installed packages did not bring.
"$staged/bin/runtime-packages.sh" /usr/local/bin/kvrecalld /usr/local/bin/kvrecall >/dev/null
/usr/local/bin/kvrecalld --version

useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
  --shell /usr/sbin/nologin kvrecall
rm -rf "$staged"
