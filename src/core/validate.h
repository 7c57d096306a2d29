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

// The largest page id a layout reads and where it is, so that a pool too small for it is
// reported with the request that uses it.
struct MaxPage {
  int32_t id = -1;      // -1: no page
  int request = -1;     // the first request that uses it
  int64_t index = -1;   // its position in page_ids
};

// The layout against the problem: non-empty batch, array sizes, q_len/kv_len ranges, decode
// q_len == 1, q_indptr consistent, the page table's CSR structure (page_indptr from 0,
// non-decreasing, ending at page_ids.size()) before any page id is read, page lists long enough
// (ceil(kv_len/page_size)), page ids non-negative, layout.page_size == problem.page_size.
// Returns the largest page id used, which validate_tensors compares with the pool size.
MaxPage validate_layout(const Problem& problem, const BatchLayout& layout);

// The tensors against problem and layout: presence, dtype, device (all on problem.device),
// rank, shape, inner stride 1, page ids < pool pages, no output sharing a buffer with another
// tensor. For a host topk that the caller provides (sparse_attend_*), also the selection rows
// (ascending unique ids in range, -1 tail); sparse_decode writes its topk.
void validate_tensors(const Problem& problem, const BatchLayout& layout, const MaxPage& max_page,
                      const Tensors& tensors);

}  // namespace attnrt
