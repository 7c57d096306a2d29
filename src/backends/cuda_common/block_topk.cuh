// Exact top-k selection by one CTA, shared by the CUDA plugins (device code only, header-only).
//
// block_topk(): of n candidates with ordered 32-bit keys (larger is better), selects the keff
// largest and writes their ids 0..n-1 in ascending order through out(i, id), i = 0..keff-1.
// Ties at the threshold go to the lowest ids, as a stable descending sort would choose. The
// threshold is found by an 8-bit radix select of at most 4 passes (no sort of all n), stopping
// once every key of the threshold's bin is taken; one warp compacts the selection in id order.
// Every thread of the CTA must call it; keff <= n.
#pragma once

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
  struct Storage {
    uint32_t hist[256];
    uint32_t prefix, mask;
    int remaining, done;
  };

  template <class KeyFn, class OutFn>
  __device__ static void select(Storage& s, int n, int keff, KeyFn key, OutFn out) {
    const int tid = threadIdx.x;
    if (tid == 0) {
      s.prefix = 0;
      s.mask = 0;
      s.remaining = keff;
      s.done = 0;
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
          int above = excl, in_bin = 0;
          int bin = 255 - 8 * lane;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if (above + cnt[i] >= rem) {
              bin = 255 - 8 * lane - i;
              in_bin = cnt[i];
              break;
            }
            above += cnt[i];
          }
          s.prefix = prefix | (static_cast<uint32_t>(bin) << shift);
          s.mask = mask | (255u << shift);
          s.remaining = rem - above;
          // Every key of the bin is taken: the threshold need not be refined further.
          s.done = in_bin == rem - above;
        }
      }
      __syncthreads();
      if (s.done) break;
    }
    // Keys above the threshold prefix are taken, and of those equal to it (under the mask) the
    // first `remaining` by id. One warp walks the ids in order, 32 at a time, so the output comes
    // out ascending without a block-wide scan.
    if (tid < 32) {
      const int lane = tid;
      const uint32_t thr = s.prefix, mask = s.mask;
      const int take_eq = s.remaining;
      const unsigned below = (1u << lane) - 1u;
      int eq_seen = 0, written = 0;
      for (int base = 0; base < n && written < keff; base += 32) {
        const int c = base + lane;
        const uint32_t u = c < n ? key(c) & mask : 0u;
        const bool gt = c < n && u > thr, eq = c < n && u == thr;
        const unsigned eq_ballot = __ballot_sync(0xffffffffu, eq);
        const bool sel = gt || (eq && eq_seen + __popc(eq_ballot & below) < take_eq);
        const unsigned sel_ballot = __ballot_sync(0xffffffffu, sel);
        const int at = written + __popc(sel_ballot & below);
        if (sel && at < keff) out(at, c);
        eq_seen += __popc(eq_ballot);
        written += __popc(sel_ballot);
      }
    }
    __syncthreads();  // the storage may be reused
  }
};

}  // namespace attnrt_cuda_common
