#!/usr/bin/env bash
# On the GPU machine: GPU tests, attnrt's timings, then PyTorch side by side. Logs under $OUT.
# Usage (from the repo root, build-d carried): scripts/device_cuda.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
ldd build-d/lib/libattnrt_cuda.so | tee -a "$OUT/gpu.txt"
timeout 240 build-d/bin/attnrt_gpu_tests --gtest_filter=-*Bench* 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
ATTNRT_GPU_BENCH=1 timeout 200 build-d/bin/attnrt_gpu_tests --gtest_filter=*Bench* 2>&1 | tee "$OUT/bench_attnrt.log" | grep -E "BENCH|FAIL|OK"
if [ -x build-d/bin/attnrt ]; then timeout 60 build-d/bin/attnrt doctor 2>&1 | tee "$OUT/doctor.log" | tail -20; fi
PYTHONUNBUFFERED=1 timeout 200 python3 bench/cuda_side_by_side.py 2>&1 | tee "$OUT/bench_torch.log"
