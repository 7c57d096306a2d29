// Which sparse op an attnrt_problem asks for, shared by the CUDA plugins (header-only; op codes
// of the plugin ABI).
#pragma once

#include <attnrt/plugin.h>

#include <cstdint>

namespace attnrt_cuda_common {

inline bool is_sparse_op(int32_t op) {
  return op == ATTNRT_OP_SPARSE_INDEX_EXTEND || op == ATTNRT_OP_SPARSE_INDEX_DECODE ||
         op == ATTNRT_OP_SPARSE_ATTEND_EXTEND || op == ATTNRT_OP_SPARSE_ATTEND_DECODE ||
         op == ATTNRT_OP_SPARSE_DECODE;
}
// The indexer alone (block scores + top-k), extend or decode.
inline bool is_index_op(int32_t op) {
  return op == ATTNRT_OP_SPARSE_INDEX_EXTEND || op == ATTNRT_OP_SPARSE_INDEX_DECODE;
}
// An op that scores blocks, so reads index_q and index_k_cache: the indexers and sparse_decode.
inline bool reads_index_inputs(int32_t op) {
  return is_index_op(op) || op == ATTNRT_OP_SPARSE_DECODE;
}
// A sparse op that attends, so reads q and the K/V caches: sparse attend and sparse_decode.
inline bool reads_attention_inputs(int32_t op) {
  return op == ATTNRT_OP_SPARSE_ATTEND_EXTEND || op == ATTNRT_OP_SPARSE_ATTEND_DECODE ||
         op == ATTNRT_OP_SPARSE_DECODE;
}
// A sparse decode op (one query row per request).
inline bool is_decode_op(int32_t op) {
  return op == ATTNRT_OP_SPARSE_INDEX_DECODE || op == ATTNRT_OP_SPARSE_ATTEND_DECODE ||
         op == ATTNRT_OP_SPARSE_DECODE;
}

}  // namespace attnrt_cuda_common
