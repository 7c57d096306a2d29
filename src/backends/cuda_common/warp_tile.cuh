// One warp's attention tile on tensor cores, shared by the CUDA plugins' kernels (device code
// only, header-only; builds on mma_sm80.cuh). The warp owns 16 query rows (an m16 tile) against
// 8*NT consecutive keys of XOR-swizzled shared-memory tiles; its S fragment s[n][e] holds row
// g = lane/4 (e = 0, 1) and row g + 8 (e = 2, 3) at key 8n + 2*(lane%4) + (e&1).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda_common/mma_sm80.cuh"

namespace attnrt_cuda_common {

// s = Q K^T: Q a [16][D] tile, K a [keys][D] tile, keys key0 .. key0 + 8*NT - 1.
template <typename T, int D, int NT>
__device__ __forceinline__ void warp_qk(float (&s)[NT][4], const T* sQ, const T* sK, int key0) {
  static_assert(NT % 2 == 0, "keys come in pairs of n-tiles");
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t af[4];
    ldsm_x4(af, smem_u32(sQ + swz<D>(lane & 15, kk * 16 + (lane >> 4) * 8)));
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t bf[4];
      const int key = key0 + np * 16 + (lane >> 4) * 8 + (lane & 7);
      ldsm_x4(bf, smem_u32(sK + swz<D>(key, kk * 16 + ((lane >> 3) & 1) * 8)));
      Mma<T>::run(s[2 * np], af, bf[0], bf[1]);
      Mma<T>::run(s[2 * np + 1], af, bf[2], bf[3]);
    }
  }
}

// Softmax of the warp's rows over its keys, log2 domain, in place: key j = j0 + column index is
// kept when keep(j), else weighs 0. Afterwards s = exp2(s * scale_log2 - m) (unnormalised P),
// m[r] = the row's max (-inf when every key is masked) and l[r] = its sum, r = 0 for row g and
// 1 for row g + 8, both reduced over the lanes sharing the row.
template <int NT, class Keep>
__device__ __forceinline__ void warp_softmax(float (&s)[NT][4], int j0, float scale_log2, Keep keep,
                                             float (&m)[2], float (&l)[2]) {
  const int t4 = threadIdx.x & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        const int j = j0 + n * 8 + 2 * t4 + (e & 1);
        s[n][e] = keep(j) ? s[n][e] * scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[n][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float base = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        s[n][e] = fast_exp2(s[n][e] - base);
        sum += s[n][e];
      }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    m[r] = mx;
    l[r] = sum;
  }
}

// o += P V: P the warp's softmaxed S fragment rounded to T (as the reference rounds P), V a
// [keys][D] tile, keys key0 .. key0 + 8*NT - 1.
template <typename T, int D, int NT>
__device__ __forceinline__ void warp_pv(float (&o)[D / 8][4], const float (&s)[NT][4], const T* sV,
                                        int key0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int ks = 0; ks < NT / 2; ++ks) {
    uint32_t pf[4];
    pf[0] = Mma<T>::pack(s[2 * ks][0], s[2 * ks][1]);
    pf[1] = Mma<T>::pack(s[2 * ks][2], s[2 * ks][3]);
    pf[2] = Mma<T>::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);
    pf[3] = Mma<T>::pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);
    const int key = key0 + ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t bf[4];
      ldsm_x4_t(bf, smem_u32(sV + swz<D>(key, dp * 16 + (lane >> 4) * 8)));
      Mma<T>::run(o[2 * dp], pf, bf[0], bf[1]);
      Mma<T>::run(o[2 * dp + 1], pf, bf[2], bf[3]);
    }
  }
}

}  // namespace attnrt_cuda_common
