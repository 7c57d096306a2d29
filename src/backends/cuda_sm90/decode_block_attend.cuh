// Attention of one decode row's 16 query heads (one KV head, head_dim 128) over 128-key blocks
// held in shared memory, as both sm90 decode kernels compute it: the sparse attend
// (attend_decode.cu) and the fused sparse decode (index_decode.cu). Device code only.
//
// Each of the CTA's 4 warps takes 32 keys of every block on tensor cores (mma.sync m16n8k16;
// the 16 mma rows are the 16 heads, so each K/V row is read once), with keys past kv_len masked
// and P rounded to the K/V dtype as the reference does; an online softmax carries across the
// blocks. cta_partial() then folds the 4 warps' states into the CTA's normalised output and
// log2 lse, which the kernels merge across CTAs by lse.
#pragma once

#include <cmath>

#include "attend_decode.h"
#include "cuda_common/mma_sm80.cuh"
#include "cuda_common/softmax_state.cuh"
#include "cuda_common/warp_tile.cuh"
#include "index_decode.h"

namespace attnrt_cuda_sm90 {

constexpr int kAttendThreads = 128;
constexpr int kAttendWarps = kAttendThreads / 32;
constexpr int kDT = kHeadDim / 8;                  // O n-tiles of a warp
constexpr int kQBytes = kHeads * kHeadDim * 2;     // q of one row, 16-bit
constexpr int kTileBytes = kBlock * kHeadDim * 2;  // K (or V) of one block: one page
static_assert(kBlock == kAttendWarps * 32, "each warp takes 32 keys of a block");
// Floats per row of the warps' merge buffer: the 8 rows a store instruction writes hit 2 banks
// apart.
constexpr int kRedStride = kHeadDim + 8;
// cta_partial's shared scratch: the 4 warps' shares of every row.
constexpr int kPartialScratchBytes = kAttendWarps * kHeads * kRedStride * 4;

// This thread's part of its warp's state: rows g and g + 8 (g = lane / 4) over the warp's keys.
struct DecodeWarpState {
  float m[2], l[2];
  float o[kDT][4];
  __device__ __forceinline__ void reset() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  }
};

// Adds block [j0, j0 + 128) to the state; keys j >= jend are masked. sQ [16][128], sK and sV
// [128][128], all XOR-swizzled (warp_tile.cuh). Reads shared memory only.
template <typename T>
__device__ __forceinline__ void attend_block(DecodeWarpState& st, const T* sQ, const T* sK,
                                             const T* sV, int j0, int jend, float scale_log2) {
  using namespace attnrt_cuda_common;
  const int wkey = (threadIdx.x >> 5) * 32;
  float s[4][4], mb[2], lb[2];
  warp_qk<T, kHeadDim>(s, sQ, sK, wkey);
  warp_softmax(s, j0 + wkey, scale_log2, [&](int j) { return j < jend; }, mb, lb);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float M = fmaxf(st.m[r], mb[r]);
    const float ca = st.m[r] == -INFINITY ? 0.f : exp2f(st.m[r] - M);
    const float cb = mb[r] == -INFINITY ? 0.f : exp2f(mb[r] - M);
    st.l[r] = st.l[r] * ca + lb[r] * cb;
    st.m[r] = M;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      s[n][2 * r] *= cb;
      s[n][2 * r + 1] *= cb;
    }
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      st.o[dt][2 * r] *= ca;
      st.o[dt][2 * r + 1] *= ca;
    }
  }
  warp_pv<T, kHeadDim>(st.o, s, sV, wkey);
}

// Shared scratch of cta_partial besides `red`.
struct PartialShared {
  float m[kAttendWarps][kHeads], l[kAttendWarps][kHeads];
};

// The CTA's partial: po [16][128] receives each head's output normalised over the CTA's keys
// (0 for a head with none) and lse2 [16] its log2 lse (-inf for none); either may point to
// shared or global memory. Each warp scales its rows to their share (the rows' max and sum over
// the 4 warps), and the 4 shares are summed through `red` (kPartialScratchBytes of shared
// memory, free on entry). Every thread of the CTA calls it; the stores to po and lse2 are not
// followed by a barrier.
__device__ __forceinline__ void cta_partial(const DecodeWarpState& st, float* red,
                                            PartialShared& sh, float* po, float* lse2) {
  using attnrt_cuda_common::log2_lse;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  if (t4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sh.m[warp][g + 8 * r] = st.m[r];
      sh.l[warp][g + 8 * r] = st.l[r];
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    float M = -INFINITY, L = 0.f;
#pragma unroll
    for (int w = 0; w < kAttendWarps; ++w) M = fmaxf(M, sh.m[w][row]);
#pragma unroll
    for (int w = 0; w < kAttendWarps; ++w)
      L += sh.m[w][row] == -INFINITY ? 0.f : sh.l[w][row] * exp2f(sh.m[w][row] - M);
    const float f = st.m[r] == -INFINITY || L == 0.f ? 0.f : exp2f(st.m[r] - M) / L;
    float* dst = red + (warp * kHeads + row) * kRedStride + 2 * t4;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
      *reinterpret_cast<float2*>(dst + dt * 8) =
          make_float2(st.o[dt][2 * r] * f, st.o[dt][2 * r + 1] * f);
    if (warp == 0 && t4 == 0) lse2[row] = log2_lse(M, L);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kHeads * kHeadDim / 4 / kAttendThreads; ++i) {
    const int idx = (i * kAttendThreads + tid) * 4, row = idx / kHeadDim, d = idx % kHeadDim;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kAttendWarps; ++w) {
      const float4 v = *reinterpret_cast<const float4*>(red + (w * kHeads + row) * kRedStride + d);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    *reinterpret_cast<float4*>(po + idx) = acc;
  }
}

// Copies block `c`'s K and V (one page each, `page`) into sK and sV with cp.async, swizzled;
// rows past kv_len are zero-filled so masked keys contribute 0, never NaN. Commits one group.
template <typename T>
__device__ __forceinline__ void load_block_kv(T* sK, T* sV, const T* kc, const T* vc,
                                              int64_t page, int64_t k_s0, int64_t k_s1,
                                              int64_t v_s0, int64_t v_s1, int rows) {
  using namespace attnrt_cuda_common;
  const T* kp = kc + page * k_s0;
  const T* vp = vc + page * v_s0;
  const int tid = threadIdx.x, ch = tid % kDT;
#pragma unroll 4
  for (int r = tid / kDT; r < kBlock; r += kAttendThreads / kDT) {
    const bool valid = r < rows;
    cp_async16(smem_u32(sK + swz<kHeadDim>(r, ch * 8)), valid ? kp + r * k_s1 + ch * 8 : kp,
               valid);
    cp_async16(smem_u32(sV + swz<kHeadDim>(r, ch * 8)), valid ? vp + r * v_s1 + ch * 8 : vp,
               valid);
  }
  cp_commit();
}

// Copies one row's q [16][128] (row strides q_s1) into sQ, swizzled. Commits one group.
template <typename T>
__device__ __forceinline__ void load_q(T* sQ, const T* q, int64_t q_s1) {
  using namespace attnrt_cuda_common;
  for (int i = threadIdx.x; i < kHeads * kDT; i += kAttendThreads) {
    const int r = i / kDT, ch = i % kDT;
    cp_async16(smem_u32(sQ + swz<kHeadDim>(r, ch * 8)), q + r * q_s1 + ch * 8, true);
  }
  cp_commit();
}

}  // namespace attnrt_cuda_sm90
