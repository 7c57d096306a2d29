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
  int n;
  int parts;         // CTAs per request (one thread-block cluster): 1, 2, 4, 8 or 16
  float scale_log2;  // sm_scale * log2(e)
};

// Loads the kernel of both dtypes on the current device and sets its attributes, once per
// device (cuda_common/kernel_attr.h). Returns a cudaError_t as int.
int attend_decode_load_kernels();

// The CTAs per request for a batch of n on the current device (`sms` multiprocessors): 16 (one
// selected block each) while the batch fits one wave of them, else the largest power of two that
// keeps one wave of one CTA per multiprocessor. Returns a cudaError_t as int.
int attend_decode_parts(int n, int sms, int* parts);

// Launches on `stream` as a programmatic dependent of the kernel before it (the indexer), so its
// CTAs start, and load q, while that kernel finishes. Returns a cudaError_t as int.
int launch_attend_decode(const AttendDecodeArgs& a, int dtype, void* stream);

}  // namespace attnrt_cuda_sm90
