#!/bin/bash
# Device run of the CUDA sparse tests (build-s/bin and build-s/lib carried from the dev box).
# Writes logs under $OUT when set.
set -o pipefail
B=${1:-build-s}
O=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 $B/bin/attnrt_gpu_sparse_tests 2>&1 | tee $O/sparse_tests.log | grep -vE "^\[ RUN|^\[       OK" 
timeout 30 $B/bin/attnrt_gpu_tests --gtest_filter='*Probe*' 2>&1 | tail -3
ATTNRT_GPU_BENCH=1 timeout 150 $B/bin/attnrt_gpu_sparse_tests --gtest_filter='*Bench*' 2>&1 | tee $O/sparse_bench.log | grep -E "BENCH|FAIL|PASS"
if command -v compute-sanitizer >/dev/null && [ -z "$NO_MEMCHECK" ]; then
  timeout 60 compute-sanitizer --tool memcheck $B/bin/attnrt_gpu_sparse_tests \
    --gtest_filter='*Indexer*:*AttendMatches*:*ShortContext*' 2>&1 | tee $O/memcheck.log | tail -4
fi
