// Fused sparse attend for decode (see attend_decode.h): one launch per call, no merge kernel.
//
// Grid: 16 CTAs per request, one per selection slot. A CTA gathers its block's 128 keys of K and
// V (one page each) and the request's 16 query rows into XOR-swizzled shared memory with
// cp.async, then each of its 4 warps takes 32 keys: S = Q K^T and O = P V on tensor cores
// (mma.sync m16n8k16; the 16 mma rows are the 16 query heads, so each K/V row is read once),
// keys past kv_len masked, P rounded to the K/V dtype as the reference does. The warps merge
// through shared memory into the slot's partial (o, log2 lse); empty or repeated slots write
// (o = 0, lse = -inf). The last CTA of the request (atomic counter, reset by it for graph
// replay) weighs the 16 partials by their lse, folds in the sink and writes out and lse.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <attnrt/plugin.h>

#include "attend_decode.h"
#include "cuda_common/kernel_attr.h"
#include "cuda_common/mma_sm80.cuh"
#include "cuda_common/softmax_state.cuh"
#include "cuda_common/warp_tile.cuh"
#include "index_decode.h"

namespace attnrt_cuda_sm90 {
namespace {

using namespace attnrt_cuda_common;

constexpr int kThreads = 128;
constexpr int kKeys = kBlock;       // keys of a block, 32 per warp
constexpr int kDT = kHeadDim / 8;   // O n-tiles
constexpr size_t kSmemElems = static_cast<size_t>(kHeads + 2 * kKeys) * kHeadDim;

template <typename T>
__global__ void __launch_bounds__(kThreads, 3) attend_decode_kernel(AttendDecodeArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [16][128]
  T* sK = sQ + kHeads * kHeadDim;          // [128][128]
  T* sV = sK + kKeys * kHeadDim;           // [128][128]
  __shared__ float s_m[4][kHeads], s_l[4][kHeads];
  __shared__ int s_last, s_sel[kTopK];

  const int b = blockIdx.x / kTopK, slot = blockIdx.x % kTopK;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int kv = a.kv_len[b];
  const int nblk = (kv + kBlock - 1) / kBlock;
  // The request's selection row, loaded in parallel (one dependent load, not one per slot).
  if (tid < kTopK) s_sel[tid] = a.topk[static_cast<int64_t>(b) * a.t_s1 + tid * a.t_s2];
  __syncthreads();
  const int c = s_sel[slot];
  bool live = c >= 0 && c < nblk;
  for (int s = 0; s < slot; ++s) live = live && s_sel[s] != c;  // a repeat counts once
  const int j0 = c * kBlock, jend = min(j0 + kBlock, kv);
  const int64_t slot_row = (static_cast<int64_t>(b) * kTopK + slot) * kHeads;

  if (live) {
    const T* q = static_cast<const T*>(a.q) + static_cast<int64_t>(b) * a.q_s0;
    for (int i = tid; i < kHeads * kDT; i += kThreads) {
      const int r = i / kDT, ch = i % kDT;
      cp_async16(smem_u32(sQ + swz<kHeadDim>(r, ch * 8)), q + r * a.q_s1 + ch * 8, true);
    }
    const int64_t page = a.page_ids[a.page_indptr[b] + c];
    const T* kp = static_cast<const T*>(a.kc) + page * a.k_s0;
    const T* vp = static_cast<const T*>(a.vc) + page * a.v_s0;
    const int ch = tid % kDT;
#pragma unroll 4
    for (int r = tid / kDT; r < kKeys; r += kThreads / kDT) {
      const bool valid = j0 + r < jend;
      cp_async16(smem_u32(sK + swz<kHeadDim>(r, ch * 8)), valid ? kp + r * a.k_s1 + ch * 8 : kp,
                 valid);
      cp_async16(smem_u32(sV + swz<kHeadDim>(r, ch * 8)), valid ? vp + r * a.v_s1 + ch * 8 : vp,
                 valid);
    }
    cp_commit();
    cp_wait<0>();
    __syncthreads();

    // S = Q K^T, softmax (keys past kv_len masked) and O = P V over this warp's 32 keys.
    const int wkey = warp * 32;
    float s[4][4];
    warp_qk<T, kHeadDim>(s, sQ, sK, wkey);
    float m[2], l[2];
    warp_softmax(s, j0 + wkey, a.scale_log2, [&](int j) { return j < jend; }, m, l);
    float o[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    warp_pv<T, kHeadDim>(o, s, sV, wkey);
    // Merge the 4 warps (same rows, different keys) through shared memory; sK is free now.
    __syncthreads();
    float* red = reinterpret_cast<float*>(sK);  // [4][16][128] floats = the K tile's bytes
    static_assert(4 * kHeads * kHeadDim * sizeof(float) <= 2 * kKeys * kHeadDim * sizeof(T),
                  "merge buffer fits in K and V");
    if (t4 == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        s_m[warp][g + 8 * r] = m[r];
        s_l[warp][g + 8 * r] = l[r];
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < 4; ++w) M = fmaxf(M, s_m[w][row]);
      const float f = m[r] == -INFINITY ? 0.f : exp2f(m[r] - M);
      float* dst = red + (warp * kHeads + row) * kHeadDim + 2 * t4;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        dst[dt * 8] = o[dt][2 * r] * f;
        dst[dt * 8 + 1] = o[dt][2 * r + 1] * f;
      }
    }
    __syncthreads();
    for (int idx = tid; idx < kHeads * kHeadDim; idx += kThreads) {
      const int row = idx / kHeadDim, d = idx % kHeadDim;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < 4; ++w) M = fmaxf(M, s_m[w][row]);
      float L = 0.f, acc = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          L += s_l[w][row] * exp2f(s_m[w][row] - M);
          acc += red[(w * kHeads + row) * kHeadDim + d];
        }
      }
      a.part_o[(slot_row + row) * kHeadDim + d] = L > 0.f ? acc / L : 0.f;
      if (d == 0) a.part_lse[slot_row + row] = log2_lse(M, L);
    }
  } else {
    for (int idx = tid; idx < kHeads * kHeadDim; idx += kThreads) {
      a.part_o[slot_row * kHeadDim + idx] = 0.f;
      if (idx < kHeads) a.part_lse[slot_row + idx] = -INFINITY;
    }
  }

  // The last CTA of the request merges the 16 slots.
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&a.counters[b], 1) == kTopK - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if (tid == 0) a.counters[b] = 0;  // ready for the next launch (graph replay)
  __shared__ float s_w[kTopK][kHeads], s_inv[kHeads];
  const int64_t req_row = static_cast<int64_t>(b) * kTopK * kHeads;
  for (int h = tid; h < kHeads; h += kThreads) {
    float M = -INFINITY;
    for (int k = 0; k < kTopK; ++k) M = fmaxf(M, __ldcg(a.part_lse + req_row + k * kHeads + h));
    float L = 0.f;
    for (int k = 0; k < kTopK; ++k) {
      const float lk = __ldcg(a.part_lse + req_row + k * kHeads + h);
      const float w = M == -INFINITY ? 0.f : exp2f(lk - M);  // -inf - M -> 0
      s_w[k][h] = w;
      L += w;
    }
    if (a.sink != nullptr) {
      const float cf = fold_sink(M, L, a.sink[h]);
      for (int k = 0; k < kTopK; ++k) s_w[k][h] *= cf;
    }
    s_inv[h] = L > 0.f ? 1.f / L : 0.f;
    if (a.lse != nullptr)
      a.lse[static_cast<int64_t>(b) * a.lse_s0 + h] = natural_lse(M, L);
  }
  __syncthreads();
  T* out = static_cast<T*>(a.out) + static_cast<int64_t>(b) * a.o_s0;
  for (int idx = tid; idx < kHeads * kHeadDim / 4; idx += kThreads) {
    const int h = idx / (kHeadDim / 4), d = (idx % (kHeadDim / 4)) * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int k = 0; k < kTopK; ++k) {
      const float w = s_w[k][h];
      const float4 v = __ldcg(reinterpret_cast<const float4*>(
          a.part_o + (req_row + k * kHeads + h) * kHeadDim + d));
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
    const float inv = s_inv[h];
    uint2 packed;
    packed.x = Mma<T>::pack(acc.x * inv, acc.y * inv);
    packed.y = Mma<T>::pack(acc.z * inv, acc.w * inv);
    *reinterpret_cast<uint2*>(out + h * a.o_s1 + d) = packed;
  }
}

template <typename T>
cudaError_t launch_t(const AttendDecodeArgs& a, cudaStream_t st) {
  const int smem = static_cast<int>(kSmemElems * sizeof(T));
  if (cudaError_t e = raise_smem_limit<attend_decode_kernel<T>>(smem); e != cudaSuccess) return e;
  const int64_t grid = static_cast<int64_t>(a.n) * kTopK;
  if (grid > 0) attend_decode_kernel<T><<<static_cast<unsigned>(grid), kThreads, smem, st>>>(a);
  return cudaGetLastError();
}

}  // namespace

int launch_attend_decode(const AttendDecodeArgs& a, int dtype, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dtype == ATTNRT_BF16 ? launch_t<__nv_bfloat16>(a, st) : launch_t<__half>(a, st);
}

}  // namespace attnrt_cuda_sm90
