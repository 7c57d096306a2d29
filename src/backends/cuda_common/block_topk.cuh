// Exact top-k selection by one CTA, shared by the CUDA plugins (device code only, header-only).
//
// block_topk(): of n candidates with ordered 32-bit keys (larger is better), selects the keff
// largest and writes their ids 0..n-1 in ascending order through out(i, id), i = 0..keff-1.
// Ties at the threshold go to the lowest ids, as a stable descending sort would choose. The
// threshold is found by a 4-pass 8-bit radix select (no sort of all n), the selection is
// compacted by a block scan. Every thread of the CTA must call it; keff <= n.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace attnrt_cuda_common {

// Monotone map float -> uint32 (a > b  <=>  ordered_key(a) > ordered_key(b), NaN excluded).
__device__ __forceinline__ uint32_t ordered_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The selection key of block c of a row whose visible blocks end at local_from + local_blocks
// (spec/minimax-sparse.md §3): NaN scores rank as -1e30, the first init_blocks are forced to
// 1e30, blocks c >= local_from to 1e29 (local overrides init).
__device__ __forceinline__ uint32_t block_score_key(float v, int c, int init_blocks,
                                                    int local_from) {
  if (v != v) v = -1e30f;
  if (c < init_blocks) v = 1e30f;
  if (c >= local_from) v = 1e29f;
  return ordered_key(v);
}

template <int THREADS>
struct BlockTopK {
  using Scan = cub::BlockScan<int, THREADS>;
  struct Storage {
    typename Scan::TempStorage scan;
    uint32_t hist[256];
    uint32_t prefix, mask;
    int remaining;
  };

  template <class KeyFn, class OutFn>
  __device__ static void select(Storage& s, int n, int keff, KeyFn key, OutFn out) {
    const int tid = threadIdx.x;
    if (tid == 0) {
      s.prefix = 0;
      s.mask = 0;
      s.remaining = keff;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += THREADS) s.hist[i] = 0;
      __syncthreads();
      const uint32_t prefix = s.prefix, mask = s.mask;
      for (int c = tid; c < n; c += THREADS) {
        const uint32_t u = key(c);
        if ((u & mask) == prefix) atomicAdd(&s.hist[(u >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (tid < 32) {
        // Lane l owns bins 255-8l .. 248-8l (descending): find the bin holding the
        // remaining-th largest key.
        const int lane = tid;
        int cnt[8], sum = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          cnt[i] = static_cast<int>(s.hist[255 - 8 * lane - i]);
          sum += cnt[i];
        }
        int incl = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += y;
        }
        const int excl = incl - sum;
        const int rem = s.remaining;
        const unsigned ballot = __ballot_sync(0xffffffffu, incl >= rem);
        const int first = __ffs(ballot) - 1;
        if (lane == first) {
          int above = excl;
          int bin = 255 - 8 * lane;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if (above + cnt[i] >= rem) {
              bin = 255 - 8 * lane - i;
              break;
            }
            above += cnt[i];
          }
          s.prefix = prefix | (static_cast<uint32_t>(bin) << shift);
          s.mask = mask | (255u << shift);
          s.remaining = rem - above;
        }
      }
      __syncthreads();
    }
    const uint32_t thr = s.prefix;
    const int take_eq = s.remaining;
    int eq_seen = 0, written = 0;
    for (int base = 0; base < n; base += THREADS) {
      const int c = base + tid;
      const uint32_t u = c < n ? key(c) : 0u;
      const int gt = c < n && u > thr;
      const int eq = c < n && u == thr;
      int eq_rank, eq_total;
      Scan(s.scan).ExclusiveSum(eq, eq_rank, eq_total);
      __syncthreads();
      const int sel = gt || (eq && eq_seen + eq_rank < take_eq);
      int at, sel_total;
      Scan(s.scan).ExclusiveSum(sel, at, sel_total);
      __syncthreads();
      if (sel && written + at < keff) out(written + at, c);
      eq_seen += eq_total;
      written += sel_total;
    }
  }
};

}  // namespace attnrt_cuda_common
