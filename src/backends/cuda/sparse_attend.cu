// MiniMax sparse attend on CUDA (spec/minimax-sparse.md §4): softmax attention of each query
// row over the blocks selected for its KV group, extend and decode alike.
//
// One CTA of 4 warps per (row, KV group g, tile of 16 query heads of the group, split). The
// group's selection is the union of index heads g*R .. g*R+R-1, rebuilt in shared memory as an
// ascending, duplicate-free list (-1 and repeated ids dropped), so every query head of the group
// shares each staged K/V block. Keys are staged 64 at a time through the page table (one lookup
// per key row: any page size, and the page layout never changes the arithmetic, so paged ==
// unpaged bit for bit). S = Q·K^T and O += P·V run on tensor cores (WMMA, f32 accumulate); the
// online softmax keeps f32 max/sum per row; P is rounded to the K/V dtype before P·V as in the
// reference engine. Keys j > pos (the query's own block, per token) are masked.
//
// Decode splits the selected list over `nsplit` CTAs; each writes (o/l, log2 lse) partials, and a
// merge weighs them by lse. Empty splits write lse = -inf and o = 0 and weigh 0 (never NaN).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "cuda_common/kernel_attr.h"
#include "cuda_common/mma_sm80.cuh"
#include "cuda_common/softmax_state.cuh"
#include "sparse_kernels.h"

namespace attnrt_cuda_sparse {
namespace {

using namespace nvcuda;
using attnrt_cuda_common::fold_sink;
using attnrt_cuda_common::log2_lse;
using attnrt_cuda_common::natural_lse;
using attnrt_cuda_common::Mma;

constexpr int kThreads = 128;
constexpr int kChunk = 64;
constexpr int kRows = 16;   // query heads per CTA
constexpr int kMaxEntries = 1024;  // R*K limit (probe)

template <int D>
struct Smem {
  static constexpr int LD = D + 8;       // q/k/v pitch (elements)
  static constexpr int LDS = kChunk + 4;  // s pitch (floats)
  static constexpr int LDP = kChunk + 8;  // p pitch (elements)
  static constexpr int LDO = D + 4;       // o pitch (floats)
  static constexpr size_t q = 0;
  static constexpr size_t k = q + kRows * LD * 2;
  static constexpr size_t v = k + kChunk * LD * 2;
  static constexpr size_t s = v + kChunk * LD * 2;
  static constexpr size_t p = s + kRows * LDS * 4;
  static constexpr size_t o = p + kRows * LDP * 2;
  static constexpr size_t nsel = o + kRows * LDO * 4;
  static constexpr size_t sel = nsel + 32;
  static size_t bytes(int entries) { return sel + 12 * static_cast<size_t>(entries) + 16; }
};

template <int D>
__device__ __forceinline__ void copy_row(void* dst, const void* src, bool valid) {
  uint4* d = reinterpret_cast<uint4*>(dst);
  const uint4* s = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < D / 8; ++i) d[i] = valid ? s[i] : make_uint4(0, 0, 0, 0);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attend_kernel(AttendArgs a) {
  using L = Smem<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem + L::q);
  T* ks = reinterpret_cast<T*>(smem + L::k);
  T* vs = reinterpret_cast<T*>(smem + L::v);
  float* ss = reinterpret_cast<float*>(smem + L::s);
  T* ps = reinterpret_cast<T*>(smem + L::p);
  float* os = reinterpret_cast<float*>(smem + L::o);
  int32_t* sel = reinterpret_cast<int32_t*>(smem + L::sel);
  int& s_nsel = *reinterpret_cast<int*>(smem + L::nsel);

  int cta = blockIdx.x;
  const int split = cta % a.nsplit;
  cta /= a.nsplit;
  const int ht = cta % a.htiles;
  cta /= a.htiles;
  const int g = cta % a.hkv;
  const int row = cta / a.hkv;
  const int tid = threadIdx.x, warp = tid / 32;
  const int b = a.row_req[row];
  const int pos = a.row_pos[row];
  const int32_t* pages = a.page_ids + a.page_indptr[b];
  const int h0 = g * a.group + ht * kRows;
  const int nh = min(kRows, a.group - ht * kRows);
  const T* q = static_cast<const T*>(a.q);
  const T* kc = static_cast<const T*>(a.kc);
  const T* vc = static_cast<const T*>(a.vc);

  for (int r = tid; r < kRows; r += kThreads) {
    const bool v = r < nh;
    copy_row<D>(qs + r * L::LD, v ? q + row * a.q_s0 + (h0 + r) * a.q_s1 : q, v);
  }
  for (int i = tid; i < kRows * L::LDO; i += kThreads) os[i] = 0.f;

  // Union of the group's index heads: ascending, unique, -1 dropped.
  const int E = a.R * a.K;
  int32_t* raw = sel + E;
  int32_t* kval = sel + 2 * E;
  if (tid == 0) s_nsel = 0;
  for (int e = tid; e < E; e += kThreads) {
    const int ih = g * a.R + e / a.K, k = e % a.K;
    raw[e] = a.topk[ih * a.t_s0 + static_cast<int64_t>(row) * a.t_s1 + k * a.t_s2];
  }
  __syncthreads();
  for (int e = tid; e < E; e += kThreads) {
    const int32_t c = raw[e];
    bool keep = c >= 0;
    for (int f = 0; f < e && keep; ++f) keep = raw[f] != c;
    kval[e] = keep ? c : -1;
  }
  __syncthreads();
  for (int e = tid; e < E; e += kThreads) {
    const int32_t c = kval[e];
    if (c < 0) continue;
    int rank = 0;
    for (int f = 0; f < E; ++f) rank += (kval[f] >= 0 && kval[f] < c);
    sel[rank] = c;
    atomicAdd(&s_nsel, 1);
  }
  __syncthreads();
  const int nsel = s_nsel;
  const int e0 = split * a.per_split, e1 = min(nsel, e0 + a.per_split);

  const int myrow = tid / 8, part = tid % 8;  // softmax: 8 threads per row, 8 keys each
  float m = -INFINITY, l = 0.f;
  constexpr int OD = D / 8;  // o columns per thread in rescale / finalize
  for (int e = e0; e < e1; ++e) {
    const int c = sel[e];
    if (static_cast<int64_t>(c) * a.B > pos) continue;  // wholly in the future (uniform)
    for (int kk = 0; kk < a.B; kk += kChunk) {
      const int j0 = c * a.B + kk;
      if (j0 > pos) break;
      const int nkeys = min(min(kChunk, a.B - kk), pos + 1 - j0);
      __syncthreads();
      {
        // Coalesced: consecutive threads read consecutive 16 bytes of a K (then V) row.
        constexpr int VPR = D / 8;
#pragma unroll 4
        for (int i = tid; i < 2 * kChunk * VPR; i += kThreads) {
          const bool is_v = i >= kChunk * VPR;
          const int ii = is_v ? i - kChunk * VPR : i;
          const int r = ii / VPR, x = ii % VPR;
          uint4 val = make_uint4(0, 0, 0, 0);
          if (r < nkeys) {
            const int j = j0 + r;
            const int64_t pg = pages[j / a.page_size];
            const int pr = j % a.page_size;
            const T* src = is_v ? vc + pg * a.v_s0 + pr * a.v_s1 + g * a.v_s2
                                : kc + pg * a.k_s0 + pr * a.k_s1 + g * a.k_s2;
            val = reinterpret_cast<const uint4*>(src)[x];
          }
          reinterpret_cast<uint4*>((is_v ? vs : ks) + r * L::LD)[x] = val;
        }
      }
      __syncthreads();
      {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.f);
#pragma unroll
        for (int d = 0; d < D; d += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
          wmma::load_matrix_sync(fa, qs + d, L::LD);
          wmma::load_matrix_sync(fb, ks + warp * 16 * L::LD + d, L::LD);
          wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(ss + warp * 16, acc, L::LDS, wmma::mem_row_major);
      }
      __syncthreads();
      {
        float s[8], cm = -INFINITY;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int k = part * 8 + i;
          s[i] = k < nkeys ? ss[myrow * L::LDS + k] * a.scale_log2 : -INFINITY;
          cm = fmaxf(cm, s[i]);
        }
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
        const float mn = fmaxf(m, cm);  // finite: every chunk has a valid key
        const float corr = exp2f(m - mn);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float p = exp2f(s[i] - mn);
          sum += p;
          ps[myrow * L::LDP + part * 8 + i] = Mma<T>::from_float(p);
        }
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        l = l * corr + sum;
        m = mn;
        float* orow = os + myrow * L::LDO + part * OD;
#pragma unroll
        for (int i = 0; i < OD; ++i) orow[i] *= corr;
      }
      __syncthreads();
      {
        constexpr int NFO = D / 64;  // 16-column output fragments per warp
#pragma unroll
        for (int f = 0; f < NFO; ++f) {
          const int col = (warp * NFO + f) * 16;
          wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
          wmma::load_matrix_sync(acc, os + col, L::LDO, wmma::mem_row_major);
#pragma unroll
          for (int k = 0; k < kChunk; k += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
            wmma::load_matrix_sync(fa, ps + k, L::LDP);
            wmma::load_matrix_sync(fb, vs + k * L::LD + col, L::LD);
            wmma::mma_sync(acc, fa, fb, acc);
          }
          wmma::store_matrix_sync(os + col, acc, L::LDO, wmma::mem_row_major);
        }
      }
    }
  }
  __syncthreads();
  if (myrow >= nh) return;
  const int h = h0 + myrow;
  const float* orow = os + myrow * L::LDO + part * OD;
  if (a.nsplit == 1) {
    float mm = m, ll = l;
    const float scale = a.sink != nullptr ? fold_sink(mm, ll, a.sink[h]) : 1.f;
    const float inv = ll > 0.f ? scale / ll : 0.f;
    T* out = static_cast<T*>(a.out) + row * a.o_s0 + h * a.o_s1 + part * OD;
#pragma unroll
    for (int i = 0; i < OD; ++i) out[i] = Mma<T>::from_float(orow[i] * inv);
    if (a.lse != nullptr && part == 0)
      a.lse[row * a.lse_s0 + h] = natural_lse(mm, ll);
  } else {
    const int64_t slot = (static_cast<int64_t>(row) * a.nsplit + split) * a.hq + h;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* po = a.part_o + slot * D + part * OD;
#pragma unroll
    for (int i = 0; i < OD; ++i) po[i] = orow[i] * inv;
    if (part == 0) a.part_lse[slot] = log2_lse(m, l);
  }
}

// One warp per (row, q head): weighs the splits by their lse (empty ones weigh 0), folds in the
// sink logit, writes out and lse.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) merge_kernel(AttendArgs a) {
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (w >= a.rows * a.hq) return;
  const int row = w / a.hq, h = w % a.hq;
  const int lane = threadIdx.x & 31;
  constexpr int NV = D / 32;
  const int64_t base = static_cast<int64_t>(row) * a.nsplit * a.hq + h;
  float m = -INFINITY;
  for (int s = 0; s < a.nsplit; ++s) m = fmaxf(m, a.part_lse[base + s * a.hq]);
  float acc[NV], l = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) acc[i] = 0.f;
  if (m != -INFINITY) {
    for (int s = 0; s < a.nsplit; ++s) {
      const float wgt = exp2f(a.part_lse[base + s * a.hq] - m);
      l += wgt;
      const float* po = a.part_o + (base + s * a.hq) * D;
#pragma unroll
      for (int i = 0; i < NV; ++i) acc[i] += wgt * po[lane + 32 * i];
    }
  }
  if (a.sink != nullptr) {
    const float c = fold_sink(m, l, a.sink[h]);
#pragma unroll
    for (int i = 0; i < NV; ++i) acc[i] *= c;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* out = static_cast<T*>(a.out) + row * a.o_s0 + h * a.o_s1;
#pragma unroll
  for (int i = 0; i < NV; ++i) out[lane + 32 * i] = Mma<T>::from_float(acc[i] * inv);
  if (a.lse != nullptr && lane == 0)
    a.lse[row * a.lse_s0 + h] = natural_lse(m, l);
}

// Room for the most entries a CTA takes, so that one attribute serves every launch.
template <typename T, int D>
cudaError_t set_attributes() {
  return attnrt_cuda_common::raise_smem_limit<attend_kernel<T, D>>(
      static_cast<int>(Smem<D>::bytes(kMaxEntries)));
}

template <typename T, int D>
cudaError_t launch_t(const AttendArgs& a, cudaStream_t st) {
  const size_t smem = Smem<D>::bytes(a.R * a.K);
  if (cudaError_t e = set_attributes<T, D>(); e != cudaSuccess) return e;
  const int64_t ctas = static_cast<int64_t>(a.rows) * a.hkv * a.htiles * a.nsplit;
  if (ctas == 0) return cudaSuccess;
  attend_kernel<T, D><<<static_cast<unsigned>(ctas), kThreads, smem, st>>>(a);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (a.nsplit > 1) {
    const int64_t warps = static_cast<int64_t>(a.rows) * a.hq;
    merge_kernel<T, D><<<static_cast<unsigned>((warps + 3) / 4), kThreads, 0, st>>>(a);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace

int attend_load_kernels() {
  using B = __nv_bfloat16;
  using H = __half;
  cudaError_t e = attnrt_cuda_common::load_kernels<
      attend_kernel<B, 64>, attend_kernel<B, 128>, attend_kernel<H, 64>, attend_kernel<H, 128>,
      merge_kernel<B, 64>, merge_kernel<B, 128>, merge_kernel<H, 64>, merge_kernel<H, 128>>();
  if (e == cudaSuccess) e = set_attributes<B, 64>();
  if (e == cudaSuccess) e = set_attributes<B, 128>();
  if (e == cudaSuccess) e = set_attributes<H, 64>();
  if (e == cudaSuccess) e = set_attributes<H, 128>();
  return e;
}

int launch_attend(const AttendArgs& a, int dtype, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (dtype == ATTNRT_BF16)
    return a.D == 64 ? launch_t<__nv_bfloat16, 64>(a, st) : launch_t<__nv_bfloat16, 128>(a, st);
  return a.D == 64 ? launch_t<__half, 64>(a, st) : launch_t<__half, 128>(a, st);
}

}  // namespace attnrt_cuda_sparse
