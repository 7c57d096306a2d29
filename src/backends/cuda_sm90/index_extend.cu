// MiniMax indexer for extend on sm_90 (see index_extend.h).
//
// Scores: one CTA of 4 warps per work item (a tile of 128 query tokens of one request against a
// range of 16 key blocks). The tile's index queries are held as mma fragments in registers (32
// tokens per warp, so each key fragment read from shared memory feeds two mma rows); each key block (one 32 KB page) streams through a 3-stage cp.async pipeline
// into XOR-swizzled shared memory, S = Q K^T runs on tensor cores (mma.sync m16n8k16, f32
// accumulate) 64 keys at a time, and each token keeps the max over the block's keys j <= pos
// (its causal mask), scaled by index_scale. Scores land in a [q_len, nblk] matrix per request.
// Top-k: one CTA per token, the exact radix select of cuda_common/block_topk.cuh over the
// token's visible blocks (forced init/local blocks, NaN as -1e30, ascending, -1 padded).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <attnrt/plugin.h>

#include "cuda_common/block_topk.cuh"
#include "cuda_common/kernel_attr.h"
#include "cuda_common/mma_sm80.cuh"
#include "index_decode.h"
#include "index_extend.h"

namespace attnrt_cuda_sm90 {
namespace {

using namespace attnrt_cuda_common;

constexpr int kThreads = 128;
constexpr int kWarpRows = 32;  // query rows per warp: two m16 tiles
constexpr int kStages = 3;
constexpr int kTileElems = kBlock * kDim;  // one page of keys (or the query tile)
constexpr int kChunks = kDim / 8;          // 16-byte chunks of a row
static_assert(kIndexTileRows == kWarpRows * (kThreads / 32), "32 query rows per warp");
static_assert(kIndexTileRows == kBlock, "the query tile is staged in a key stage");

template <typename T>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t row_stride, int rows) {
  for (int i = threadIdx.x; i < kBlock * kChunks; i += kThreads) {
    const int r = i / kChunks, ch = i % kChunks;
    const bool valid = r < rows;
    cp_async16(smem_u32(dst + swz<kDim>(r, ch * 8)), valid ? src + r * row_stride + ch * 8 : src,
               valid);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) index_scores_kernel(IndexExtendArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* stage = reinterpret_cast<T*>(smem_raw);  // kStages x [128][128]
  const IndexExtendItem it = a.items[blockIdx.x];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int ql = a.q_len[it.b], kv = a.kv_len[it.b];
  const int nblk = (kv + kBlock - 1) / kBlock;
  const int32_t* pages = a.page_ids + a.page_indptr[it.b];
  const T* kc = static_cast<const T*>(a.kc);
  const int nb = it.c1 - it.c0;

  // Query tile (rows past q_len zero) into the last stage, then blocks c0 and c0+1.
  load_tile(stage + (kStages - 1) * kTileElems,
            static_cast<const T*>(a.q) + (a.q_indptr[it.b] + it.t0) * a.q_s0, a.q_s0,
            min(kIndexTileRows, ql - it.t0));
  cp_commit();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nb)
      load_tile(stage + s * kTileElems, kc + static_cast<int64_t>(pages[it.c0 + s]) * a.k_s0, kDim,
                kBlock);
    cp_commit();
  }
  cp_wait<kStages - 1>();
  __syncthreads();
  uint32_t qa[2][kDim / 16][4];
  {
    const T* sq = stage + (kStages - 1) * kTileElems;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int kk = 0; kk < kDim / 16; ++kk)
        ldsm_x4(qa[mt][kk], smem_u32(sq + swz<kDim>(warp * kWarpRows + mt * 16 + (lane & 15),
                                                   kk * 16 + (lane >> 4) * 8)));
  }
  // This thread's 4 rows: g, g + 8, g + 16, g + 24 of the warp's 32 (local token index, position).
  const int row_base = it.t0 + warp * kWarpRows + g;
  const int pos_base = kv - ql + row_base;
  float* srow = a.scores + a.score_base[it.b] + static_cast<int64_t>(row_base) * nblk;

  for (int i = 0; i < nb; ++i) {
    cp_wait<kStages - 2>();
    __syncthreads();  // block i landed; every warp is done with the stage refilled below
    if (i + kStages - 1 < nb)
      load_tile(stage + ((i + kStages - 1) % kStages) * kTileElems,
                kc + static_cast<int64_t>(pages[it.c0 + i + kStages - 1]) * a.k_s0, kDim, kBlock);
    cp_commit();
    const T* sk = stage + (i % kStages) * kTileElems;
    const int c = it.c0 + i, j0 = c * kBlock;
    float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll 1
    for (int q4 = 0; q4 < 4; ++q4) {  // 32 keys at a time
      float s[2][4][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < 4; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kDim / 16; ++kk)
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bf[4];
          const int key = q4 * 32 + np * 16 + (lane >> 4) * 8 + (lane & 7);
          ldsm_x4(bf, smem_u32(sk + swz<kDim>(key, kk * 16 + ((lane >> 3) & 1) * 8)));
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            Mma<T>::run(s[mt][2 * np], qa[mt][kk], bf[0], bf[1]);
            Mma<T>::run(s[mt][2 * np + 1], qa[mt][kk], bf[2], bf[3]);
          }
        }
      // Only the tile's diagonal blocks hold keys past some row's position.
      const bool diag = j0 + q4 * 32 + 31 > pos_base;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = 2 * mt + (e >> 1);  // rows g + 8 r
            const int j = j0 + q4 * 32 + n * 8 + 2 * t4 + (e & 1);
            m[r] = fmaxf(m[r], diag && j > pos_base + 8 * r ? -INFINITY : s[mt][n][e]);
          }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 1));
      m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 2));
      // Blocks past a row's own block are never read by its top-k: not written.
      if (t4 == 0 && row_base + 8 * r < ql && j0 <= pos_base + 8 * r)
        srow[8 * r * static_cast<int64_t>(nblk) + c] = m[r] * a.scale;
    }
  }
}

constexpr int kTopkThreads = 128;
using TopK = BlockTopK<kTopkThreads>;

__global__ void __launch_bounds__(kTopkThreads) index_topk_kernel(IndexExtendArgs a) {
  __shared__ typename TopK::Storage storage;
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  const int b = a.row_req[t];
  const int ql = a.q_len[b], kv = a.kv_len[b];
  const int tl = static_cast<int>(t - a.q_indptr[b]);
  const int nvis = (kv - ql + tl) / kBlock + 1;
  const int keff = min(kTopK, nvis);
  const int nblk = (kv + kBlock - 1) / kBlock;
  const float* srow = a.scores + a.score_base[b] + static_cast<int64_t>(tl) * nblk;
  int32_t* out = a.topk + t * a.t_s1;
  for (int k = keff + tid; k < kTopK; k += kTopkThreads) out[k * a.t_s2] = -1;
  if (nvis <= kTopK) {  // every visible block is selected
    for (int k = tid; k < nvis; k += kTopkThreads) out[k * a.t_s2] = k;
    return;
  }
  const int init_b = a.init_blocks, local_from = nvis - a.local_blocks;
  auto key = [&](int c) { return block_score_key(srow[c], c, init_b, local_from); };
  TopK::select(storage, nvis, keff, key, [&](int k, int c) { out[k * a.t_s2] = c; });
}

template <typename T>
constexpr int kScoresSmem = kStages * kTileElems * static_cast<int>(sizeof(T));

template <typename T>
cudaError_t launch_t(const IndexExtendArgs& a, cudaStream_t st) {
  constexpr int smem = kScoresSmem<T>;
  if (cudaError_t e = raise_smem_limit<index_scores_kernel<T>>(smem); e != cudaSuccess) return e;
  if (a.num_items > 0) index_scores_kernel<T><<<a.num_items, kThreads, smem, st>>>(a);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (a.total_tokens > 0)
    index_topk_kernel<<<static_cast<unsigned>(a.total_tokens), kTopkThreads, 0, st>>>(a);
  return cudaGetLastError();
}

}  // namespace

int index_extend_load_kernels() {
  using B = __nv_bfloat16;
  cudaError_t e = load_kernels<index_scores_kernel<B>, index_scores_kernel<__half>, index_topk_kernel>();
  if (e == cudaSuccess) e = raise_smem_limit<index_scores_kernel<B>>(kScoresSmem<B>);
  if (e == cudaSuccess) e = raise_smem_limit<index_scores_kernel<__half>>(kScoresSmem<__half>);
  return e;
}

int launch_index_extend(const IndexExtendArgs& a, int dtype, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dtype == ATTNRT_BF16 ? launch_t<__nv_bfloat16>(a, st) : launch_t<__half>(a, st);
}

}  // namespace attnrt_cuda_sm90
