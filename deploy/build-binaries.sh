#!/usr/bin/env bash
# The image's build stage (deploy/Dockerfile) once its packages are installed: compiles
# kvrecalld and the kvrecall CLI (Release, no tests) and stages them in OUT_DIR together with
# the runtime stage's scripts and the list of Debian packages their libraries come from.
# Usage: build-binaries.sh [--prebuilt] SOURCE_DIR BUILD_DIR OUT_DIR
#   --prebuilt stages the binaries already in BUILD_DIR without configuring or building it.
# Environment: CUDA_VERSION (NVIDIA's package suffix such as 13-0; empty: CPU only),
#              KVRECALL_X86_64_V3 (ON|OFF, default ON).
set -euo pipefail
prebuilt=0
if [ "${1:-}" = --prebuilt ]; then prebuilt=1; shift; fi
src="${1:?usage: $0 [--prebuilt] SOURCE_DIR BUILD_DIR OUT_DIR}" build="${2:?}" out="${3:?}"

if [ "$prebuilt" -eq 0 ]; then
  cuda_flags=(-DKVRECALL_WITH_CUDA=OFF)
  if [ -n "${CUDA_VERSION:-}" ]; then
    # The CUDA kernels choose their own architectures (Hopper, kernels/cuda/CMakeLists.txt).
    cuda_flags=(-DKVRECALL_WITH_CUDA=ON
                "-DCMAKE_CUDA_COMPILER=/usr/local/cuda-${CUDA_VERSION/-/.}/bin/nvcc")
  fi
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF \
    "-DKVRECALL_X86_64_V3=${KVRECALL_X86_64_V3:-ON}" "${cuda_flags[@]}"
  cmake --build "$build" --target kvrecalld kvrecall -j"$(nproc)"
fi

install -D -m 0755 -t "$out/bin" "$build/server/kvrecalld" "$build/client/kvrecall" \
  "$src/deploy/runtime-packages.sh" "$src/deploy/install-runtime.sh"
"$out/bin/runtime-packages.sh" "$out/bin/kvrecalld" "$out/bin/kvrecall" >"$out/runtime-packages.txt"
echo "runtime packages: $(tr '\n' ' ' <"$out/runtime-packages.txt")"
