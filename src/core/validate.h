// Input validation: the Runtime's job, done once before any backend runs (design.md §3).
// Every violation throws InvalidArgument whose message names the request index (when there is
// one), the field, the offending value and what was expected, e.g.
//   "request 3: q_len 9 > kv_len 8 (q_len must be <= kv_len)".
#pragma once

#include <cstdint>

#include "attnrt/problem.h"

namespace attnrt {

// Static parameters: heads, head ratios, dims, dtypes, page size, sparse parameters.
void validate_problem(const Problem& problem);

// The layout against the problem: non-empty batch, array sizes, q_len/kv_len ranges, decode
// q_len == 1, q_indptr consistent, page lists long enough (ceil(kv_len/page_size)), page ids
// non-negative, layout.page_size == problem.page_size. Returns the largest page id used (-1 for
// none), which validate_tensors compares with the pool size.
int32_t validate_layout(const Problem& problem, const BatchLayout& layout);

// The tensors against problem and layout: presence, dtype, device (all on problem.device),
// rank, shape, inner stride 1, page ids < pool pages, output not aliasing inputs. For host
// tensors of sparse_attend, also the selection rows (ascending unique ids in range, -1 tail).
void validate_tensors(const Problem& problem, const BatchLayout& layout, int32_t max_page_id,
                      const Tensors& tensors);

}  // namespace attnrt
