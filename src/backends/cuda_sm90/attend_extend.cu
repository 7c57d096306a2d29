// Sparse attend for extend on sm_90 (see attend_extend.h): block-major.
//
// Per chunk of rows: (1) bucket: one thread per (token, slot) appends the slot to its block's
// list (repeats, -1 and blocks past the token's position are not live); (2) items: each block
// with a list becomes ceil(len / 32) work items; (3) attend: one CTA of 4 warps per item loads
// the block's 128 K and V rows once into XOR-swizzled shared memory (rows past kv_len zeroed)
// and each warp takes one token at a time (its 16 query heads are the mma rows, Q prefetched by
// cp.async): S = Q K^T over the 128 keys, softmax in the log2 domain (keys past the token's
// position masked in its own block), O = P V with P rounded to the K/V dtype as the reference
// does, and the normalised partial (o / l in the q dtype, m + log2 l) is stored per slot;
// (4) merge: one CTA per token weighs its live slots by lse in slot order, folds in the sink and
// writes out and lse. Every token's arithmetic is the same whichever CTA serves it, so results
// do not depend on the order of the lists (atomics) and repeat bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <attnrt/plugin.h>

#include "attend_decode.h"
#include "attend_extend.h"
#include "cuda_common/kernel_attr.h"
#include "cuda_common/mma_sm80.cuh"
#include "cuda_common/softmax_state.cuh"
#include "cuda_common/warp_tile.cuh"
#include "index_decode.h"

namespace attnrt_cuda_sm90 {
namespace {

using namespace attnrt_cuda_common;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kDT = kHeadDim / 8;   // O n-tiles
constexpr int kKT = kBlock / 8;     // S n-tiles
constexpr int kTileElems = kBlock * kHeadDim;
constexpr int kQElems = kHeads * kHeadDim;
constexpr size_t kSmemElems = 2 * static_cast<size_t>(kTileElems) + 2 * kWarps * kQElems;
constexpr int kSlots = kTopK;

// Block of slot k of `row` when the slot is live (selected, first occurrence, not wholly past
// the token's position), else -1.
__device__ __forceinline__ int slot_block(const AttendExtendArgs& a, int64_t row, int k, int pos) {
  const int32_t* sel = a.topk + row * a.t_s1;
  const int c = sel[k * a.t_s2];
  if (c < 0 || static_cast<int64_t>(c) * kBlock > pos) return -1;
  for (int s = 0; s < k; ++s)
    if (sel[s * a.t_s2] == c) return -1;
  return c;
}

__global__ void bucket_kernel(AttendExtendArgs a, int64_t r0, int nrows) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= nrows * kSlots) return;
  const int64_t row = r0 + idx / kSlots;
  const int c = slot_block(a, row, idx % kSlots, a.row_pos[row]);
  if (c < 0) return;
  const int b = a.row_req[row];
  const int n = atomicAdd(&a.counts[a.blk_base[b] + c], 1);
  a.entries[a.entry_base[b] + static_cast<int64_t>(c) * a.entry_cap[b] + n] = idx;
}

__global__ void items_kernel(AttendExtendArgs a) {
  const int gb = blockIdx.x * blockDim.x + threadIdx.x;
  if (gb >= a.total_blocks) return;
  const int n = a.counts[gb];
  if (n == 0) return;
  const int b = a.blk_req[gb];
  const int ni = (n + kItemTokens - 1) / kItemTokens;
  const int base = atomicAdd(&a.counts[a.total_blocks], ni);
  for (int i = 0; i < ni; ++i)
    a.items[base + i] = {b, gb - a.blk_base[b], i * kItemTokens,
                         min(kItemTokens, n - i * kItemTokens)};
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) attend_blocks_kernel(AttendExtendArgs a, int64_t r0) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);  // [128][128]
  T* sV = sK + kTileElems;                 // [128][128]
  if (blockIdx.x >= static_cast<unsigned>(a.counts[a.total_blocks])) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  T* sQ = sV + kTileElems + warp * 2 * kQElems;  // this warp's two Q buffers
  const AttendExtendItem it = a.items[blockIdx.x];
  const int kv = a.kv_len[it.b];
  const int64_t page = a.page_ids[a.page_indptr[it.b] + it.c];
  const T* kp = static_cast<const T*>(a.kc) + page * a.k_s0;
  const T* vp = static_cast<const T*>(a.vc) + page * a.v_s0;
  for (int i = tid; i < kBlock * kDT; i += kThreads) {
    const int r = i / kDT, ch = i % kDT;
    const bool valid = it.c * kBlock + r < kv;
    cp_async16(smem_u32(sK + swz<kHeadDim>(r, ch * 8)), valid ? kp + r * a.k_s1 + ch * 8 : kp, valid);
    cp_async16(smem_u32(sV + swz<kHeadDim>(r, ch * 8)), valid ? vp + r * a.v_s1 + ch * 8 : vp, valid);
  }
  const int32_t* list = a.entries + a.entry_base[it.b] +
                        static_cast<int64_t>(it.c) * a.entry_cap[it.b] + it.start;
  const T* q = static_cast<const T*>(a.q);
  auto load_q = [&](int i, int buf) {
    const T* src = q + (r0 + list[i] / kSlots) * a.q_s0;
    T* dst = sQ + buf * kQElems;
#pragma unroll
    for (int x = lane; x < kHeads * kDT; x += 32) {
      const int r = x / kDT, ch = x % kDT;
      cp_async16(smem_u32(dst + swz<kHeadDim>(r, ch * 8)), src + r * a.q_s1 + ch * 8, true);
    }
  };
  if (warp < it.count) load_q(warp, 0);
  cp_commit();
  cp_wait<0>();
  __syncthreads();  // K and V from every thread

  const int j0 = it.c * kBlock;
  int n = 0;
  for (int i = warp; i < it.count; i += kWarps, ++n) {
    if (i + kWarps < it.count) load_q(i + kWarps, (n + 1) & 1);
    cp_commit();
    cp_wait<1>();
    __syncwarp();  // token i's Q from every lane
    const int slot = list[i];
    const int64_t row = r0 + slot / kSlots;
    const int pos = a.row_pos[row];
    const T* sq = sQ + (n & 1) * kQElems;
    float s[kKT][4];
    warp_qk<T, kHeadDim>(s, sq, sK, 0);
    const bool own = j0 + kBlock - 1 > pos;  // the token's own block: keys past pos masked
    float m[2], l[2];  // m finite: key j0 <= pos
    warp_softmax(s, j0, a.scale_log2, [&](int j) { return !(own && j > pos); }, m, l);
    float o[kDT][4];
#pragma unroll
    for (int x = 0; x < kDT; ++x) o[x][0] = o[x][1] = o[x][2] = o[x][3] = 0.f;
    warp_pv<T, kHeadDim>(o, s, sV, 0);
    T* po = static_cast<T*>(a.part_o) + static_cast<int64_t>(slot) * kQElems;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = g + 8 * r;
      const float inv = 1.f / l[r];
      uint32_t* dst = reinterpret_cast<uint32_t*>(po + h * kHeadDim + 2 * t4);
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt)
        dst[dt * 4] = Mma<T>::pack(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
      if (t4 == 0) a.part_lse[static_cast<int64_t>(slot) * kHeads + h] = m[r] + log2f(l[r]);
    }
    __syncwarp();  // every lane is done with this Q buffer before it is refilled
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) merge_kernel(AttendExtendArgs a, int64_t r0) {
  __shared__ int s_live[kSlots];
  const int local = blockIdx.x;
  const int64_t row = r0 + local;
  const int tid = threadIdx.x;
  if (tid < kSlots) s_live[tid] = slot_block(a, row, tid, a.row_pos[row]) >= 0;
  __syncthreads();
  const int h = tid / 8, d0 = (tid % 8) * 16;  // 16 heads x 8 threads, 16 dims each
  const int64_t base = static_cast<int64_t>(local) * kSlots;
  float M = -INFINITY;
  for (int k = 0; k < kSlots; ++k)
    if (s_live[k]) M = fmaxf(M, a.part_lse[(base + k) * kHeads + h]);
  float acc[16], L = 0.f;
#pragma unroll
  for (int x = 0; x < 16; ++x) acc[x] = 0.f;
  for (int k = 0; k < kSlots; ++k) {
    if (!s_live[k]) continue;
    const float w = exp2f(a.part_lse[(base + k) * kHeads + h] - M);
    L += w;
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const T*>(a.part_o) +
                                                      (base + k) * kQElems + h * kHeadDim + d0);
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const uint4 u = src[v];
      const uint32_t wds[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const float2 f = Mma<T>::unpack(wds[x]);
        acc[v * 8 + 2 * x] += w * f.x;
        acc[v * 8 + 2 * x + 1] += w * f.y;
      }
    }
  }
  if (a.sink != nullptr) {
    const float cf = fold_sink(M, L, a.sink[h]);
#pragma unroll
    for (int x = 0; x < 16; ++x) acc[x] *= cf;
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  uint4* out = reinterpret_cast<uint4*>(static_cast<T*>(a.out) + row * a.o_s0 + h * a.o_s1 + d0);
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    uint4 u;
    u.x = Mma<T>::pack(acc[v * 8 + 0] * inv, acc[v * 8 + 1] * inv);
    u.y = Mma<T>::pack(acc[v * 8 + 2] * inv, acc[v * 8 + 3] * inv);
    u.z = Mma<T>::pack(acc[v * 8 + 4] * inv, acc[v * 8 + 5] * inv);
    u.w = Mma<T>::pack(acc[v * 8 + 6] * inv, acc[v * 8 + 7] * inv);
    out[v] = u;
  }
  if (a.lse != nullptr && d0 == 0)
    a.lse[row * a.lse_s0 + h] = natural_lse(M, L);
}

template <typename T>
constexpr int kBlocksSmem = static_cast<int>(kSmemElems * sizeof(T));

template <typename T>
cudaError_t launch_t(const AttendExtendArgs& a, cudaStream_t st) {
  constexpr int smem = kBlocksSmem<T>;
  if (cudaError_t e = raise_smem_limit<attend_blocks_kernel<T>>(smem); e != cudaSuccess) return e;
  for (int64_t r0 = 0; r0 < a.rows; r0 += kExtendChunkRows) {
    const int nrows = static_cast<int>(std::min<int64_t>(kExtendChunkRows, a.rows - r0));
    if (cudaError_t e = cudaMemsetAsync(a.counts, 0, sizeof(int32_t) * (a.total_blocks + 1), st);
        e != cudaSuccess)
      return e;
    bucket_kernel<<<(nrows * kSlots + 255) / 256, 256, 0, st>>>(a, r0, nrows);
    items_kernel<<<(a.total_blocks + 255) / 256, 256, 0, st>>>(a);
    attend_blocks_kernel<T><<<static_cast<unsigned>(attend_extend_max_items(nrows, a.total_blocks)),
                              kThreads, smem, st>>>(a, r0);
    merge_kernel<T><<<nrows, kThreads, 0, st>>>(a, r0);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

int attend_extend_load_kernels() {
  using B = __nv_bfloat16;
  using H = __half;
  cudaError_t e = load_kernels<bucket_kernel, items_kernel, attend_blocks_kernel<B>,
                               attend_blocks_kernel<H>, merge_kernel<B>, merge_kernel<H>>();
  if (e == cudaSuccess) e = raise_smem_limit<attend_blocks_kernel<B>>(kBlocksSmem<B>);
  if (e == cudaSuccess) e = raise_smem_limit<attend_blocks_kernel<H>>(kBlocksSmem<H>);
  return e;
}

int launch_attend_extend(const AttendExtendArgs& a, int dtype, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dtype == ATTNRT_BF16 ? launch_t<__nv_bfloat16>(a, st) : launch_t<__half>(a, st);
}

}  // namespace attnrt_cuda_sm90
