// Kernel arguments of the CUDA plugin's dense ops, shared by the mma.sync kernels (dense_mma.cu)
// and the Hopper extend kernel (dense_wgmma.cu): the run's tensors plus the plan's device
// metadata, and the device steps both extend kernels share (key -> page, writing a finished row).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_common/attend_tensors.h"
#include "cuda_common/mma_sm80.cuh"
#include "cuda_common/softmax_state.cuh"

namespace attnrt_cuda_dense {

struct Args : attnrt_cuda_common::AttendTensors {
  int hq, group, page_size, page_shift;  // page_shift: log2(page_size), or -1
  float scale_log2;
  // Device metadata of the plan.
  const int32_t* kv_len;
  const int32_t* q_len;
  const int32_t* q_start;  // first packed token of each request
  const int32_t* page_indptr;
  const int32_t* page_ids;
  const int2* tiles;  // extend: (request, first query row of the tile), longest first
  int num_tiles, section_heads;  // extend: block order, see extend_block()
  int splits, head_chunks;  // decode
  float* part_o;
  float* part_lse;
};

// Extend: the query tile and head of this CTA. Blocks go section by section, a section being
// section_heads query heads (whole KV groups, chosen in the plan so that their K/V fits in L2);
// within a section, tile-major with the longest tiles first, head fastest. So the CTAs resident
// at a time read the K/V of a few heads, which L2 then serves.
__device__ __forceinline__ int2 extend_block(const Args& a, int& h) {
  const int per_section = a.num_tiles * a.section_heads;
  const int sec = blockIdx.x / per_section, r = blockIdx.x - sec * per_section;
  h = sec * a.section_heads + r % a.section_heads;
  return a.tiles[r / a.section_heads];
}

// Page-table index and row within the page of key j (shift when the page size is a power of 2).
__device__ __forceinline__ void key_page(const Args& a, int j, int& pg, int& row) {
  if (a.page_shift >= 0) {
    pg = j >> a.page_shift;
    row = j & (a.page_size - 1);
  } else {
    pg = j / a.page_size;
    row = j - pg * a.page_size;
  }
}

// Writes one finished query row of an extend tile (packed token `tok`, query head h) from this
// thread's share of it: column pairs (8 i + 2 t4, + 1) for i < kPairs, pair(i) giving the two
// unnormalised values. O / l with the sink folded in (0 for a row that saw no key), and the
// natural-log lse, written by the quad's first thread.
template <typename T, int kPairs, typename Pair>
__device__ __forceinline__ void store_extend_row(const Args& a, int64_t tok, int h, int t4, float m,
                                                 float l, Pair pair) {
  const float c = a.sink != nullptr ? attnrt_cuda_common::fold_sink(m, l, a.sink[h]) : 1.f;
  const float inv = l > 0.f ? c / l : 0.f;
  T* orow = static_cast<T*>(a.out) + tok * a.o_s0 + h * a.o_s1 + 2 * t4;
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const float2 v = pair(i);
    *reinterpret_cast<uint32_t*>(orow + i * 8) =
        attnrt_cuda_common::Mma<T>::pack(v.x * inv, v.y * inv);
  }
  if (a.lse != nullptr && t4 == 0)
    a.lse[tok * a.lse_s0 + h] = attnrt_cuda_common::natural_lse(m, l);
}

// Extent of one paged cache tensor ([pages, page_size, kv_heads, D]) beyond what Args holds.
struct CacheExtent {
  int64_t pages;
  int64_t kv_heads;
};

// Hopper (sm_90a) dense_extend for head_dim 128: warpgroup MMA (wgmma) from shared memory, 128
// query rows x 128 keys per step. Launches on `st`; the tiles of the plan are 128 query rows.
// Grid: a.num_tiles x a.hq blocks in the order of extend_block(). K/V tiles arrive by
// tensor-memory copies when the page size and the caches' strides allow (k, v: the caches'
// extents), else by cp.async.
template <typename T>
cudaError_t launch_extend_wgmma(const Args& a, const CacheExtent& k, const CacheExtent& v,
                                cudaStream_t st);
// Loads the four instances (both dtypes, both K/V paths) on the current device and sets their
// attributes, once per device (sm_90a: compute capability 9.0 only).
cudaError_t load_extend_wgmma_kernels();
constexpr int kWgmmaTileRows = 128;

}  // namespace attnrt_cuda_dense
