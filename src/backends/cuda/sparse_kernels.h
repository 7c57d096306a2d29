// CUDA MiniMax sparse ops (spec/minimax-sparse.md §3-§5) for the CUDA plugin: the block indexer
// (sparse_index_extend/decode), sparse attend (sparse_attend_extend/decode) and sparse_decode
// (the two decode ops in sequence).
//
// cuda_plugin.cu calls only the six functions below. A sparse plan starts with its
// attnrt_problem (like the dense plan), so the plugin dispatches run/destroy on plan->op.
// Errors are written into (err, cap); the caller copies them into its last_error.
#pragma once

#include <attnrt/plugin.h>

#include "cuda_common/attend_tensors.h"
#include "cuda_common/sparse_ops.h"

#include <cstddef>
#include <cstdint>

namespace attnrt_cuda_sparse {

using attnrt_cuda_common::is_decode_op;
using attnrt_cuda_common::is_index_op;
using attnrt_cuda_common::is_sparse_op;
using attnrt_cuda_common::reads_attention_inputs;
using attnrt_cuda_common::reads_index_inputs;

// OK when plan/run serve this problem on a device of compute capability cc_major.x.
int32_t probe(const attnrt_problem* p, int cc_major, char* err, size_t cap);
// Builds a plan (device metadata, score and split buffers sized from the layout).
int32_t plan(const attnrt_problem* p, const attnrt_layout* layout, int sms, attnrt_plan* out,
             char* err, size_t cap);
// Decode plans: absorbs new kv_len / page ids for the same requests in place (same device
// addresses, same grid) so that a CUDA graph captured over run() replays with the new lengths;
// ATTNRT_UNAVAILABLE when the layout does not fit the plan's room (the host re-plans).
int32_t update(attnrt_plan plan, const attnrt_layout* layout, char* err, size_t cap);
// Launches the op's kernels on `stream`; no allocation, no synchronization.
int32_t run(attnrt_plan plan, const attnrt_tensors* t, void* stream, char* err, size_t cap);
void destroy(attnrt_plan plan);

// ---- internal: shared between sparse_plan.cu, sparse_index.cu and sparse_attend.cu ----------

// Indexer work item: request b, first flattened row r0 (row = local token * H_idx + head) of a
// tile, block range [c0, c1).
struct IndexItem {
  int32_t b, r0, c0, c1;
};

struct IndexArgs {
  const void* q;   // index_q [T, H, D]
  const void* kc;  // index_k_cache [pages, ps, 1, D]
  int64_t q_s0, q_s1, k_s0, k_s1;
  int H, D, B, K, page_size, init_blocks, local_blocks, score_lse;
  float scale_log2;  // index_scale * log2(e)
  const int32_t* q_len;
  const int32_t* kv_len;
  const int64_t* q_indptr;
  const int32_t* page_indptr;
  const int32_t* page_ids;
  const int64_t* score_base;  // per request: offset of its [q_len*H, nblk] score matrix
  const int32_t* row_req;     // per packed token
  float* scores;
  int32_t* topk;  // [H, T, K]
  int64_t t_s0, t_s1, t_s2;
  const IndexItem* items;
  int num_items;
  int64_t total_tokens;
};

struct AttendArgs : attnrt_cuda_common::AttendTensors {
  int hq, hkv, group, htiles, D, B, K, R, page_size, nsplit, per_split;
  float scale_log2;  // sm_scale * log2(e)
  const int32_t* row_req;  // per row
  const int32_t* row_pos;  // per row: absolute position of the query
  const int32_t* kv_len;
  const int32_t* page_indptr;
  const int32_t* page_ids;
  float* part_o;    // [rows, nsplit, Hq, D] (nsplit > 1)
  float* part_lse;  // [rows, nsplit, Hq]
  int rows;
};

// Launchers (dtype: ATTNRT_BF16 or ATTNRT_F16; index D: 32, 64 or 128; attend D: 64 or 128).
// Return cudaError_t as int.
int launch_index(const IndexArgs& a, int dtype, int rows_per_tile, void* stream);
// Load every kernel instance these launchers use on the current device and set their
// attributes, once per device (cuda_common/kernel_attr.h). Return cudaError_t as int.
int index_load_kernels();
int attend_load_kernels();
int launch_attend(const AttendArgs& a, int dtype, void* stream);

}  // namespace attnrt_cuda_sparse
