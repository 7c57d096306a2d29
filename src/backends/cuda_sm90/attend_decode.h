// Fused sparse attend for decode on sm_90 (cuda_sm90 plugin): production shape only, 16 query
// heads sharing one KV head, head_dim 128, block = page = 128, top-16 from one index head.
#pragma once

#include <cstdint>

#include "cuda_common/attend_tensors.h"

namespace attnrt_cuda_sm90 {

constexpr int kHeads = 16;   // query heads (one KV head)
constexpr int kHeadDim = 128;

// Tensors: q and out [n, 16, 128], caches [pages, 128, 1, 128], lse [n, 16], sink [16],
// topk [1, n, 16].
struct AttendDecodeArgs : attnrt_cuda_common::AttendTensors {
  const int32_t* kv_len;
  const int32_t* page_indptr;
  const int32_t* page_ids;
  float* part_o;     // [n, 16 slots, 16 heads, 128]
  float* part_lse;   // [n, 16 slots, 16 heads] (log2 domain)
  int32_t* counters;  // [n], zero between launches
  int n;
  float scale_log2;  // sm_scale * log2(e)
};

int launch_attend_decode(const AttendDecodeArgs& a, int dtype, void* stream);

}  // namespace attnrt_cuda_sm90
