// MiniMax indexer for extend (prefill) on sm_90 (cuda_sm90 plugin): production shape only, as
// index_decode.h. Two launches: block scores of 128-token tiles on tensor cores, then the top-16
// of every token.
#pragma once

#include <cstdint>

#include "index_decode.h"

namespace attnrt_cuda_sm90 {

constexpr int kIndexTileRows = 128;   // query tokens per score tile
constexpr int kIndexItemBlocks = 16;  // key blocks per work item (the plan's split)

// Score work item: request b, its first local token t0 of a tile, key blocks [c0, c1).
struct IndexExtendItem {
  int32_t b, t0, c0, c1;
};

// Extend: scores hold request b's [q_len, nblk] matrix at score_base[b].
struct IndexExtendArgs : IndexArgsBase {
  const int32_t* q_len;       // [n]
  const int64_t* q_indptr;    // [n + 1]
  const int64_t* score_base;  // [n]
  const int32_t* row_req;     // [T]: request of each token
  const IndexExtendItem* items;
  int num_items;
  int64_t total_tokens;
};

// Loads both kernels of both dtypes on the current device and sets their attributes, once per
// device (cuda_common/kernel_attr.h). Returns a cudaError_t as int.
int index_extend_load_kernels();
// Launches both kernels on `stream`; returns a cudaError_t as int. dtype: ATTNRT_BF16 or F16.
int launch_index_extend(const IndexExtendArgs& a, int dtype, void* stream);

}  // namespace attnrt_cuda_sm90
