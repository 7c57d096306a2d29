// Sparse attend for extend (prefill) on sm_90 (cuda_sm90 plugin): production shape only, as
// attend_decode.h; each query token attends to the keys j <= pos of its own selected blocks.
#pragma once

#include <cstdint>

#include "cuda_common/attend_tensors.h"

namespace attnrt_cuda_sm90 {

// Tensors: q and out [T, 16, 128], caches [pages, 128, 1, 128], lse [T, 16], sink [16],
// topk [1, T, 16].
struct AttendExtendArgs : attnrt_cuda_common::AttendTensors {
  const int32_t* row_req;  // [T]: request of each token
  const int32_t* row_pos;  // [T]: absolute position of each token in its request
  const int32_t* page_indptr;
  const int32_t* page_ids;
  int64_t rows;
  float scale_log2;  // sm_scale * log2(e)
};

int launch_attend_extend(const AttendExtendArgs& a, int dtype, void* stream);

}  // namespace attnrt_cuda_sm90
