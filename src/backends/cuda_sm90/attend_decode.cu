// Fused sparse attend for decode (see attend_decode.h): one launch per call, no merge kernel, no
// partials in global memory.
//
// Grid: `parts` CTAs per request, one thread-block cluster; CTA r takes the selection slots
// [r*S, r*S + S), S = 16 / parts. A CTA keeps the slots that are live (in the context, not a
// repeat of an earlier slot) and streams their K and V pages (one page each per block) into
// XOR-swizzled shared memory with cp.async, up to 3 blocks in flight. Each of its 4 warps
// takes 32 keys of every block: S = Q K^T and O = P V on tensor cores (mma.sync m16n8k16; the 16
// mma rows are the 16 query heads, so each K/V row is read once), keys past kv_len masked, P
// rounded to the K/V dtype as the reference does, an online softmax across the blocks. The warps
// merge in shared memory into the CTA's partial (o, log2 lse); a CTA with no live block holds
// (o = 0, lse = -inf). After a cluster barrier, CTA r gathers every partial of heads r, r +
// parts, ... through distributed shared memory in one round of loads, weighs them by their lse,
// folds in the sink and writes out and lse. The launch is a programmatic dependent of the indexer:
// q, lengths and page tables load before the wait, the selections after it.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <attnrt/plugin.h>

#include "attend_decode.h"
#include "cuda_common/grid_dependency.cuh"
#include "cuda_common/kernel_attr.h"
#include "cuda_common/phase_trace.cuh"
#include "decode_block_attend.cuh"
#include "index_decode.h"

namespace attnrt_cuda_sm90 {

// Profiling builds only (cuda_common/phase_trace.cuh): where each CTA is when.
ATTNRT_PHASE_TABLE(sm90_attend_decode,
                   "start,waited,selected,first block,computed,partial,cluster barrier,"
                   "gathered,merge start,written,end")

namespace {

namespace cg = cooperative_groups;
using namespace attnrt_cuda_common;

constexpr int kThreads = kAttendThreads;
constexpr int kStageBytes = 2 * kTileBytes;
static_assert(kPartialScratchBytes + kHeads * kHeadDim * sizeof(float) <= kStageBytes,
              "the warps' merge buffer and the CTA's partial fit in the first stage");

// Blocks in flight per CTA: as many as it has, up to 3 (196 KB with q: one CTA per SM).
__host__ __device__ constexpr int stages_for(int parts) {
  return kTopK / parts < 3 ? kTopK / parts : 3;
}

// A cluster barrier split in two: arrive (releasing this CTA's shared-memory reads and writes to
// the cluster) early, wait (acquiring the peers') only where it matters.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__host__ __device__ constexpr int smem_bytes(int parts) {
  return kQBytes + stages_for(parts) * kStageBytes;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 3) attend_decode_kernel(AttendDecodeArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [16][128]
  unsigned char* stages = smem_raw + kQBytes;
  __shared__ PartialShared s_part;
  __shared__ float s_lse[kHeads];
  __shared__ int s_sel[kTopK], s_blk[kTopK], s_nlive;
  __shared__ int64_t s_page[kTopK];

  const cg::cluster_group cluster = cg::this_cluster();
  const int parts = a.parts, S = kTopK / parts, nst = stages_for(parts);
  const int b = blockIdx.x / parts, part = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  ATTNRT_PHASE(sm90_attend_decode, 0);
  // What the indexer does not write: q, the length and the page table.
  load_q(sQ, static_cast<const T*>(a.q) + static_cast<int64_t>(b) * a.q_s0, a.q_s1);
  const int kv = a.kv_len[b];
  const int nblk = (kv + kBlock - 1) / kBlock;
  const int32_t* pages = a.page_ids + a.page_indptr[b];
  grid_dependency_wait();  // the selections are the indexer's output
  ATTNRT_PHASE(sm90_attend_decode, 1);
  if (tid < kTopK) s_sel[tid] = a.topk[static_cast<int64_t>(b) * a.t_s1 + tid * a.t_s2];
  __syncthreads();
  if (warp == 0) {  // this CTA's live blocks, compacted in slot order, and their pages
    int c = -1;
    bool live = false;
    if (lane < S) {
      const int slot = part * S + lane;
      c = s_sel[slot];
      live = c >= 0 && c < nblk;
      for (int s = 0; s < slot; ++s) live = live && s_sel[s] != c;  // a repeat counts once
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, live);
    if (live) {
      const int at = __popc(ballot & ((1u << lane) - 1u));
      s_blk[at] = c;
      s_page[at] = pages[c];
    }
    if (lane == 0) s_nlive = __popc(ballot);
  }
  __syncthreads();
  const int nlive = s_nlive;
  ATTNRT_PHASE(sm90_attend_decode, 2);

  const T* kc = static_cast<const T*>(a.kc);
  const T* vc = static_cast<const T*>(a.vc);
  auto load = [&](int i) {  // block i's K and V into stage i % nst
    T* sK = reinterpret_cast<T*>(stages + (i % nst) * kStageBytes);
    load_block_kv(sK, sK + kBlock * kHeadDim, kc, vc, s_page[i], a.k_s0, a.k_s1, a.v_s0, a.v_s1,
                  min(kBlock, kv - s_blk[i] * kBlock));
  };
  for (int i = 0; i < nst && i < nlive; ++i) load(i);

  // Online softmax over the live blocks, each warp on its 32 keys of each.
  DecodeWarpState st;
  st.reset();
  for (int i = 0; i < nlive; ++i) {
    switch (min(nst - 1, nlive - 1 - i)) {  // the copies of later blocks that may still run
      case 0: cp_wait<0>(); break;
      case 1: cp_wait<1>(); break;
      default: cp_wait<2>(); break;
    }
    __syncthreads();
    if (i == 0) ATTNRT_PHASE(sm90_attend_decode, 3);
    const T* sK = reinterpret_cast<const T*>(stages + (i % nst) * kStageBytes);
    const T* sV = sK + kBlock * kHeadDim;
    const int j0 = s_blk[i] * kBlock;
    attend_block(st, sQ, sK, sV, j0, min(j0 + kBlock, kv), a.scale_log2);
    __syncthreads();  // the stage is free
    if (i + nst < nlive) load(i + nst);
  }
  cp_wait<0>();  // q's copy, when no block was live
  ATTNRT_PHASE(sm90_attend_decode, 4);

  // The CTA's partial, through the first stage.
  float* red = reinterpret_cast<float*>(stages);
  float* po = red + kPartialScratchBytes / sizeof(float);  // [16][128]
  cta_partial(st, red, s_part, po, s_lse);
  ATTNRT_PHASE(sm90_attend_decode, 5);
  cluster.sync();  // every partial of the request is complete and visible to the cluster

  ATTNRT_PHASE(sm90_attend_decode, 6);

  // CTA `part` finishes heads part, part + parts, ...: S heads x `parts` CTAs = 16 partials,
  // gathered with one round of loads into red's first 8 KB (row k * S + j: CTA k's partial of
  // head part + parts * j), then weighed by their lse.
  __shared__ float s_glse[kTopK];
  float* gath = red;  // [16][128]
  {
    const int row = tid / 8, k = row / S, h = part + parts * (row % S);
    const float4* src =
        reinterpret_cast<const float4*>(cluster.map_shared_rank(po, k) + h * kHeadDim) +
        (tid % 8) * 4;
    float4 v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = src[i];
    if (tid % 8 == 0) s_glse[row] = *cluster.map_shared_rank(&s_lse[h], k);
    float4* dst = reinterpret_cast<float4*>(gath + row * kHeadDim) + (tid % 8) * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = v[i];
  }
  static_assert(kThreads == kTopK * 8, "8 threads gather each of the 16 partial rows");
  ATTNRT_PHASE(sm90_attend_decode, 7);
  cluster_arrive();  // done with the peers' shared memory
  __syncthreads();
  ATTNRT_PHASE(sm90_attend_decode, 8);
  T* out = static_cast<T*>(a.out) + static_cast<int64_t>(b) * a.o_s0;
  // Every shared-memory load below is unconditional: in a cluster kernel, a load under a per-row
  // predicate compiles to its own read of the CTA's cluster id (S2R) and a dependent load, 16 in
  // sequence, which took ~2 us of a ~9 us kernel at batch 1 (globaltimer trace, H100).
  float glse[kTopK];
#pragma unroll
  for (int r = 0; r < kTopK; ++r) glse[r] = s_glse[r];
  for (int idx = tid; idx < S * (kHeadDim / 2); idx += kThreads) {
    const int j = idx / (kHeadDim / 2), h = part + parts * j, d = 2 * (idx % (kHeadDim / 2));
    // Rows r with r % S == j (S a power of two) are head h's partials; all 16 are read so the
    // loads overlap.
    float2 v[kTopK];
#pragma unroll
    for (int r = 0; r < kTopK; ++r)
      v[r] = *reinterpret_cast<const float2*>(gath + r * kHeadDim + d);
    float M = -INFINITY;
#pragma unroll
    for (int r = 0; r < kTopK; ++r) M = (r & (S - 1)) == j ? fmaxf(M, glse[r]) : M;
    float L = 0.f, acc0 = 0.f, acc1 = 0.f;
#pragma unroll
    for (int r = 0; r < kTopK; ++r) {
      const float w = (r & (S - 1)) != j || M == -INFINITY ? 0.f : exp2f(glse[r] - M);
      L += w;
      acc0 += w * v[r].x;
      acc1 += w * v[r].y;
    }
    if (a.sink != nullptr) {
      const float cf = fold_sink(M, L, a.sink[h]);
      acc0 *= cf;
      acc1 *= cf;
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    *reinterpret_cast<uint32_t*>(out + h * a.o_s1 + d) = Mma<T>::pack(acc0 * inv, acc1 * inv);
    if (d == 0 && a.lse != nullptr)
      a.lse[static_cast<int64_t>(b) * a.lse_s0 + h] = natural_lse(M, L);
  }
  ATTNRT_PHASE(sm90_attend_decode, 9);
  cluster_wait();  // no CTA leaves while a peer still reads its shared memory
  ATTNRT_PHASE(sm90_attend_decode, 10);
}

template <typename T>
cudaError_t set_attributes() {
  if (cudaError_t e = raise_smem_limit<attend_decode_kernel<T>>(smem_bytes(1)); e != cudaSuccess)
    return e;
  // Clusters of 16 CTAs: past the portable 8, which Hopper allows on request.
  return set_attribute_once<attend_decode_kernel<T>,
                            cudaFuncAttributeNonPortableClusterSizeAllowed>(1);
}

cudaLaunchConfig_t launch_config(int n, int parts, cudaStream_t st, cudaLaunchAttribute* attrs) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(n * parts));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem_bytes(parts));
  cfg.stream = st;
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = static_cast<unsigned>(parts);
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = 2;
  return cfg;
}

template <typename T>
cudaError_t launch_t(const AttendDecodeArgs& a, cudaStream_t st) {
  if (cudaError_t e = set_attributes<T>(); e != cudaSuccess) return e;
  if (a.n <= 0) return cudaSuccess;
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t cfg = launch_config(a.n, a.parts, st, attrs);
  return cudaLaunchKernelEx(&cfg, attend_decode_kernel<T>, a);
}

}  // namespace

int attend_decode_load_kernels() {
  cudaError_t e = attnrt_cuda_common::load_kernels<attend_decode_kernel<__nv_bfloat16>,
                                                   attend_decode_kernel<__half>>();
  if (e == cudaSuccess) e = set_attributes<__nv_bfloat16>();
  if (e == cudaSuccess) e = set_attributes<__half>();
  return e;
}

int attend_decode_parts(int n, int sms, int* parts) {
  using K = __nv_bfloat16;  // both dtypes' kernels use the same resources
  if (cudaError_t e = set_attributes<K>(); e != cudaSuccess) return e;
  n = n > 0 ? n : 1;
  if (n * kTopK <= 3 * sms) {  // one wave of one-block CTAs, 3 per multiprocessor
    cudaLaunchAttribute attrs[2];
    const cudaLaunchConfig_t cfg = launch_config(n, kTopK, nullptr, attrs);
    int clusters = 0;
    if (cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, attend_decode_kernel<K>, &cfg);
        e != cudaSuccess)
      return e;
    if (clusters > 0) {
      *parts = kTopK;
      return cudaSuccess;
    }
  }
  int p = kTopK / 2;
  while (p > 1 && n * p > sms) p /= 2;
  *parts = p;
  return cudaSuccess;
}

int launch_attend_decode(const AttendDecodeArgs& a, int dtype, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dtype == ATTNRT_BF16 ? launch_t<__nv_bfloat16>(a, st) : launch_t<__half>(a, st);
}

}  // namespace attnrt_cuda_sm90
