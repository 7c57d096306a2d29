// Sparse attend for extend on sm_90 (see attend_extend.h).
//
// One CTA of 4 warps per query token. The token's selection (repeats and -1 dropped, blocks
// wholly past its position skipped) is cut into chunks of 64 keys that stream through a 3-stage
// cp.async pipeline of K and V tiles (XOR-swizzled; rows past the position zero-filled). Each
// warp takes 16 keys of every chunk: S = Q K^T and O += P V on tensor cores (mma.sync m16n8k16,
// the 16 query heads as the mma rows, so each K/V row is read once), online softmax in the log2
// domain, P rounded to the K/V dtype as the reference does. The 4 warps' (m, l, o) merge through
// shared memory at the end; the sink logit folds in there and out and lse are written directly.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <attnrt/plugin.h>

#include "attend_decode.h"
#include "attend_extend.h"
#include "cuda_common/mma_sm80.cuh"
#include "index_decode.h"

namespace attnrt_cuda_sm90 {
namespace {

using namespace attnrt_cuda_common;

constexpr int kThreads = 128;
constexpr int kStages = 3;
constexpr int kChunkKeys = 64;  // 16 per warp
constexpr int kMaxChunks = kTopK * (kBlock / kChunkKeys);
constexpr int kDT = kHeadDim / 8;   // O n-tiles
constexpr int kDK = kHeadDim / 16;  // QK k-steps
constexpr int kKV = kChunkKeys * kHeadDim;  // elements of one K (or V) chunk
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2e = 1.4426950408889634f;
constexpr size_t kSmemElems = static_cast<size_t>(kHeads) * kHeadDim + kStages * 2 * kKV;
static_assert(4 * kHeads * kHeadDim * 4 <= kStages * 2 * kKV * 2, "merge buffer fits the stages");

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) attend_extend_kernel(AttendExtendArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [16][128]
  T* stages = sQ + kHeads * kHeadDim;      // kStages x (K [64][128], V [64][128])
  __shared__ int s_chunk[kMaxChunks];      // first key of each chunk
  __shared__ int64_t s_page[kMaxChunks];   // element offset of its page
  __shared__ int s_nchunks;
  __shared__ float s_m[4][kHeads], s_l[4][kHeads];

  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int b = a.row_req[row], pos = a.row_pos[row];
  const T* kc = static_cast<const T*>(a.kc);
  const T* vc = static_cast<const T*>(a.vc);

  if (tid < 32) {
    // Warp 0 builds the chunk list in selection order: lane k looks at slot k.
    const int c = lane < kTopK ? a.topk[row * a.t_s1 + lane * a.t_s2] : -1;
    bool live = c >= 0 && static_cast<int64_t>(c) * kBlock <= pos;
    for (int s = 0; s < kTopK; ++s) {  // a repeated id counts once
      const int cs = __shfl_sync(0xffffffffu, c, s);
      live = live && !(s < lane && cs == c);
    }
    const int nch =
        live ? (min(kBlock, pos + 1 - c * kBlock) + kChunkKeys - 1) / kChunkKeys : 0;
    int at = nch;  // inclusive prefix of chunk counts
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, at, o);
      if (lane >= o) at += y;
    }
    if (live) {
      const int64_t page = static_cast<int64_t>(a.page_ids[a.page_indptr[b] + c]);
      for (int h = 0; h < nch; ++h) {
        s_chunk[at - nch + h] = c * kBlock + h * kChunkKeys;
        s_page[at - nch + h] = page;
      }
    }
    if (lane == 31) s_nchunks = at;
  }
  {
    const T* q = static_cast<const T*>(a.q) + row * a.q_s0;
    for (int i = tid; i < kHeads * kDT; i += kThreads) {
      const int r = i / kDT, ch = i % kDT;
      cp_async16(smem_u32(sQ + swz<kHeadDim>(r, ch * 8)), q + r * a.q_s1 + ch * 8, true);
    }
  }
  __syncthreads();
  const int nchunks = s_nchunks;
  auto load_chunk = [&](int i) {
    T* sk = stages + (i % kStages) * 2 * kKV;
    T* sv = sk + kKV;
    const int j0 = s_chunk[i];
    const int64_t page = s_page[i];
    const int r0 = j0 % kBlock;
    const T* kp = kc + page * a.k_s0 + r0 * a.k_s1;
    const T* vp = vc + page * a.v_s0 + r0 * a.v_s1;
#pragma unroll
    for (int it = 0; it < kChunkKeys * kDT / kThreads; ++it) {
      const int idx = it * kThreads + tid, r = idx / kDT, ch = idx % kDT;
      const bool valid = j0 + r <= pos;
      cp_async16(smem_u32(sk + swz<kHeadDim>(r, ch * 8)), valid ? kp + r * a.k_s1 + ch * 8 : kp,
                 valid);
      cp_async16(smem_u32(sv + swz<kHeadDim>(r, ch * 8)), valid ? vp + r * a.v_s1 + ch * 8 : vp,
                 valid);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nchunks) load_chunk(s);
    cp_commit();  // the first group also carries Q
  }

  float o[kDT][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows g and g + 8
  uint32_t qa[kDK][4];
  for (int i = 0; i < nchunks; ++i) {
    cp_wait<kStages - 2>();
    __syncthreads();  // chunk i landed; every warp is done with the stage refilled below
    if (i + kStages - 1 < nchunks) load_chunk(i + kStages - 1);
    cp_commit();
    if (i == 0) {
#pragma unroll
      for (int kk = 0; kk < kDK; ++kk)
        ldsm_x4(qa[kk], smem_u32(sQ + swz<kHeadDim>(lane & 15, kk * 16 + (lane >> 4) * 8)));
    }
    const T* sk = stages + (i % kStages) * 2 * kKV;
    const T* sv = sk + kKV;
    const int wkey = warp * 16;
    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kDK; ++kk) {
      uint32_t bf[4];
      const int key = wkey + (lane >> 4) * 8 + (lane & 7);
      ldsm_x4(bf, smem_u32(sk + swz<kHeadDim>(key, kk * 16 + ((lane >> 3) & 1) * 8)));
      Mma<T>::run(s[0], qa[kk], bf[0], bf[1]);
      Mma<T>::run(s[1], qa[kk], bf[2], bf[3]);
    }
    const int j0 = s_chunk[i] + wkey;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const int j = j0 + n * 8 + 2 * t4 + (e & 1);
          s[n][e] = j <= pos ? s[n][e] * a.scale_log2 : -INFINITY;
          mx = fmaxf(mx, s[n][e]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == -INFINITY ? 0.f : mx;
      const float corr = fast_exp2(m[r] - base);  // m = -inf: 0 (nothing accumulated yet)
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          s[n][e] = fast_exp2(s[n][e] - base);
          sum += s[n][e];
        }
      l[r] = l[r] * corr + sum;  // this lane's share; reduced over the quad at the end
      m[r] = mx;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        o[dt][2 * r] *= corr;
        o[dt][2 * r + 1] *= corr;
      }
    }
    uint32_t pf[4];
    pf[0] = Mma<T>::pack(s[0][0], s[0][1]);
    pf[1] = Mma<T>::pack(s[0][2], s[0][3]);
    pf[2] = Mma<T>::pack(s[1][0], s[1][1]);
    pf[3] = Mma<T>::pack(s[1][2], s[1][3]);
    const int vkey = wkey + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
    for (int dp = 0; dp < kDT / 2; ++dp) {
      uint32_t bf[4];
      ldsm_x4_t(bf, smem_u32(sv + swz<kHeadDim>(vkey, dp * 16 + (lane >> 4) * 8)));
      Mma<T>::run(o[2 * dp], pf, bf[0], bf[1]);
      Mma<T>::run(o[2 * dp + 1], pf, bf[2], bf[3]);
    }
  }

  // Merge the 4 warps (same rows, different keys) through shared memory.
  cp_wait<0>();
  __syncthreads();
  float* red = reinterpret_cast<float*>(stages);  // [4][16][128]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    if (t4 == 0) {
      s_m[warp][g + 8 * r] = m[r];
      s_l[warp][g + 8 * r] = l[r];
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = g + 8 * r;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) M = fmaxf(M, s_m[w][h]);
    const float f = m[r] == -INFINITY ? 0.f : exp2f(m[r] - M);
    float* dst = red + (warp * kHeads + h) * kHeadDim + 2 * t4;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      dst[dt * 8] = o[dt][2 * r] * f;
      dst[dt * 8 + 1] = o[dt][2 * r + 1] * f;
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(a.out) + row * a.o_s0;
  for (int idx = tid; idx < kHeads * kHeadDim / 4; idx += kThreads) {
    const int h = idx / (kHeadDim / 4), d = (idx % (kHeadDim / 4)) * 4;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) M = fmaxf(M, s_m[w][h]);
    float L = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        L += s_l[w][h] * exp2f(s_m[w][h] - M);
        const float4 v = *reinterpret_cast<const float4*>(red + (w * kHeads + h) * kHeadDim + d);
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
    }
    if (a.sink != nullptr) {
      const float s2 = a.sink[h] * kLog2e;
      const float mn = fmaxf(M, s2);
      const float cf = M == -INFINITY ? 0.f : exp2f(M - mn);
      acc.x *= cf;
      acc.y *= cf;
      acc.z *= cf;
      acc.w *= cf;
      L = L * cf + exp2f(s2 - mn);
      M = mn;
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    uint2 packed;
    packed.x = Mma<T>::pack(acc.x * inv, acc.y * inv);
    packed.y = Mma<T>::pack(acc.z * inv, acc.w * inv);
    *reinterpret_cast<uint2*>(out + h * a.o_s1 + d) = packed;
    if (a.lse != nullptr && d == 0)
      a.lse[row * a.lse_s0 + h] = L > 0.f ? (M + log2f(L)) * kLn2 : -INFINITY;
  }
}

template <typename T>
cudaError_t launch_t(const AttendExtendArgs& a, cudaStream_t st) {
  const int smem = static_cast<int>(kSmemElems * sizeof(T));
  if (cudaError_t e = cudaFuncSetAttribute(attend_extend_kernel<T>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      e != cudaSuccess)
    return e;
  if (a.rows > 0)
    attend_extend_kernel<T><<<static_cast<unsigned>(a.rows), kThreads, smem, st>>>(a);
  return cudaGetLastError();
}

}  // namespace

int launch_attend_extend(const AttendExtendArgs& a, int dtype, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dtype == ATTNRT_BF16 ? launch_t<__nv_bfloat16>(a, st) : launch_t<__half>(a, st);
}

}  // namespace attnrt_cuda_sm90
