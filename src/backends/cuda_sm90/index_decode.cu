// Fused decode indexer for the cuda_sm90 plugin (see index_decode.h).
//
// One launch does the whole op. Grid: ctas_per_request CTAs per request, each scoring a range of
// blocks_per_cta blocks (the plan sizes them so the grid is one wave of resident CTAs; with more
// than one CTA per request the launch is cooperative, so that holds). A block is one page, 32 KB
// contiguous, so a single Hopper bulk copy (cp.async.bulk, completion counted by an mbarrier)
// brings it into shared memory; two stages keep the next page in flight while the 4 warps score
// the current one (8 threads per key row, 16 dims each, shuffle-reduced; the block's max over keys
// j < kv_len). Top-16: the request's CTAs meet at a barrier, each ranks its own blocks against all
// of the request's scores (ties to the lowest ids, forced init/local blocks, NaN -> -1e30) and
// writes those of rank < 16 to their slot; the last CTA to finish puts the 16 slots in ascending
// id order. Padding is -1. That last CTA also sets the request's counters back to zero (every
// CTA has passed the barrier by then), so the next launch, or a captured graph's replay, starts
// from zero.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <climits>
#include <cstdint>

#include <attnrt/plugin.h>

#include "cuda_common/block_topk.cuh"
#include "cuda_common/grid_dependency.cuh"
#include "cuda_common/kernel_attr.h"
#include "cuda_common/mbarrier.cuh"
#include "cuda_common/mma_sm80.cuh"
#include "cuda_common/phase_trace.cuh"
#include "index_decode.h"

namespace attnrt_cuda_sm90 {

// Profiling builds only (cuda_common/phase_trace.cuh): where each CTA is when.
ATTNRT_PHASE_TABLE(sm90_index_decode, "start,first page,scored,barrier passed,ranked,sorted")

namespace {

constexpr int kThreads = 128;
constexpr int kStages = 2;
constexpr int kPageBytes = kBlock * kDim * 2;
static_assert(kStages * kPageBytes >= kMaxBlocks * 4, "a request's block keys reuse the stages");
using attnrt_cuda_common::raise_smem_limit;
using attnrt_cuda_common::set_attribute_once;
using attnrt_cuda_common::smem_u32;
using attnrt_cuda_common::bar_expect_tx;
using attnrt_cuda_common::bar_init;
using attnrt_cuda_common::bar_init_fence;
using attnrt_cuda_common::bar_wait;
using attnrt_cuda_common::bulk_load;
using attnrt_cuda_common::grid_launch_dependents;

__device__ __forceinline__ float2 to_float2(uint32_t x, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
}
__device__ __forceinline__ float2 to_float2(uint32_t x, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&x));
}

__device__ __forceinline__ void red_release_add(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Dot product of 8 16-bit values with 8 floats.
template <typename T>
__device__ __forceinline__ float dot8(uint4 v, const float* q) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = to_float2(w[i], T{});
    acc = fmaf(f.x, q[2 * i], acc);
    acc = fmaf(f.y, q[2 * i + 1], acc);
  }
  return acc;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) index_decode_kernel(IndexDecodeArgs a) {
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ __align__(8) uint64_t bars[kStages];
  __shared__ float red[2][kThreads / 32];
  __shared__ int s_last;

  ATTNRT_PHASE(sm90_index_decode, 0);
  grid_launch_dependents();  // the attend's CTAs may start (and load q) while this one runs
  const int b = blockIdx.x / a.ctas_per_request;
  const int part = blockIdx.x % a.ctas_per_request;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kv = a.kv_len[b];
  const int nblk = (kv + kBlock - 1) / kBlock;
  const int c0 = part * a.blocks_per_cta;
  const int c1 = min(c0 + a.blocks_per_cta, nblk);
  const int32_t* pages = a.page_ids + a.page_indptr[b];
  const T* kc = static_cast<const T*>(a.kc);

  // Thread 0 issues the copies; it reads each page id one block ahead of its copy, so it never
  // waits on one.
  auto issue = [&](int s, int64_t page) {
    bar_expect_tx(&bars[s], kPageBytes);
    bulk_load(stages + s * kPageBytes, kc + page * a.k_s0, kPageBytes, &bars[s]);
  };
  int64_t next_page = 0;  // thread 0: the page of the next block to issue
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) bar_init(&bars[s], 1);
    bar_init_fence();
    int64_t first[kStages];
    for (int s = 0; s < kStages; ++s) first[s] = c0 + s < c1 ? pages[c0 + s] : 0;
    if (c0 + kStages < c1) next_page = pages[c0 + kStages];
    for (int s = 0; s < kStages && c0 + s < c1; ++s) issue(s, first[s]);
  }
  __syncthreads();

  // This thread's 16 query dims: [8*sub, 8*sub+8) and [64+8*sub, 64+8*sub+8).
  const int sub = tid & 7;
  float q[16];
  {
    const uint4* qrow = reinterpret_cast<const uint4*>(static_cast<const T*>(a.q) +
                                                       static_cast<int64_t>(b) * a.q_s0);
    const uint4 lo = qrow[sub], hi = qrow[8 + sub];
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = to_float2(w[i], T{});
      q[2 * i] = f.x;
      q[2 * i + 1] = f.y;
    }
  }

  for (int c = c0; c < c1; ++c) {
    const int i = c - c0, s = i % kStages;
    bar_wait(&bars[s], (i / kStages) & 1);
    if (i == 0) ATTNRT_PHASE(sm90_index_decode, 1);
    const unsigned char* page = stages + s * kPageBytes;
    float m = -INFINITY;
#pragma unroll 4
    for (int it = 0; it < kBlock / 16; ++it) {
      const int tok = it * 16 + (tid >> 3);
      const uint4* row = reinterpret_cast<const uint4*>(page + tok * kDim * 2);
      float d = dot8<T>(row[sub], q) + dot8<T>(row[8 + sub], q + 8);
      d += __shfl_xor_sync(0xffffffffu, d, 1);
      d += __shfl_xor_sync(0xffffffffu, d, 2);
      d += __shfl_xor_sync(0xffffffffu, d, 4);
      if (c * kBlock + tok < kv) m = fmaxf(m, d);
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
    if (lane == 0) red[i & 1][warp] = m;
    __syncthreads();  // stage s fully read, red[i & 1] complete
    if (tid == 0) {
      if (c + kStages < c1) {
        issue(s, next_page);
        if (c + kStages + 1 < c1) next_page = pages[c + kStages + 1];
      }
      float bm = red[i & 1][0];
#pragma unroll
      for (int w = 1; w < kThreads / 32; ++w) bm = fmaxf(bm, red[i & 1][w]);
      a.scores[static_cast<int64_t>(b) * a.block_capacity + c] = bm * a.scale;
    }
  }

  ATTNRT_PHASE(sm90_index_decode, 2);
  // Selection. Every block is taken when there are at most 16: no CTA waits for another.
  const int nvis = nblk;  // decode: the query sits at kv_len - 1
  const int keff = min(kTopK, nvis);
  int32_t* out = a.topk + static_cast<int64_t>(b) * a.t_s1;
  if (part == 0)
    for (int k = keff + tid; k < kTopK; k += kThreads) out[k * a.t_s2] = -1;
  if (nvis <= kTopK) {
    for (int c = c0 + tid; c < c1; c += kThreads) out[c * a.t_s2] = c;
    return;
  }
  // Otherwise the request's CTAs meet at a barrier (they are co-resident: a cooperative launch),
  // each ranks its own blocks against all of the request's block scores and writes every block
  // of rank < 16 to slot `rank`; the last CTA to finish that puts the 16 slots in id order.
  // The serial part is a few memory round trips, not a select over every block in one CTA.
  uint32_t* sync = a.sync + 2 * b;  // [arrivals, rankers done]
  if (tid == 0) {
    // Arrive with release semantics (this CTA's scores go first), then poll with acquire (the
    // peers' scores come after) until every CTA of the request has arrived: one memory round
    // trip after the last arrival, no generation to flip. Polled gently: up to a few hundred
    // threads of the grid spin while others still stream.
    red_release_add(&sync[0], 1u);
    while (ld_acquire(&sync[0]) < static_cast<uint32_t>(a.ctas_per_request)) __nanosleep(20);
  }
  __syncthreads();
  ATTNRT_PHASE(sm90_index_decode, 3);
  uint32_t* keys = reinterpret_cast<uint32_t*>(stages);  // every bulk copy has completed
  const float* src = a.scores + static_cast<int64_t>(b) * a.block_capacity;
  const int init_b = a.init_blocks, local_from = nvis - a.local_blocks;
  const int padded = (nvis + 255) & ~255;  // key 0 is below every real key: padding never ranks
  for (int c = tid; c < padded; c += kThreads)
    keys[c] = c < nvis ? attnrt_cuda_common::block_score_key(__ldcg(src + c), c, init_b, local_from)
                       : 0u;
  __syncthreads();
  // rank(c) = how many blocks precede c in the order (key descending, then id ascending); one
  // warp per block, 256 rivals a step (8 a lane: the step is a latency chain, so wide), stopping
  // once 16 precede it.
  for (int c = c0 + warp; c < c1; c += kThreads / 32) {
    const uint32_t kc = keys[c];
    int rank = 0;
    for (int r0 = 0; r0 < nvis && rank < keff; r0 += 256) {
      const int r = r0 + 4 * lane;
      const uint4 k4[2] = {*reinterpret_cast<const uint4*>(keys + r),
                           *reinterpret_cast<const uint4*>(keys + r + 128)};
      int before = 0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rh = r + 128 * h;
        before += (k4[h].x > kc || (k4[h].x == kc && rh < c)) +
                  (k4[h].y > kc || (k4[h].y == kc && rh + 1 < c)) +
                  (k4[h].z > kc || (k4[h].z == kc && rh + 2 < c)) +
                  (k4[h].w > kc || (k4[h].w == kc && rh + 3 < c));
      }
      rank += static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(before)));
    }
    if (rank < keff && lane == 0) {
      out[rank * a.t_s2] = c;
      __threadfence();  // before this CTA counts itself done
    }
  }
  __syncthreads();
  ATTNRT_PHASE(sm90_index_decode, 4);
  if (tid == 0) {
    __threadfence();
    s_last = atomicAdd(&sync[1], 1u) == static_cast<uint32_t>(a.ctas_per_request) - 1;
  }
  __syncthreads();
  if (!s_last || warp != 0) return;
  __threadfence();
  if (lane == 0) {  // every CTA is past the barrier: ready for the next launch (graph replay)
    sync[0] = 0;
    sync[1] = 0;
  }
  // Slot k holds the block of rank k; its place in id order is how many selected ids are smaller.
  const int id = lane < keff ? __ldcg(out + lane * a.t_s2) : INT_MAX;
  int at = 0;
#pragma unroll
  for (int k = 0; k < kTopK; ++k) at += __shfl_sync(0xffffffffu, id, k) < id;
  __syncwarp();
  if (lane < keff) out[at * a.t_s2] = id;
  ATTNRT_PHASE(sm90_index_decode, 5);
}

template <typename T>
cudaError_t launch_t(const IndexDecodeArgs& a, cudaStream_t st) {
  const int smem = kStages * kPageBytes;
  if (cudaError_t e = raise_smem_limit<index_decode_kernel<T>>(smem); e != cudaSuccess) return e;
  // All of shared memory as such (no L1 carve-out; the kernel reads through bulk copies): the
  // SMs are then configured so that the attend, launched as a programmatic dependent, fits
  // beside this kernel's CTAs and loads its queries while the scoring runs.
  if (cudaError_t e = set_attribute_once<index_decode_kernel<T>,
                                         cudaFuncAttributePreferredSharedMemoryCarveout>(
          cudaSharedmemCarveoutMaxShared);
      e != cudaSuccess)
    return e;
  const int64_t grid = static_cast<int64_t>(a.n) * a.ctas_per_request;
  if (grid <= 0) return cudaSuccess;
  // Cooperative when a request has several CTAs: the launch fails rather than leave a CTA
  // waiting at the barrier for a peer that cannot become resident. One CTA per request waits for
  // nobody, so a batch larger than one wave launches plainly.
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = a.ctas_per_request > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, index_decode_kernel<T>, a);
}

}  // namespace

int index_decode_smem_bytes() { return kStages * kPageBytes; }

int index_decode_resident_ctas(int sms, int* ctas) {
  using K = __nv_bfloat16;  // both dtypes' kernels use the same resources
  const int smem = kStages * kPageBytes;
  if (cudaError_t e = raise_smem_limit<index_decode_kernel<K>>(smem); e != cudaSuccess) return e;
  int per_sm = 0;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, index_decode_kernel<K>,
                                                                    kThreads, smem);
      e != cudaSuccess)
    return e;
  *ctas = per_sm * sms;
  return cudaSuccess;
}

int launch_index_decode(const IndexDecodeArgs& a, int dtype, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dtype == ATTNRT_BF16 ? launch_t<__nv_bfloat16>(a, st) : launch_t<__half>(a, st);
}

}  // namespace attnrt_cuda_sm90
