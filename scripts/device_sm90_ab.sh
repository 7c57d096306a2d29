#!/usr/bin/env bash
# On the GPU machine: one sm90 plugin against another in the same call, for a kernel change that
# must beat the one it replaces. BenchM3 (graph step, L2 evicted by a read) alternates the new
# plugin ($B/lib/libattnrt_cuda_sm90.so) and the base ($B/lib/base_sm90.so: main's plugin, built
# and carried by the caller), then the sparse-decode tests, an `attnrt run --check` on
# minimax-m3-tp4 (8k prompt), a profiling build's phases ($B/lib/trace_sm90.so, if carried) and a
# second round of timings, while $BUDGET seconds last. Logs under /tmp/ab_logs, bundled into
# $OUT/ab_logs.tgz after every step.
# Usage: BUDGET=300 SHAPES=1x64k,1x128k,4x64k,8x64k scripts/device_sm90_ab.sh [build-dir]
set -uo pipefail
D=${1:-build}
L=/tmp/ab_logs
OUT=${OUT:-/tmp/out}
mkdir -p "$L" "$OUT"
save() { tar czf "$OUT/ab_logs.tgz" -C "$L" . 2>/dev/null; }
trap save EXIT
ln -sf libattnrt.so.0.1.0 "$D/lib/libattnrt.so.0"
export LD_LIBRARY_PATH="$PWD/$D/lib" ATTNRT_PLUGIN_PATH="$PWD/$D/lib"
T0=$SECONDS
left() { echo $(( ${BUDGET:-300} - (SECONDS - T0) )); }
SHAPES=${SHAPES:-1x64k,1x128k,4x64k,8x64k}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$L/gpu.txt"
bench() {  # tag, plugin file under $D/lib ("" = the new one), shapes, graphs
  local plugin=()
  [ -n "$2" ] && plugin=(ATTNRT_CUDA_PLUGIN="$PWD/$D/lib/$2")
  echo "== bench $1 t=$((SECONDS - T0))"
  env "${plugin[@]}" ATTNRT_GPU_BENCH=1 ATTNRT_GPU_BENCH_FLUSH=read ATTNRT_GPU_BENCH_SHAPES="$3" \
    ATTNRT_GPU_BENCH_GRAPHS="${4:-fused,step}" timeout 60 stdbuf -oL \
    "$D/bin/attnrt_gpu_sm90_tests" --gtest_filter=*BenchM3 > "$L/bench_$1.log" 2>&1
  echo "rc=$?"
  grep -E "watchdog|one step|Failure|error|PHASE" "$L/bench_$1.log" |
    sed -E 's/ +/ /g; s/one step in a CUDA graph, cold L2 by a read \(median of 20\)://; s/generic nan.*//' |
    cut -c1-120
  save
}
bench new1 "" "$SHAPES"
bench base1 base_sm90.so "$SHAPES"
echo "== sm90 decode tests t=$((SECONDS - T0))"
timeout 90 stdbuf -oL "$D/bin/attnrt_gpu_sm90_tests" \
  --gtest_filter='*SparseDecode*:*Death*:*GraphReplays*:*IndexDecode*' > "$L/sm90_tests.log" 2>&1
echo "rc=$?"
grep -E "^\[  FAILED|Failure|PASSED|sparse_decode case" "$L/sm90_tests.log" | cut -c1-150 | tail -24
save
if (( $(left) > 70 )); then
  echo "== run m3 check t=$((SECONDS - T0))"
  timeout 60 "$D/bin/attnrt" run --device cuda:0 --model minimax-m3-tp4 --prompt-len 8192 \
    --decode-steps 2 --check --check-rows 4 > "$L/run_m3.log" 2>&1
  echo "rc=$?"
  grep -E "check|sparse_decode|fallback|warn" "$L/run_m3.log" | tail -6
  save
fi
if [ -f "$D/lib/trace_sm90.so" ] && (( $(left) > 30 )); then bench trace trace_sm90.so 1x64k,4x64k fused; fi
if (( $(left) > 30 )); then bench new2 "" "$SHAPES"; fi
if (( $(left) > 30 )); then bench base2 base_sm90.so "$SHAPES"; fi
echo "done t=$((SECONDS - T0))"
