// Sparse attend for extend (prefill) on sm_90 (cuda_sm90 plugin): production shape only, as
// attend_decode.h; each query token attends to the keys j <= pos of its own selected blocks.
//
// Block-major: the tokens that selected a block are gathered, so each selected K/V block is
// read once per 32 such tokens instead of once per token. A run processes the rows in chunks of
// at most kExtendChunkRows tokens (bounding the partials buffer) with four launches per chunk:
// bucket (token slots by block), item list, attend per (block, 32 tokens) writing one normalised
// partial per (token, slot), and merge per token by lse with the sink.
#pragma once

#include <cstdint>

#include "cuda_common/attend_tensors.h"

namespace attnrt_cuda_sm90 {

constexpr int kExtendChunkRows = 4096;  // tokens per pass
constexpr int kItemTokens = 32;         // tokens per attend CTA

// Attend work item: request b, block c, entries [start, start + count) of the block's list.
struct AttendExtendItem {
  int32_t b, c, start, count;
};

// Tensors: q and out [T, 16, 128], caches [pages, 128, 1, 128], lse [T, 16], sink [16],
// topk [1, T, 16].
struct AttendExtendArgs : attnrt_cuda_common::AttendTensors {
  const int32_t* row_req;  // [T]: request of each token
  const int32_t* row_pos;  // [T]: absolute position of each token in its request
  const int32_t* kv_len;   // [n]
  const int32_t* page_indptr;
  const int32_t* page_ids;
  const int32_t* blk_base;    // [n]: first global block id of request b
  const int32_t* blk_req;     // [total_blocks]: request of each global block
  const int64_t* entry_base;  // [n]: offset of request b's per-block entry lists
  const int32_t* entry_cap;   // [n]: capacity of each of request b's lists
  int32_t* counts;            // [total_blocks + 1]: list lengths, then the item count
  int32_t* entries;           // token slots (row - r0) * 16 + k
  AttendExtendItem* items;    // [max_items]
  void* part_o;               // [chunk rows, 16 slots, 16 heads, 128], the q dtype
  float* part_lse;            // [chunk rows, 16 slots, 16 heads] (log2 domain)
  int64_t rows;
  int total_blocks;
  float scale_log2;  // sm_scale * log2(e)
};

// Upper bound of the work items of one chunk of `rows` tokens over `total_blocks` blocks.
inline int64_t attend_extend_max_items(int64_t rows, int total_blocks) {
  return rows * 16 / kItemTokens + total_blocks;
}

// Loads the four kernels (both dtypes) on the current device and sets their attributes, once per
// device (cuda_common/kernel_attr.h). Returns a cudaError_t as int.
int attend_extend_load_kernels();
int launch_attend_extend(const AttendExtendArgs& a, int dtype, void* stream);

}  // namespace attnrt_cuda_sm90
