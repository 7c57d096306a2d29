#!/usr/bin/env bash
# On the dev box: puts what scripts/device_cuda.sh runs on the GPU machine into DIR (default
# .devbuild, git-ignored, so that the device tool carries it; ~15 MB, no debug info):
#   DIR/bin: attnrt and the three GPU test binaries of the default build (built first);
#   DIR/lib: libattnrt.so.0.1.0 and both CUDA plugins;
#   DIR/lib/trace_sm90.so: the fast path built with -DATTNRT_PHASE_TRACE=ON (build-trace/),
#       whose decode kernels stamp their phases (for the ab step);
#   DIR/lib/base_sm90.so, when BASE (a commit) is given: the fast path built at BASE
#       (build-base/, from `git archive`), the baseline of the ab and first steps;
#   DIR/lib/at_<commit>_sm90.so for each further COMMIT: the fast path built there, another
#       candidate for the ab step (EXTRA="at_<commit>_sm90.so ...").
# Usage: scripts/stage_device.sh [DIR] [BASE] [COMMIT...]
# Then, with the device tool: run(command="bash scripts/device_cuda.sh DIR sm90 first ab",
# carry=["DIR"]).
set -euo pipefail
DIR=${1:-.devbuild}
BASE=${2:-}
shift $(( $# < 2 ? $# : 2 ))
COMMITS=("$@")
export PATH=/usr/local/cuda/bin:$PATH
if ! command -v nvcc >/dev/null; then
  echo "stage_device.sh: no nvcc (the CUDA toolkit is needed to build the plugins)" >&2
  exit 1
fi
for c in ${BASE:+"$BASE"} "${COMMITS[@]}"; do
  if ! git rev-parse --verify -q "$c^{commit}" >/dev/null; then
    echo "stage_device.sh: '$c' is not a commit of this repository" >&2
    exit 1
  fi
done
targets=(attnrt attnrt_gpu_tests attnrt_gpu_sparse_tests attnrt_gpu_sm90_tests attnrt_cuda
  attnrt_cuda_sm90)
echo "== default build"
cmake --preset default >/dev/null
cmake --build --preset default --target "${targets[@]}"
rm -rf "$DIR"
mkdir -p "$DIR/bin" "$DIR/lib"
cp build/bin/{attnrt,attnrt_gpu_tests,attnrt_gpu_sparse_tests,attnrt_gpu_sm90_tests} "$DIR/bin/"
cp build/lib/{libattnrt.so.0.1.0,libattnrt_cuda.so,libattnrt_cuda_sm90.so} "$DIR/lib/"
echo "== profiling build of the fast path"
cmake --preset default -B build-trace -DATTNRT_PHASE_TRACE=ON >/dev/null
cmake --build build-trace --target attnrt_cuda_sm90
cp build-trace/lib/libattnrt_cuda_sm90.so "$DIR/lib/trace_sm90.so"
# The fast path as built at commit $1, copied to $DIR/lib/$2 (build-base/, from `git archive`).
fast_path_at() {
  echo "== the fast path at $1"
  rm -rf build-base
  mkdir -p build-base/src
  git archive "$1" | tar -x -C build-base/src
  cmake -S build-base/src -B build-base/build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DATTNRT_CUDA=ON >/dev/null
  cmake --build build-base/build --target attnrt_cuda_sm90
  cp build-base/build/lib/libattnrt_cuda_sm90.so "$DIR/lib/$2"
}
if [ -n "$BASE" ]; then fast_path_at "$BASE" base_sm90.so; fi
for c in "${COMMITS[@]}"; do fast_path_at "$c" "at_$(git rev-parse --short "$c")_sm90.so"; done
# Without debug info: the device tool carries at most 64 MiB.
strip --strip-debug "$DIR"/bin/* "$DIR"/lib/*
du -sh "$DIR"
echo "staged $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' with uncommitted changes')" \
  "${BASE:+against $BASE }${COMMITS[*]:+and ${COMMITS[*]} }in $DIR"
