// What an attention call computes: the op, its static parameters (Problem), the batch's shape
// over the paged KV cache (BatchLayout) and the tensors it reads and writes (Tensors).
//
// Semantics (design.md §2, spec/minimax-sparse.md §3-§5):
//   * request b has kv_len[b] tokens in cache, including its q_len[b] new tokens, which sit at
//     absolute positions kv_len-q_len .. kv_len-1; attention is causal (key j visible to query at
//     position p iff j <= p).
//   * decode ops require q_len == 1 for every request; rows of the output are requests.
//   * query tokens of all requests are packed: request b's tokens are rows
//     q_indptr[b] .. q_indptr[b+1]-1 of q, out, lse, index_q and topk.
//   * logical page i of request b is physical page page_ids[page_indptr[b] + i]; token j of the
//     request lives at row j % page_size of that page, j / page_size = i.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnrt/types.h"

namespace attnrt {

enum class Op : uint8_t {
  dense_extend = 0,
  dense_decode = 1,
  sparse_index_extend = 2,
  sparse_index_decode = 3,
  sparse_attend_extend = 4,
  sparse_attend_decode = 5,
  // sparse_index_decode, then sparse_attend_decode on the selections it just wrote to
  // tensors.topk, in one call: the same results as the two calls with the same Problem fields.
  sparse_decode = 6,
};
constexpr int kNumOps = 7;
const char* op_name(Op op);
// Throws InvalidArgument listing the known names.
Op parse_op(std::string_view s);

// What an op reads and writes. sparse_decode runs the indexer and sparse attention, so it is in
// both families; code asks these questions rather than listing ops.
//
// q_len == 1 for every request.
inline bool is_decode(Op op) {
  return op == Op::dense_decode || op == Op::sparse_index_decode ||
         op == Op::sparse_attend_decode || op == Op::sparse_decode;
}
// Full causal attention; uses no sparse field.
inline bool is_dense(Op op) { return op == Op::dense_extend || op == Op::dense_decode; }
// Runs the indexer: reads index_q, index_k_cache and the index fields (index_dim, init_blocks,
// local_blocks, score_type, index_scale) and writes topk.
inline bool reads_index_inputs(Op op) {
  return op == Op::sparse_index_extend || op == Op::sparse_index_decode || op == Op::sparse_decode;
}
// Runs attention: reads q, k_cache, v_cache (sink) and the attention fields (heads, head_dim,
// sm_scale, has_sink, write_lse) and writes out (lse).
inline bool reads_attention_inputs(Op op) {
  return is_dense(op) || op == Op::sparse_attend_extend || op == Op::sparse_attend_decode ||
         op == Op::sparse_decode;
}
// Attention restricted to the blocks in topk (num_index_heads a multiple of num_kv_heads).
inline bool attends_selected_blocks(Op op) {
  return reads_attention_inputs(op) && !is_dense(op);
}
// topk is an input the caller provides (checked row by row), not an output of the call.
inline bool reads_topk_input(Op op) {
  return attends_selected_blocks(op) && !reads_index_inputs(op);
}
// The single-step op that computes only the indexer / only the attention of `op` with the same
// Problem fields: `op` itself, except sparse_index_decode / sparse_attend_decode for sparse_decode.
// For backends that compose sparse_decode and for checks of each step.
inline Op index_step(Op op) {
  return op == Op::sparse_decode ? Op::sparse_index_decode : op;
}
inline Op attention_step(Op op) {
  return op == Op::sparse_decode ? Op::sparse_attend_decode : op;
}

enum class ScoreType : uint8_t { max = 0, lse = 1 };
const char* score_type_name(ScoreType s);

// Static parameters of one op call: everything but the batch layout and the data. Every field
// reaches every backend; a backend that lacks a feature reports it in probe.
struct Problem {
  Op op = Op::dense_extend;
  Device device{};
  DType q_dtype = DType::f32;   // q, out and index_q
  DType kv_dtype = DType::f32;  // k/v cache and index-key cache
  int page_size = 16;

  // ops that read attention inputs (dense_*, sparse_attend_*, sparse_decode)
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float sm_scale = 0.0f;   // 0 means 1/sqrt(head_dim)
  bool has_sink = false;   // tensors.sink is a per-q-head logit [num_q_heads] f32
  bool write_lse = false;  // tensors.lse [T, num_q_heads] f32 receives the natural-log LSE

  // sparse ops (every op but dense_*); the index fields only for ops that read index inputs
  // (sparse_index_*, sparse_decode)
  int num_index_heads = 0;  // H_idx; a multiple of num_kv_heads where selected blocks are attended
  int index_dim = 0;        // D_idx (index)
  int block_size = 0;       // B, tokens per scored block
  int topk = 0;             // K, blocks per (index head, row)
  int init_blocks = 0;      // forced leading blocks (index)
  int local_blocks = 0;     // forced trailing blocks (index)
  ScoreType score_type = ScoreType::max;
  float index_scale = 0.0f;  // 0 means 1/sqrt(index_dim)

  float effective_sm_scale() const;
  float effective_index_scale() const;
  // One line naming every field that matters for `op`, e.g. for logs and doctor.
  std::string describe() const;
  // Hash of every field that matters for `op` (used in plan-cache and canary keys).
  uint64_t signature() const;
};

// The shape of a batch over the paged cache. Host-side, built once per step.
struct BatchLayout {
  int page_size = 16;
  std::vector<int32_t> q_len;        // per request
  std::vector<int32_t> kv_len;       // per request, includes the new tokens
  std::vector<int64_t> q_indptr;     // size n+1: packed row offsets of each request's tokens
  std::vector<int32_t> page_indptr;  // size n+1: CSR offsets into page_ids
  std::vector<int32_t> page_ids;     // physical page ids, request after request

  // Builds a layout; q_indptr is derived. No validation here: the Runtime validates.
  static BatchLayout make(int page_size, std::vector<int32_t> q_len, std::vector<int32_t> kv_len,
                          const std::vector<std::vector<int32_t>>& pages);
  int num_requests() const { return static_cast<int>(q_len.size()); }
  int64_t total_q() const { return q_indptr.empty() ? 0 : q_indptr.back(); }
  int32_t max_kv_len() const;
  // Hash over every field, page ids included: equal layouts hash equal; any change of a length
  // or page id changes it (with overwhelming probability; plan caches also compare exactly).
  uint64_t fingerprint() const;
  friend bool operator==(const BatchLayout&, const BatchLayout&) = default;
};

// The data of one call. Which fields are used depends on the op:
//   dense_* / sparse_attend_*: q [T,Hq,D], k_cache/v_cache [pages,page_size,Hkv,D],
//                              out [T,Hq,D] (q dtype), lse [T,Hq] f32 (iff write_lse),
//                              sink [Hq] f32 (iff has_sink);
//   sparse_attend_* also:      topk [H_idx, T, K] i32 (input; ascending ids, -1 padded);
//                              KV head g attends the union of index heads g*R..g*R+R-1,
//                              R = H_idx / Hkv.
//   sparse_index_*:            index_q [T,H_idx,D_idx], index_k_cache [pages,page_size,1,D_idx],
//                              topk [H_idx, T, K] i32 (output).
//   sparse_decode:             every tensor of sparse_index_decode and of sparse_attend_decode;
//                              topk is its output (written, then attended).
struct Tensors {
  TensorView q, k_cache, v_cache, out, lse, sink;
  TensorView index_q, index_k_cache, topk;
};

}  // namespace attnrt
