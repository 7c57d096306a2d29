#!/usr/bin/env bash
# On the GPU machine: the GPU test suites (dense, sparse), memcheck over the dense suite, attnrt's
# own timings, `attnrt doctor` / `attnrt run --device cuda:0 --check`, then the PyTorch side by
# side. Logs under $LOGS (default /tmp/attnrt_device_logs), bundled into $OUT/device_logs.tgz
# after every step (the device tool returns only a few files a call, and what a cut-off call left
# under $OUT). Binaries come from the dev box: carry build/bin/{attnrt,attnrt_gpu_tests,
# attnrt_gpu_sparse_tests,attnrt_gpu_sm90_tests} and build/lib/{libattnrt.so.0.1.0,
# libattnrt_cuda.so,libattnrt_cuda_sm90.so}.
# Usage: scripts/device_cuda.sh [build-dir] [steps...]
#   steps: tests sparse sm90 memcheck bench run torch m3dense hang ab first m3
#          (default: tests sparse sm90 memcheck bench run torch m3dense)
#   m3dense: dense decode through torch (cuDNN, flash) at the shapes of the sm90 BenchM3, timed
#       the same way (graph, cold L2), so sparse and dense decode compare on the same card.
#   hang: a stress of the batch-64 sparse_decode (hung on 2026-12-06, not since the plan's host
#       writes land before plan() returns): the sm90 tests that drive it and its watchdog, then
#       BenchM3 at 64 x 64k and 64 x 128k three times each (a hang ends in an error whose
#       "cuda_sm90 watchdog:" line names the wait and the request's counters).
#   ab: a candidate sm90 plugin ($B/lib/libattnrt_cuda_sm90.so) against main's, built and carried
#       as $B/lib/base_sm90.so, in one call: BenchM3 (graph step, L2 evicted by a read) on $SHAPES
#       (default 1x64k,1x128k,4x64k,8x64k) alternating the two, the sparse-decode tests, `attnrt
#       run --check` on minimax-m3-tp4 (8k prompt), a profiling build's phases ($B/lib/trace_sm90.so,
#       if carried) and a second round of timings, while $BUDGET seconds (default 300) last.
#       $EXTRA: more candidate plugins (file names under $B/lib) timed in both rounds.
#   first: CudaSm90.FirstRunsLoadNoCode alone (a fresh process: no kernel launched yet) with
#       the candidate plugins, then, if carried, with $B/lib/base_sm90.so as the fast path, lazily
#       and eagerly loaded (CUDA_MODULE_LOADING=EAGER): whether a first run() that loads code
#       waits for another stream's kernel on this driver, and whether plan() loading prevents it.
#   m3: `attnrt run --device cuda:0 --check` on minimax-m3-tp4 with a 64k prompt (the last 4
#       query tokens of the prompt checked per layer; minutes of host reference), then shorter
#       runs with the cuda_sm90 fast path off (ATTNRT_DISABLE, and a page size it does not take).
set -uo pipefail
B=${1:-build}
shift || true
STEPS=${*:-tests sparse sm90 memcheck bench run torch m3dense}
OUT=${OUT:-/tmp/out}
LOGS=${LOGS:-/tmp/attnrt_device_logs}
mkdir -p "$OUT" "$LOGS"
bundle() { tar czf "$OUT/device_logs.tgz" -C "$LOGS" .; }
trap bundle EXIT
ln -sf libattnrt.so.0.1.0 "$B/lib/libattnrt.so.0"
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
has() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$LOGS/gpu.txt"
if has tests; then
  timeout 240 "$B/bin/attnrt_gpu_tests" --gtest_filter=-*Bench* 2>&1 | tee "$LOGS/gpu_tests.log" |
    grep -vE "^\[ RUN|^\[       OK" | tail -30
  # The same suite on the mma.sync kernels (sm_90 runs dense_extend at d=128 on wgmma otherwise).
  ATTNRT_CUDA_WGMMA=0 timeout 240 "$B/bin/attnrt_gpu_tests" --gtest_filter=-*Bench* 2>&1 |
    tee "$LOGS/gpu_tests_mma.log" | grep -E "device:|PASSED|FAILED|Failure" | tail -10
  bundle
fi
if has sparse; then
  timeout 240 "$B/bin/attnrt_gpu_sparse_tests" --gtest_filter=-*Bench* 2>&1 |
    tee "$LOGS/sparse_tests.log" | grep -vE "^\[ RUN|^\[       OK" | tail -30
  bundle
fi
if has sm90; then
  timeout 240 "$B/bin/attnrt_gpu_sm90_tests" --gtest_filter=-*Bench* 2>&1 |
    tee "$LOGS/sm90_tests.log" | grep -vE "^\[ RUN|^\[       OK" | tail -30
  bundle
fi
if has memcheck && command -v compute-sanitizer >/dev/null; then
  timeout 200 compute-sanitizer --tool memcheck "$B/bin/attnrt_gpu_tests" \
    --gtest_filter='*Sweep*:*Graph*:*BeyondL2*' 2>&1 | tee "$LOGS/memcheck.log" | tail -4
  bundle
fi
if has bench; then
  ATTNRT_GPU_BENCH=1 timeout 150 "$B/bin/attnrt_gpu_sparse_tests" --gtest_filter=*Bench* 2>&1 |
    tee "$LOGS/bench_sparse.log" | grep -E "BENCH|FAIL"
  ATTNRT_GPU_BENCH=1 timeout 120 "$B/bin/attnrt_gpu_sm90_tests" --gtest_filter=*Bench* 2>&1 |
    tee "$LOGS/bench_sm90.log" | grep -E "BENCH|FAIL"
  # The same sparse shapes through the Runtime, with the fast path and without it.
  ATTNRT_PLUGIN_PATH="$B/lib" timeout 120 "$B/bin/attnrt" bench --device cuda:0 \
    --suite cuda-sparse 2>&1 | tee "$LOGS/bench_cuda_sparse.log" | tail -19
  ATTNRT_DISABLE=cuda_sm90 ATTNRT_PLUGIN_PATH="$B/lib" timeout 120 "$B/bin/attnrt" bench \
    --device cuda:0 --suite cuda-sparse 2>&1 | tee "$LOGS/bench_cuda_sparse_generic.log" | tail -19
  bundle
fi
if has run; then
  export ATTNRT_PLUGIN_PATH="$B/lib"
  timeout 60 "$B/bin/attnrt" doctor 2>&1 | tee "$LOGS/doctor.log" | tail -30
  timeout 120 "$B/bin/attnrt" run --device cuda:0 --check 2>&1 | tee "$LOGS/run.log" | tail -20
  bundle
fi
if has torch; then
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/cuda_side_by_side.py "$B/bin/attnrt" 2>&1 |
    tee "$LOGS/side_by_side.log"
  bundle
fi
if has m3dense; then
  PYTHONUNBUFFERED=1 timeout 200 python3 bench/cuda_side_by_side.py --m3 2>&1 |
    tee "$LOGS/m3_dense_decode.log"
  bundle
fi
if has hang; then
  timeout 120 "$B/bin/attnrt_gpu_sm90_tests" \
    --gtest_filter='*ManyLaunchesAtBatch64*:*BrokenBarrierFailsInsteadOfHanging*' 2>&1 |
    tee "$LOGS/hang_tests.log" | grep -E "watchdog|OK|FAILED|Failure|max abs" | tail -12
  for i in 1 2 3; do
    ATTNRT_GPU_BENCH=1 ATTNRT_GPU_BENCH_FLUSH=read ATTNRT_GPU_BENCH_SHAPES="64x64k,64x128k" \
      timeout 150 "$B/bin/attnrt_gpu_sm90_tests" --gtest_filter=*BenchM3 2>&1 |
      tee "$LOGS/hang_bench_$i.log" | grep -E "watchdog|one step|Failure" | tail -6
    bundle
  done
fi
if has ab; then
  T0=$SECONDS
  left() { echo $(( ${BUDGET:-300} - (SECONDS - T0) )); }
  ab_shapes=${SHAPES:-1x64k,1x128k,4x64k,8x64k}
  ab_bench() {  # tag, plugin file under $B/lib ("" = the candidate), shapes, graphs
    local plugin=()
    [ -n "$2" ] && plugin=(ATTNRT_CUDA_PLUGIN="$PWD/$B/lib/$2")
    echo "== bench $1 t=$((SECONDS - T0))"
    env "${plugin[@]}" ATTNRT_GPU_BENCH=1 ATTNRT_GPU_BENCH_FLUSH=read ATTNRT_GPU_BENCH_SHAPES="$3" \
      ATTNRT_GPU_BENCH_GRAPHS="${4:-fused,step}" timeout 60 stdbuf -oL \
      "$B/bin/attnrt_gpu_sm90_tests" --gtest_filter=*BenchM3 > "$LOGS/ab_bench_$1.log" 2>&1
    echo "rc=$?"
    grep -E "watchdog|one step|Failure|error|PHASE" "$LOGS/ab_bench_$1.log" |
      sed -E 's/ +/ /g; s/one step in a CUDA graph, cold L2 by a read \(median of 20\)://; s/generic nan.*//' |
      cut -c1-120
    bundle
  }
  ab_bench new1 "" "$ab_shapes"
  ab_bench base1 base_sm90.so "$ab_shapes"
  for x in ${EXTRA:-}; do ab_bench "${x%.so}1" "$x" "$ab_shapes"; done
  echo "== sm90 decode tests t=$((SECONDS - T0))"
  timeout 150 stdbuf -oL "$B/bin/attnrt_gpu_sm90_tests" \
    --gtest_filter='*SparseDecode*:*Death*:*GraphReplays*:*IndexDecode*:*Solo*:*Beside*' \
    > "$LOGS/ab_sm90_tests.log" 2>&1
  echo "rc=$?"
  grep -E "^\[  FAILED|Failure|PASSED|sparse_decode case" "$LOGS/ab_sm90_tests.log" | cut -c1-150 | tail -24
  bundle
  if (( $(left) > 70 )); then
    echo "== run m3 check t=$((SECONDS - T0))"
    ATTNRT_PLUGIN_PATH="$B/lib" timeout 60 "$B/bin/attnrt" run --device cuda:0 --model minimax-m3-tp4 \
      --prompt-len 8192 --decode-steps 2 --check --check-rows 4 > "$LOGS/ab_run_m3.log" 2>&1
    echo "rc=$?"
    grep -E "check|sparse_decode|fallback|warn" "$LOGS/ab_run_m3.log" | tail -6
    bundle
  fi
  if [ -f "$B/lib/trace_sm90.so" ] && (( $(left) > 30 )); then ab_bench trace trace_sm90.so 1x64k,4x64k fused; fi
  if (( $(left) > 30 )); then ab_bench new2 "" "$ab_shapes"; fi
  if (( $(left) > 30 )); then ab_bench base2 base_sm90.so "$ab_shapes"; fi
  for x in ${EXTRA:-}; do if (( $(left) > 30 )); then ab_bench "${x%.so}2" "$x" "$ab_shapes"; fi; done
  echo "ab done t=$((SECONDS - T0))"
fi
if has first; then
  first_run() {  # tag, then env assignments
    local tag=$1
    shift
    echo "== first runs: $tag"
    env "$@" timeout 60 "$B/bin/attnrt_gpu_sm90_tests" --gtest_filter=CudaSm90.FirstRunsLoadNoCode \
      > "$LOGS/first_$tag.log" 2>&1
    echo "rc=$?"
    grep -E "plan of op|first runs|Failure|finished only|OK \]|FAILED \]" "$LOGS/first_$tag.log" | cut -c1-150
  }
  first_run new
  if [ -f "$B/lib/base_sm90.so" ]; then
    first_run base ATTNRT_CUDA_PLUGIN="$PWD/$B/lib/base_sm90.so"
    first_run base_eager ATTNRT_CUDA_PLUGIN="$PWD/$B/lib/base_sm90.so" CUDA_MODULE_LOADING=EAGER
  fi
  bundle
fi
if has m3; then
  export ATTNRT_PLUGIN_PATH="$B/lib"
  timeout ${M3_LIMIT:-400} "$B/bin/attnrt" run --device cuda:0 --model minimax-m3-tp4 \
    --prompt-len 65536 --decode-steps 2 --check --check-rows 4 2>&1 | grep -v "^attnrt run: " |
    tee "$LOGS/run_m3.log" | tail -16
  for off in "ATTNRT_DISABLE=cuda_sm90" "--page-size 64"; do
    echo "== fast path off: $off"
    if [[ $off == ATTNRT_* ]]; then e=("env" "$off"); a=(); else e=(); a=($off); fi
    timeout 90 "${e[@]}" "$B/bin/attnrt" run --device cuda:0 --model minimax-m3-tp4 \
      --prompt-len 8192 --decode-steps 2 --check --check-rows 4 "${a[@]}" 2>&1 |
      grep -v "^attnrt run: " | tee -a "$LOGS/run_m3_fallback.log" | tail -12
  done
  bundle
fi
