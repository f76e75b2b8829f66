#!/usr/bin/env bash
# Installs what kvrecall needs to build and test on Debian 12, skipping what is already there.
set -euo pipefail

apt_packages=(
  build-essential cmake pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libhnswlib-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
  nlohmann-json3-dev grpc-proto
  python3-grpcio python3-numpy python3-protobuf
  nghttp2-client
)

missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# buf (a grpcurl equivalent that speaks reflection) for the CLI integration tests and README examples.
tools_dir="$(cd "$(dirname "$0")/.." && pwd)/.tools"
if ! command -v buf >/dev/null 2>&1 && [ ! -x "$tools_dir/node_modules/.bin/buf" ]; then
  if command -v npm >/dev/null 2>&1; then
    mkdir -p "$tools_dir"
    npm install --prefix "$tools_dir" --no-audit --no-fund --silent @bufbuild/buf >/dev/null \
      || echo "warning: could not install buf from npm; the buf tests will skip" >&2
  fi
fi
