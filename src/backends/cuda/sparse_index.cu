// MiniMax block indexer on CUDA (spec/minimax-sparse.md §3): block scores of the index query
// heads against the shared index-key head, then top-k per (index head, row).
//
// Kernel 1 (scores): one CTA of 4 warps per work item (request, tile of 16 or 64 flattened rows
// row = local token * H_idx + head, range of blocks). Keys are staged 64 at a time in shared
// memory through the page table (any page size: one lookup per key row, so the page layout never
// changes the arithmetic and paged == unpaged bit for bit); Q·K^T runs on tensor cores (WMMA
// bf16/f16 -> f32); each row reduces its block by max or logsumexp with the per-token causal
// mask j <= pos. Scores land in a [q_len*H, ceil(kv_len/B)] matrix per request, sized by the
// plan from the layout itself (no separate max_seqlen that could go stale).
//
// Kernel 2 (top-k): one CTA per (token, head). NaN -> -1e30, init blocks -> 1e30, local blocks
// -> 1e29 (local overrides init), then an exact 4-pass 8-bit radix select of the K_eff-th largest
// score; ties at the threshold go to the lowest block ids (as the reference's stable sort), and
// the selection is compacted by a block scan, so ids come out ascending and unique, -1 padded.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "cuda_common/block_topk.cuh"
#include "cuda_common/kernel_attr.h"
#include "sparse_kernels.h"

namespace attnrt_cuda_sparse {
namespace {

using namespace nvcuda;

constexpr int kThreads = 128;
constexpr int kChunk = 64;  // keys staged per step

template <int D>
__device__ __forceinline__ void copy_row(void* dst, const void* src, bool valid) {
  // D 16-bit elements = D/8 uint4; the caller spreads rows over threads.
  uint4* d = reinterpret_cast<uint4*>(dst);
  const uint4* s = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < D / 8; ++i) d[i] = valid ? s[i] : make_uint4(0, 0, 0, 0);
}

template <typename T, int D, int RW>
__global__ void __launch_bounds__(kThreads) index_score_kernel(IndexArgs a) {
  constexpr int RT = 16 * RW;        // rows per tile
  constexpr int LD = D + 8;          // smem row pitch (elements), breaks bank conflicts
  constexpr int LDS = kChunk + 4;    // score tile pitch (floats)
  constexpr int KBYTES = kChunk * LD * 2;
  constexpr int SBYTES = RT * LDS * 4;
  constexpr int UBYTES = KBYTES > SBYTES ? KBYTES : SBYTES;
  constexpr int TPR = kThreads / RT;  // threads per row in the reduction
  constexpr int KPT = kChunk / TPR;   // keys per thread
  constexpr int KS = 16 * RW;         // keys per warp in the MMA
  constexpr int NF = KS / 16;
  __shared__ __align__(128) T qs[RT * LD];
  __shared__ __align__(128) unsigned char ubuf[UBYTES];
  T* ks = reinterpret_cast<T*>(ubuf);
  float* ss = reinterpret_cast<float*>(ubuf);  // aliases ks after the MMA

  const IndexItem it = a.items[blockIdx.x];
  const int b = it.b;
  const int ql = a.q_len[b], kv = a.kv_len[b];
  const int H = a.H;
  const int nrows = ql * H;
  const int64_t tok0 = a.q_indptr[b];
  const int32_t* pages = a.page_ids + a.page_indptr[b];
  const T* q = static_cast<const T*>(a.q);
  const T* kc = static_cast<const T*>(a.kc);
  const int tid = threadIdx.x, warp = tid / 32;

  // Q tile (invalid rows zero).
  for (int r = tid; r < RT; r += kThreads) {
    const int rr = it.r0 + r;
    const bool v = rr < nrows;
    const T* src = v ? q + (tok0 + rr / H) * a.q_s0 + (rr % H) * a.q_s1 : q;
    copy_row<D>(qs + r * LD, src, v);
  }
  const int myrow = tid / TPR, part = tid % TPR;
  const int rr = it.r0 + myrow;
  const bool row_valid = rr < nrows;
  const int pos = kv - ql + (row_valid ? rr / H : 0);
  const int nvis = pos / a.B + 1;
  const int last_row = min(it.r0 + RT, nrows) - 1;
  const int pos_max = kv - ql + last_row / H;
  const int nblk = (kv + a.B - 1) / a.B;
  float* srow = a.scores + a.score_base[b] + static_cast<int64_t>(rr) * nblk;
  const int wr = warp % RW, wk = (warp / RW) * KS;

  for (int c = it.c0; c < it.c1; ++c) {
    float m = -INFINITY, l = 0.f;
    for (int kk = 0; kk < a.B; kk += kChunk) {
      const int j0 = c * a.B + kk;
      if (j0 > pos_max) break;  // the rest of the block is masked for every row
      const int nkeys = min(min(kChunk, a.B - kk), kv - j0);
      __syncthreads();  // previous step's readers of ss / ks are done
      // Coalesced: consecutive threads read consecutive 16 bytes of a key row.
      constexpr int VPR = D / 8;
#pragma unroll 4
      for (int i = tid; i < kChunk * VPR; i += kThreads) {
        const int r = i / VPR, x = i % VPR;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < nkeys) {
          const int j = j0 + r;
          const T* src = kc + static_cast<int64_t>(pages[j / a.page_size]) * a.k_s0 +
                         (j % a.page_size) * a.k_s1;
          val = reinterpret_cast<const uint4*>(src)[x];
        }
        reinterpret_cast<uint4*>(ks + r * LD)[x] = val;
      }
      __syncthreads();
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[NF];
#pragma unroll
      for (int f = 0; f < NF; ++f) wmma::fill_fragment(acc[f], 0.f);
#pragma unroll
      for (int d = 0; d < D; d += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, qs + wr * 16 * LD + d, LD);
#pragma unroll
        for (int f = 0; f < NF; ++f) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, ks + (wk + f * 16) * LD + d, LD);
          wmma::mma_sync(acc[f], fa, fb, acc[f]);
        }
      }
      __syncthreads();  // ks fully read: ss may overwrite it
#pragma unroll
      for (int f = 0; f < NF; ++f)
        wmma::store_matrix_sync(ss + wr * 16 * LDS + wk + f * 16, acc[f], LDS, wmma::mem_row_major);
      __syncthreads();
      float s[KPT];
      float cm = -INFINITY;
#pragma unroll
      for (int i = 0; i < KPT; ++i) {
        const int k = part * KPT + i;
        const bool v = row_valid && k < nkeys && j0 + k <= pos;
        s[i] = v ? ss[myrow * LDS + k] * a.scale_log2 : -INFINITY;
        cm = fmaxf(cm, s[i]);
      }
#pragma unroll
      for (int o = TPR / 2; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
      const float mn = fmaxf(m, cm);
      if (a.score_lse) {  // uniform branch: every lane reaches the full-warp shuffles
        const bool live = mn != -INFINITY;  // padding rows stay -inf without NaN
        float cs = 0.f;
#pragma unroll
        for (int i = 0; i < KPT; ++i) cs += live ? exp2f(s[i] - mn) : 0.f;
#pragma unroll
        for (int o = TPR / 2; o > 0; o >>= 1) cs += __shfl_xor_sync(0xffffffffu, cs, o);
        if (live) l = l * exp2f(m - mn) + cs;
      }
      m = mn;
    }
    if (part == 0 && row_valid && c < nvis) {
      constexpr float kLn2 = 0.6931471805599453f;
      srow[c] = a.score_lse ? (m + log2f(l)) * kLn2 : m * kLn2;
    }
  }
}

constexpr int kTopkThreads = 256;
using TopK = attnrt_cuda_common::BlockTopK<kTopkThreads>;

__global__ void __launch_bounds__(kTopkThreads) index_topk_kernel(IndexArgs a) {
  __shared__ typename TopK::Storage storage;
  const int64_t t = blockIdx.x / a.H;
  const int h = blockIdx.x % a.H;
  const int tid = threadIdx.x;
  const int b = a.row_req[t];
  const int ql = a.q_len[b], kv = a.kv_len[b];
  const int tl = static_cast<int>(t - a.q_indptr[b]);
  const int pos = kv - ql + tl;
  const int nvis = pos / a.B + 1;
  const int keff = min(a.K, nvis);
  const int nblk = (kv + a.B - 1) / a.B;
  const float* srow = a.scores + a.score_base[b] + static_cast<int64_t>(tl * a.H + h) * nblk;
  int32_t* out = a.topk + h * a.t_s0 + t * a.t_s1;
  for (int k = keff + tid; k < a.K; k += kTopkThreads) out[k * a.t_s2] = -1;
  if (nvis <= a.K) {  // every visible block is selected
    for (int k = tid; k < nvis; k += kTopkThreads) out[k * a.t_s2] = k;
    return;
  }
  const int init_b = a.init_blocks, local_from = nvis - a.local_blocks;
  auto key = [&](int c) {
    return attnrt_cuda_common::block_score_key(srow[c], c, init_b, local_from);
  };
  TopK::select(storage, nvis, keff, key, [&](int i, int c) { out[i * a.t_s2] = c; });
}

template <typename T, int D>
cudaError_t launch_t(const IndexArgs& a, int rw, cudaStream_t st) {
  if (a.num_items > 0) {
    if (rw == 4)
      index_score_kernel<T, D, 4><<<a.num_items, kThreads, 0, st>>>(a);
    else
      index_score_kernel<T, D, 1><<<a.num_items, kThreads, 0, st>>>(a);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  const int64_t grid = a.total_tokens * a.H;
  if (grid > 0) index_topk_kernel<<<static_cast<unsigned>(grid), kTopkThreads, 0, st>>>(a);
  return cudaGetLastError();
}

}  // namespace

int index_load_kernels() {
  using B = __nv_bfloat16;
  using H = __half;
  return attnrt_cuda_common::load_kernels<
      index_score_kernel<B, 32, 1>, index_score_kernel<B, 32, 4>, index_score_kernel<B, 64, 1>,
      index_score_kernel<B, 64, 4>, index_score_kernel<B, 128, 1>, index_score_kernel<B, 128, 4>,
      index_score_kernel<H, 32, 1>, index_score_kernel<H, 32, 4>, index_score_kernel<H, 64, 1>,
      index_score_kernel<H, 64, 4>, index_score_kernel<H, 128, 1>, index_score_kernel<H, 128, 4>,
      index_topk_kernel>();
}

int launch_index(const IndexArgs& a, int dtype, int rows_per_tile, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int rw = rows_per_tile == 64 ? 4 : 1;
  auto by_dim = [&](auto tag) {
    using T = decltype(tag);
    switch (a.D) {
      case 32: return launch_t<T, 32>(a, rw, st);
      case 64: return launch_t<T, 64>(a, rw, st);
      default: return launch_t<T, 128>(a, rw, st);
    }
  };
  return dtype == ATTNRT_BF16 ? by_dim(__nv_bfloat16{}) : by_dim(__half{});
}

}  // namespace attnrt_cuda_sparse
