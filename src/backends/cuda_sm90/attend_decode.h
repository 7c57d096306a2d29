// Fused sparse attend for decode on sm_90 (cuda_sm90 plugin): production shape only, 16 query
// heads sharing one KV head, head_dim 128, block = page = 128, top-16 from one index head.
#pragma once

#include <cstdint>

namespace attnrt_cuda_sm90 {

constexpr int kHeads = 16;   // query heads (one KV head)
constexpr int kHeadDim = 128;

struct AttendDecodeArgs {
  const void* q;    // [n, 16, 128]
  const void* kc;   // [pages, 128, 1, 128]
  const void* vc;
  void* out;        // [n, 16, 128]
  float* lse;       // [n, 16] or null
  const float* sink;  // [16] or null
  const int32_t* topk;  // [1, n, 16]
  int64_t q_s0, q_s1, o_s0, o_s1, k_s0, k_s1, v_s0, v_s1, lse_s0, t_s1, t_s2;
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
