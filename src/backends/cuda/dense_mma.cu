// Dense paged attention on tensor cores (sm_80+ mma.sync m16n8k16, bf16/f16 in, f32 accumulate).
//
// One kernel template serves both dense ops:
//   * extend: a CTA of 4 warps owns a tile of 128 query rows (64 at d=256) of one request and one
//     query head; each warp owns 32 rows (16 at d=256) and walks every key tile [0, last visible
//     key] of the request with an online softmax (causal mask only on tiles crossing the diagonal).
//   * decode: a CTA owns (request, KV head, split, head chunk); the 16 mma rows are the query
//     heads of the GQA group (so K/V rows are read once per group), the 4 warps take different
//     16-key slices of each K/V tile, and the CTA merges its warps; splits are merged by lse in a
//     second kernel (empty splits -> lse = -inf, o = 0).
// K/V tiles are gathered row by row from the paged cache with cp.async (16-byte chunks, XOR
// swizzle against bank conflicts, zero-fill past the end) into two shared-memory stages: the
// next tile is in flight while the current one is computed.
#include "dense_kernels.h"
#include "dense_args.h"

#include "cuda_common/attend_tensors.h"
#include "cuda_common/device_runtime.h"
#include "cuda_common/kernel_attr.h"
#include "cuda_common/mma_sm80.cuh"
#include "cuda_common/softmax_state.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <new>
#include <vector>

namespace attnrt_cuda_dense {
namespace {

using namespace attnrt_cuda_common;

constexpr int kThreads = 128;

int32_t set_err(char* err, size_t cap, int32_t status, const char* what, cudaError_t e) {
  std::snprintf(err, cap, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
  return status;
}

#define DK_CK(call)                                                             \
  do {                                                                          \
    cudaError_t e_ = (call);                                                    \
    if (e_ != cudaSuccess) return set_err(err, cap, ATTNRT_INTERNAL, #call, e_); \
  } while (0)

template <int D, bool DECODE>
struct Cfg {
  // 16-row mma tiles per warp: extend gives each warp 32 query rows (d <= 128), so every K/V
  // fragment read from shared memory feeds two mma rows (half the shared-memory traffic per
  // FLOP); d = 256 keeps 16 (its O accumulators would not fit twice in registers).
  static constexpr int MR = (DECODE || D == 256) ? 1 : 2;
  // Keys per tile (64 measured faster than 32 for d = 128 extend on the H200: 2.23 vs 2.33 ms
  // at 4k x 4, although 64 spills a few registers).
  static constexpr int BK = DECODE ? 64 : (D == 256 ? 32 : 64);
  static constexpr int BQ = DECODE ? 16 : 64 * MR;               // query rows per CTA
  static constexpr int BKW = DECODE ? BK / 4 : BK;               // keys per warp per tile
  static constexpr int NT = BKW / 8;                             // S n-tiles per warp
  static constexpr int KS = BKW / 16;                            // PV k-steps per warp
  static constexpr int DT = D / 8;                               // O n-tiles
  static constexpr int DK = D / 16;                              // QK k-steps
  static constexpr bool kQReg = MR == 1 && D <= 128;             // Q fragments in registers
  static constexpr size_t kQElems = static_cast<size_t>(BQ) * D;
  static constexpr size_t kKVElems = static_cast<size_t>(BK) * D;
  static constexpr size_t smem_bytes(size_t esize) {
    return esize * (kQElems + 4 * kKVElems);  // Q + 2 stages of (K, V)
  }
};

template <typename T, int D, bool DECODE>
__global__ void __launch_bounds__(kThreads, DECODE ? (D == 256 ? 1 : 3) : 2) attn_mma_kernel(Args a) {
  using C = Cfg<D, DECODE>;
  constexpr int BK = C::BK, BQ = C::BQ, BKW = C::BKW, NT = C::NT, KS = C::KS, DT = C::DT,
                DK = C::DK;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + C::kQElems;           // [2][BK][D]
  T* sV = sK + 2 * C::kKVElems;      // [2][BK][D]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;

  // ---- what this CTA computes
  int b, kvh, key_begin, key_end, tok0 = 0, qs = 0, h_ext = 0, hc = 0, item = 0;
  int rows_valid;  // extend: query rows of the tile; decode: heads of the chunk
  if constexpr (!DECODE) {
    const int2 tile = extend_block(a, h_ext);
    b = tile.x;
    qs = tile.y;
    kvh = h_ext / a.group;
    const int kv = a.kv_len[b], ql = a.q_len[b];
    rows_valid = min(BQ, ql - qs);
    tok0 = a.q_start[b] + qs;
    key_begin = 0;
    key_end = min(kv, kv - ql + qs + BQ);
  } else {
    item = blockIdx.x;
    b = item / a.splits;
    const int s = item - b * a.splits;
    kvh = blockIdx.y / a.head_chunks;
    hc = blockIdx.y - kvh * a.head_chunks;
    rows_valid = min(16, a.group - hc * 16);
    tok0 = a.q_start[b];
    const int kv = a.kv_len[b];
    int chunk = (kv + a.splits - 1) / a.splits;
    chunk = (chunk + BK - 1) / BK * BK;
    key_begin = min(kv, s * chunk);
    key_end = min(kv, key_begin + chunk);
  }
  const T* __restrict__ q = static_cast<const T*>(a.q);
  const T* __restrict__ kc = static_cast<const T*>(a.kc);
  const T* __restrict__ vc = static_cast<const T*>(a.vc);
  const int32_t* __restrict__ pages = a.page_ids + a.page_indptr[b];

  // ---- Q tile -> shared memory (rows past the valid ones are zero)
  for (int idx = tid; idx < BQ * DT; idx += kThreads) {
    const int r = idx / DT, c = idx % DT;
    const bool valid = r < rows_valid;
    const T* src = q;
    if (valid) {
      src = DECODE ? q + tok0 * a.q_s0 + (kvh * a.group + hc * 16 + r) * a.q_s1 + c * 8
                   : q + static_cast<int64_t>(tok0 + r) * a.q_s0 + h_ext * a.q_s1 + c * 8;
    }
    cp_async16(smem_u32(sQ + swz<D>(r, c * 8)), src, valid);
  }

  // ---- K/V tile loader: each thread owns one 16-byte column chunk of several rows
  constexpr int kRowsPerPass = kThreads / DT;
  constexpr int kPasses = BK / kRowsPerPass;
  static_assert(kThreads % DT == 0 && BK % kRowsPerPass == 0, "tile shape");
  const int lc = tid % DT, lr0 = tid / DT;
  auto load_tile = [&](int j0, int stage) {
    T* dk = sK + stage * C::kKVElems;
    T* dv = sV + stage * C::kKVElems;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = lr0 + i * kRowsPerPass;
      const int j = j0 + r;
      const bool valid = j < key_end;
      const T* ks = kc;
      const T* vs = vc;
      if (valid) {
        int pg, row;
        key_page(a, j, pg, row);
        const int64_t page = pages[pg];
        ks = kc + page * a.k_s0 + row * a.k_s1 + kvh * a.k_s2 + lc * 8;
        vs = vc + page * a.v_s0 + row * a.v_s1 + kvh * a.v_s2 + lc * 8;
      }
      cp_async16(smem_u32(dk + swz<D>(r, lc * 8)), ks, valid);
      cp_async16(smem_u32(dv + swz<D>(r, lc * 8)), vs, valid);
    }
  };

  const int n_tiles = (key_end - key_begin + BK - 1) / BK;
  if (n_tiles > 0) load_tile(key_begin, 0);
  cp_commit();  // group 0: Q (+ tile 0)

  // ---- per-thread state. Row slot q (0 .. 2*MR-1) of a thread is mma row
  // wrow + (q / 2) * 16 + g + 8 * (q % 2) of the CTA tile; element e of S/O tile mr belongs to
  // slot 2 * mr + e / 2.
  constexpr int MR = C::MR, NQ = 2 * MR;
  const int wrow = DECODE ? 0 : warp * 16 * MR;  // first mma row of the warp in the Q tile
  const int wkey = DECODE ? warp * BKW : 0;      // first key of the warp inside a K/V tile
  float o[MR][DT][4];
#pragma unroll
  for (int mr = 0; mr < MR; ++mr)
#pragma unroll
    for (int i = 0; i < DT; ++i) o[mr][i][0] = o[mr][i][1] = o[mr][i][2] = o[mr][i][3] = 0.f;
  float m[NQ], l[NQ];
  int lim[NQ];  // last visible key + 1 of each row slot
#pragma unroll
  for (int q = 0; q < NQ; ++q) {
    m[q] = -INFINITY;
    l[q] = 0.f;
    if constexpr (!DECODE) {
      const int kv = a.kv_len[b], ql = a.q_len[b];
      lim[q] = min(kv, kv - ql + qs + wrow + (q >> 1) * 16 + g + 8 * (q & 1) + 1);
    } else {
      lim[q] = key_end;
    }
  }
  int lim_min = lim[0];
#pragma unroll
  for (int q = 1; q < NQ; ++q) lim_min = min(lim_min, lim[q]);
  uint32_t qf[C::kQReg ? DK : 1][4];

  for (int it = 0; it < n_tiles; ++it) {
    const int j0 = key_begin + it * BK;
    if (it + 1 < n_tiles) {
      load_tile(j0 + BK, (it + 1) & 1);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const T* k_s = sK + (it & 1) * C::kKVElems;
    const T* v_s = sV + (it & 1) * C::kKVElems;
    if constexpr (C::kQReg) {
      if (it == 0) {
#pragma unroll
        for (int kk = 0; kk < DK; ++kk)
          ldsm_x4(qf[kk], smem_u32(sQ + swz<D>(wrow + (lane & 15), kk * 16 + (lane >> 4) * 8)));
      }
    }
    // S = Q K^T for this warp's 16*MR rows x BKW keys
    float s[MR][NT][4];
#pragma unroll
    for (int mr = 0; mr < MR; ++mr)
#pragma unroll
      for (int i = 0; i < NT; ++i) s[mr][i][0] = s[mr][i][1] = s[mr][i][2] = s[mr][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
      uint32_t af[MR][4];
#pragma unroll
      for (int mr = 0; mr < MR; ++mr) {
        if constexpr (C::kQReg) {
#pragma unroll
          for (int i = 0; i < 4; ++i) af[mr][i] = qf[kk][i];
        } else {
          ldsm_x4(af[mr], smem_u32(sQ + swz<D>(wrow + mr * 16 + (lane & 15),
                                               kk * 16 + (lane >> 4) * 8)));
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bf[4];
        const int key = wkey + np * 16 + (lane >> 4) * 8 + (lane & 7);
        ldsm_x4(bf, smem_u32(k_s + swz<D>(key, kk * 16 + ((lane >> 3) & 1) * 8)));
#pragma unroll
        for (int mr = 0; mr < MR; ++mr) {
          Mma<T>::run(s[mr][2 * np], af[mr], bf[0], bf[1]);
          Mma<T>::run(s[mr][2 * np + 1], af[mr], bf[2], bf[3]);
        }
      }
    }
    // Mask keys past each row's limit (only tiles that cross the diagonal or the end).
    if (j0 + wkey + BKW > lim_min) {
#pragma unroll
      for (int mr = 0; mr < MR; ++mr)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = j0 + wkey + nt * 8 + 2 * t4 + (e & 1);
            if (j >= lim[2 * mr + (e >> 1)]) s[mr][nt][e] = -INFINITY;
          }
    }
    // Online softmax (log2 domain, scores scaled by sm_scale * log2 e).
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const int mr = q >> 1, h = (q & 1) * 2;
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mr][nt][h], s[mr][nt][h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = fmaxf(m[q], mx * a.scale_log2);
      const float base = mn == -INFINITY ? 0.f : mn;
      const float corr = fast_exp2(m[q] - base);  // m = -inf -> 0
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float p0 = fast_exp2(fmaf(s[mr][nt][h], a.scale_log2, -base));
        const float p1 = fast_exp2(fmaf(s[mr][nt][h + 1], a.scale_log2, -base));
        s[mr][nt][h] = p0;
        s[mr][nt][h + 1] = p1;
        sum += p0 + p1;
      }
      l[q] = l[q] * corr + sum;
      m[q] = mn;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[mr][dt][h] *= corr;
        o[mr][dt][h + 1] *= corr;
      }
    }
    // O += P V
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t pf[MR][4];
#pragma unroll
      for (int mr = 0; mr < MR; ++mr) {
        pf[mr][0] = Mma<T>::pack(s[mr][2 * ks][0], s[mr][2 * ks][1]);
        pf[mr][1] = Mma<T>::pack(s[mr][2 * ks][2], s[mr][2 * ks][3]);
        pf[mr][2] = Mma<T>::pack(s[mr][2 * ks + 1][0], s[mr][2 * ks + 1][1]);
        pf[mr][3] = Mma<T>::pack(s[mr][2 * ks + 1][2], s[mr][2 * ks + 1][3]);
      }
      const int key = wkey + ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t bf[4];
        ldsm_x4_t(bf, smem_u32(v_s + swz<D>(key, dp * 16 + (lane >> 4) * 8)));
#pragma unroll
        for (int mr = 0; mr < MR; ++mr) {
          Mma<T>::run(o[mr][2 * dp], pf[mr], bf[0], bf[1]);
          Mma<T>::run(o[mr][2 * dp + 1], pf[mr], bf[2], bf[3]);
        }
      }
    }
    __syncthreads();  // the stage read here is refilled next iteration
  }
  cp_wait<0>();  // (no tiles: the Q copy)

#pragma unroll
  for (int q = 0; q < NQ; ++q) {
    l[q] += __shfl_xor_sync(0xffffffffu, l[q], 1);
    l[q] += __shfl_xor_sync(0xffffffffu, l[q], 2);
  }

  if constexpr (!DECODE) {
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const int mr = q >> 1, h = (q & 1) * 2;
      const int row = wrow + mr * 16 + g + 8 * (q & 1);
      if (row < rows_valid)
        store_extend_row<T, DT>(a, tok0 + row, h_ext, t4, m[q], l[q], [&](int dt) {
          return make_float2(o[mr][dt][h], o[mr][dt][h + 1]);
        });
    }
  } else {
    // Merge the 4 warps (same rows, different keys) through shared memory (K/V stages are free).
    __shared__ float s_m[4][16], s_l[4][16];
    float* red = reinterpret_cast<float*>(sK);  // [4][16][D] floats
    static_assert(4 * 16 * D * sizeof(float) <= 4 * C::kKVElems * sizeof(T), "merge buffer");
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
      const float f = (m[r] == -INFINITY) ? 0.f : exp2f(m[r] - M);
      float* dst = red + (warp * 16 + row) * D + 2 * t4;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        dst[dt * 8] = o[0][dt][2 * r] * f;
        dst[dt * 8 + 1] = o[0][dt][2 * r + 1] * f;
      }
    }
    __syncthreads();
    const int hq0 = kvh * a.group + hc * 16;
    for (int idx = tid; idx < 16 * D; idx += kThreads) {
      const int row = idx / D, d = idx % D;
      if (row >= rows_valid) continue;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < 4; ++w) M = fmaxf(M, s_m[w][row]);
      float L = 0.f, acc = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          L += s_l[w][row] * exp2f(s_m[w][row] - M);  // -inf - M -> 0
          acc += red[(w * 16 + row) * D + d];
        }
      }
      const int64_t prow = static_cast<int64_t>(item) * a.hq + hq0 + row;
      a.part_o[prow * D + d] = L > 0.f ? acc / L : 0.f;  // empty split: o = 0
      if (d == 0) a.part_lse[prow] = log2_lse(M, L);
    }
  }
}

// Merge of decode splits: one warp per (request, query head); folds in the sink; never NaN.
template <typename T, int D>
__global__ void decode_merge_kernel(Args a, int n) {
  constexpr int NV = D / 32;
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (w >= n * a.hq) return;
  const int b = w / a.hq, h = w - b * a.hq, lane = threadIdx.x & 31;
  const int i0 = b * a.splits, i1 = i0 + a.splits;
  float M = -INFINITY;
  for (int i = i0; i < i1; ++i) M = fmaxf(M, a.part_lse[static_cast<int64_t>(i) * a.hq + h]);
  float acc[NV], L = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) acc[k] = 0.f;
  if (M != -INFINITY) {
    for (int i = i0; i < i1; ++i) {
      const int64_t prow = static_cast<int64_t>(i) * a.hq + h;
      const float wt = exp2f(a.part_lse[prow] - M);
      L += wt;
      const float* po = a.part_o + prow * D + lane * NV;
#pragma unroll
      for (int k = 0; k < NV; ++k) acc[k] += wt * po[k];
    }
  }
  if (a.sink != nullptr) {
    const float c = fold_sink(M, L, a.sink[h]);
#pragma unroll
    for (int k = 0; k < NV; ++k) acc[k] *= c;
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  const int64_t tok = a.q_start[b];
  T* orow = static_cast<T*>(a.out) + tok * a.o_s0 + h * a.o_s1 + lane * NV;
#pragma unroll
  for (int k = 0; k < NV; k += 2) {
    const uint32_t v = Mma<T>::pack(acc[k] * inv, acc[k + 1] * inv);
    *reinterpret_cast<uint32_t*>(orow + k) = v;
  }
  if (a.lse != nullptr && lane == 0)
    a.lse[tok * a.lse_s0 + h] = natural_lse(M, L);
}

// ---------------------------------------------------------------------------------------------
// Host side

struct DensePlan {
  attnrt_problem problem{};  // first member: the plugin dispatches on problem.op
  int n = 0;
  int num_tiles = 0;      // extend
  int section_heads = 0;  // extend: query heads per section of the block order (extend_block)
  bool wgmma = false;     // extend: the Hopper kernel serves this plan
  int splits = 1;         // decode: per request (uniform, so the grid is fixed for graphs)
  int head_chunks = 1;    // decode: ceil(group / 16)
  int page_capacity = 0;  // decode: page_ids entries the device buffer holds
  int32_t* d_kv_len = nullptr;
  int32_t* d_q_len = nullptr;
  int32_t* d_q_start = nullptr;
  int32_t* d_page_indptr = nullptr;
  int32_t* d_page_ids = nullptr;
  int2* d_tiles = nullptr;
  float* d_part_o = nullptr;
  float* d_part_lse = nullptr;
};

void free_plan(DensePlan* p) {
  if (!p) return;
  cudaFree(p->d_kv_len);
  cudaFree(p->d_q_len);
  cudaFree(p->d_q_start);
  cudaFree(p->d_page_indptr);
  cudaFree(p->d_page_ids);
  cudaFree(p->d_tiles);
  cudaFree(p->d_part_o);
  cudaFree(p->d_part_lse);
  delete p;
}

// Loads the attention kernel and the decode merge of dtype T and head dim D (both modes), with
// the attention kernel's shared-memory limit raised.
template <typename T, int D>
cudaError_t load_t() {
  using attnrt_cuda_common::raise_smem_limit;
  cudaError_t e = attnrt_cuda_common::load_kernels<attn_mma_kernel<T, D, false>,
                                                   attn_mma_kernel<T, D, true>,
                                                   decode_merge_kernel<T, D>>();
  if (e == cudaSuccess)
    e = raise_smem_limit<attn_mma_kernel<T, D, false>>(
        static_cast<int>(Cfg<D, false>::smem_bytes(sizeof(T))));
  if (e == cudaSuccess)
    e = raise_smem_limit<attn_mma_kernel<T, D, true>>(
        static_cast<int>(Cfg<D, true>::smem_bytes(sizeof(T))));
  return e;
}

// Decode CTAs of this head dim that fit on one multiprocessor at once.
template <typename T>
cudaError_t resident_per_sm(int d, int* out) {
  auto q = [&](auto kernel, size_t smem) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, kernel, kThreads, smem);
  };
  switch (d) {
    case 64: return q(attn_mma_kernel<T, 64, true>, Cfg<64, true>::smem_bytes(sizeof(T)));
    case 128: return q(attn_mma_kernel<T, 128, true>, Cfg<128, true>::smem_bytes(sizeof(T)));
    default: return q(attn_mma_kernel<T, 256, true>, Cfg<256, true>::smem_bytes(sizeof(T)));
  }
}

// Split count for `base` (request, kv head, head chunk) CTAs on `slots` resident CTA slots, at
// most `max_splits`: the smallest whose grid fills its last wave to >= 90%, else the fullest.
int decode_splits(int64_t base, int64_t slots, int64_t max_splits) {
  int best = 1;
  double best_fill = 0;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int64_t ctas = base * s;
    const int64_t waves = (ctas + slots - 1) / slots;
    const double fill = static_cast<double>(ctas) / static_cast<double>(waves * slots);
    if (fill >= 0.9) return static_cast<int>(s);
    if (fill > best_fill + 1e-9) best = static_cast<int>(s), best_fill = fill;
    if (waves > 8) break;  // enough waves that the tail no longer matters
  }
  return best;
}

template <typename T, int D>
int32_t launch(const DensePlan& pl, const Args& a, const CacheExtent (&kv)[2], cudaStream_t st,
               char* err, size_t cap) {
  const attnrt_problem& p = pl.problem;
  if (p.op == ATTNRT_OP_DENSE_EXTEND) {
    if (pl.num_tiles == 0) return ATTNRT_OK;
    if (pl.wgmma) {
      DK_CK(launch_extend_wgmma<T>(a, kv[0], kv[1], st));
      return ATTNRT_OK;
    }
    attn_mma_kernel<T, D, false><<<a.num_tiles * p.num_q_heads, kThreads,
                                   Cfg<D, false>::smem_bytes(sizeof(T)), st>>>(a);
    DK_CK(cudaGetLastError());
    return ATTNRT_OK;
  }
  if (pl.n == 0) return ATTNRT_OK;
  attn_mma_kernel<T, D, true><<<dim3(pl.n * pl.splits, p.num_kv_heads * pl.head_chunks), kThreads,
                                Cfg<D, true>::smem_bytes(sizeof(T)), st>>>(a);
  DK_CK(cudaGetLastError());
  const int warps = pl.n * p.num_q_heads;
  decode_merge_kernel<T, D><<<(warps + 3) / 4, 128, 0, st>>>(a, pl.n);
  DK_CK(cudaGetLastError());
  return ATTNRT_OK;
}

template <typename T>
int32_t launch_t(const DensePlan& pl, const Args& a, const CacheExtent (&kv)[2], cudaStream_t st,
                 char* err, size_t cap) {
  switch (pl.problem.head_dim) {
    case 64: return launch<T, 64>(pl, a, kv, st, err, cap);
    case 128: return launch<T, 128>(pl, a, kv, st, err, cap);
    case 256: return launch<T, 256>(pl, a, kv, st, err, cap);
    default:
      std::snprintf(err, cap, "head_dim %d not supported", pl.problem.head_dim);
      return ATTNRT_INVALID;
  }
}

int page_shift_of(int ps) {
  if (ps <= 0 || (ps & (ps - 1)) != 0) return -1;
  int s = 0;
  while ((1 << s) < ps) ++s;
  return s;
}

int32_t plan_impl(const attnrt_problem* p, const attnrt_layout* L, int sms, int64_t l2_bytes,
                  bool wgmma, DensePlan* pl, char* err, size_t cap) {
  pl->problem = *p;
  pl->wgmma = wgmma && p->op == ATTNRT_OP_DENSE_EXTEND && p->head_dim == 128;
  const int n = L->num_requests;
  pl->n = n;
  DK_CK(cudaSetDevice(p->device.index));
  std::vector<int32_t> qstart(n + 1);
  for (int b = 0; b <= n; ++b) qstart[b] = static_cast<int32_t>(L->q_indptr[b]);
  const int total_pages = L->page_indptr[n];
  const bool decode = p->op == ATTNRT_OP_DENSE_DECODE;
  // Decode keeps room for growth so that update() can absorb longer contexts in place.
  pl->page_capacity = decode ? std::max(2 * total_pages, total_pages + 64 * n) : total_pages;
  if (int32_t s = upload(&pl->d_kv_len, L->kv_len, n, n, err, cap)) return s;
  if (int32_t s = upload(&pl->d_q_len, L->q_len, n, n, err, cap)) return s;
  if (int32_t s = upload(&pl->d_q_start, qstart.data(), n + 1, n + 1, err, cap)) return s;
  if (int32_t s = upload(&pl->d_page_indptr, L->page_indptr, n + 1, n + 1, err, cap)) return s;
  if (int32_t s = upload(&pl->d_page_ids, L->page_ids, total_pages, pl->page_capacity, err, cap))
    return s;
  if (!decode) {
    // Query tiles of BQ rows, the ones with the most visible keys first (they finish last).
    static_assert(Cfg<128, false>::BQ == kWgmmaTileRows, "one tile list for both d=128 kernels");
    const int bq = p->head_dim == 64    ? Cfg<64, false>::BQ
                   : p->head_dim == 128 ? Cfg<128, false>::BQ
                                        : Cfg<256, false>::BQ;
    std::vector<int2> tiles;
    for (int b = 0; b < n; ++b)
      for (int qs = 0; qs < L->q_len[b]; qs += bq) tiles.push_back(make_int2(b, qs));
    auto keys = [&](const int2& t) {
      return std::min<int64_t>(L->kv_len[t.x], L->kv_len[t.x] - L->q_len[t.x] + t.y + bq);
    };
    std::stable_sort(tiles.begin(), tiles.end(),
                     [&](const int2& x, const int2& y) { return keys(x) > keys(y); });
    pl->num_tiles = static_cast<int>(tiles.size());
    // Sections of the block order: the most KV heads (dividing their number) whose K/V, over all
    // requests, fits in half of L2; at least one. With every head in one section, the CTAs
    // resident at a time read all heads' K/V at once and miss L2 far more often (measured:
    // 64k keys, 8 KV heads, 45 GB read from DRAM at a 60% L2 hit rate, 2.1 GB at 97%).
    int64_t all_keys = 0;
    for (int b = 0; b < n; ++b) all_keys += L->kv_len[b];
    const int64_t kv_head_bytes = 2 * all_keys * p->head_dim * 2;  // K and V, 2-byte elements
    int kvs = 1;
    for (int s = p->num_kv_heads; s > 1; --s)
      if (p->num_kv_heads % s == 0 && s * kv_head_bytes <= l2_bytes / 2) {
        kvs = s;
        break;
      }
    pl->section_heads = kvs * (p->num_q_heads / p->num_kv_heads);
    return upload(&pl->d_tiles, tiles.data(), tiles.size(), tiles.size(), err, cap);
  }
  // Decode: CTAs = requests x splits x kv heads x head chunks, uniform over requests so the grid
  // (and a captured graph) stays fixed. The split count fills the resident CTA slots of the
  // device in whole waves: the smallest count whose last wave is >= 90% full (a 1.3-wave grid
  // leaves most of the device idle during its tail), a split keeping >= 512 keys.
  const int group = p->num_q_heads / p->num_kv_heads;
  pl->head_chunks = (group + 15) / 16;
  int max_kv = 0;
  for (int b = 0; b < n; ++b) max_kv = std::max(max_kv, L->kv_len[b]);
  int per_sm = 1;
  DK_CK(p->q_dtype == ATTNRT_BF16 ? resident_per_sm<__nv_bfloat16>(p->head_dim, &per_sm)
                                  : resident_per_sm<__half>(p->head_dim, &per_sm));
  pl->splits = decode_splits(static_cast<int64_t>(std::max(n, 1)) * p->num_kv_heads * pl->head_chunks,
                             static_cast<int64_t>(sms) * std::max(per_sm, 1),
                             std::max<int64_t>(1, (max_kv + 511) / 512));
  const size_t rows = static_cast<size_t>(n) * pl->splits * p->num_q_heads;
  DK_CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_part_o),
                   sizeof(float) * std::max<size_t>(rows * p->head_dim, 1)));
  DK_CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_part_lse),
                   sizeof(float) * std::max<size_t>(rows, 1)));
  return ATTNRT_OK;
}

}  // namespace

int load_kernels(bool wgmma) {
  using B = __nv_bfloat16;
  using H = __half;
  cudaError_t e = load_t<B, 64>();
  if (e == cudaSuccess) e = load_t<B, 128>();
  if (e == cudaSuccess) e = load_t<B, 256>();
  if (e == cudaSuccess) e = load_t<H, 64>();
  if (e == cudaSuccess) e = load_t<H, 128>();
  if (e == cudaSuccess) e = load_t<H, 256>();
  if (e == cudaSuccess && wgmma) e = load_extend_wgmma_kernels();
  return e;
}

int32_t plan(const attnrt_problem* p, const attnrt_layout* L, int sms, int64_t l2_bytes,
             bool wgmma, attnrt_plan* out, char* err, size_t cap) {
  DensePlan* pl = new (std::nothrow) DensePlan{};
  if (!pl) {
    std::snprintf(err, cap, "out of host memory");
    return ATTNRT_INTERNAL;
  }
  if (int32_t s = plan_impl(p, L, sms, l2_bytes, wgmma, pl, err, cap); s != ATTNRT_OK) {
    free_plan(pl);
    return s;
  }
  *out = reinterpret_cast<attnrt_plan>(pl);
  return ATTNRT_OK;
}

int32_t update(attnrt_plan plan, const attnrt_layout* L, char* err, size_t cap) {
  DensePlan* pl = reinterpret_cast<DensePlan*>(plan);
  if (pl->problem.op != ATTNRT_OP_DENSE_DECODE) {
    std::snprintf(err, cap, "update_plan serves dense_decode plans only");
    return ATTNRT_UNAVAILABLE;
  }
  const int n = L->num_requests;
  if (n != pl->n) {
    std::snprintf(err, cap, "update_plan: %d requests, plan has %d", n, pl->n);
    return ATTNRT_UNAVAILABLE;
  }
  const int total_pages = L->page_indptr[n];
  if (total_pages > pl->page_capacity) {
    std::snprintf(err, cap, "update_plan: %d pages exceed the plan's capacity %d", total_pages,
                  pl->page_capacity);
    return ATTNRT_UNAVAILABLE;
  }
  for (int b = 0; b < n; ++b)
    if (L->q_len[b] != 1 || L->q_indptr[b] != b) {
      std::snprintf(err, cap, "update_plan: request %d is not a decode row", b);
      return ATTNRT_UNAVAILABLE;
    }
  DK_CK(cudaSetDevice(pl->problem.device.index));
  DK_CK(attnrt_cuda_common::quiesce_before_rewrite());  // no launch straddles the rewrite
  DK_CK(cudaMemcpy(pl->d_kv_len, L->kv_len, sizeof(int32_t) * n, cudaMemcpyHostToDevice));
  DK_CK(cudaMemcpy(pl->d_page_indptr, L->page_indptr, sizeof(int32_t) * (n + 1),
                   cudaMemcpyHostToDevice));
  if (total_pages > 0)
    DK_CK(cudaMemcpy(pl->d_page_ids, L->page_ids, sizeof(int32_t) * total_pages,
                     cudaMemcpyHostToDevice));
  DK_CK(attnrt_cuda_common::land_host_writes());
  return ATTNRT_OK;
}

int32_t run(attnrt_plan plan, const attnrt_tensors* t, void* stream, char* err, size_t cap) {
  const DensePlan& pl = *reinterpret_cast<const DensePlan*>(plan);
  const attnrt_problem& p = pl.problem;
  Args a{};
  static_cast<AttendTensors&>(a) = attend_tensors(*t, p);
  a.hq = p.num_q_heads;
  a.group = p.num_q_heads / p.num_kv_heads;
  a.page_size = p.page_size;
  a.page_shift = page_shift_of(p.page_size);
  a.scale_log2 = p.sm_scale * kLog2e;
  a.kv_len = pl.d_kv_len;
  a.q_len = pl.d_q_len;
  a.q_start = pl.d_q_start;
  a.page_indptr = pl.d_page_indptr;
  a.page_ids = pl.d_page_ids;
  a.tiles = pl.d_tiles;
  a.num_tiles = pl.num_tiles;
  a.section_heads = pl.section_heads;
  a.splits = pl.splits;
  a.head_chunks = pl.head_chunks;
  a.part_o = pl.d_part_o;
  a.part_lse = pl.d_part_lse;
  DK_CK(cudaSetDevice(p.device.index));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const CacheExtent kv[2] = {{t->k_cache.shape[0], t->k_cache.shape[2]},
                             {t->v_cache.shape[0], t->v_cache.shape[2]}};
  if (p.q_dtype == ATTNRT_BF16) return launch_t<__nv_bfloat16>(pl, a, kv, st, err, cap);
  return launch_t<__half>(pl, a, kv, st, err, cap);
}

void destroy(attnrt_plan plan) { free_plan(reinterpret_cast<DensePlan*>(plan)); }

}  // namespace attnrt_cuda_dense
