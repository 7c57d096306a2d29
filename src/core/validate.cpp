// Input validation (design.md §3): every message names the request (when there is one), the
// field, the value and what was expected, so a user can fix the call without reading code.
#include "core/validate.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "attnrt/errors.h"

namespace attnrt {
namespace {

template <typename... A>
[[noreturn]] void fail(const A&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw InvalidArgument(os.str());
}

constexpr int kMaxHeadDim = 512;

bool is_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

void check_positive(const char* field, int v) {
  if (v <= 0) fail(field, " ", v, " (expected > 0)");
}

// Presence, dtype, device, rank, shape and inner stride of one tensor.
void check_tensor(const char* name, const TensorView& t, DType dtype, const Device& device,
                  std::initializer_list<int64_t> shape) {
  if (!t.defined()) fail("tensor ", name, " is missing (expected shape [", [&] {
    std::string s;
    for (int64_t x : shape) s += (s.empty() ? "" : ", ") + std::to_string(x);
    return s;
  }(), "])");
  if (t.dtype != dtype) {
    fail("tensor ", name, " dtype ", dtype_name(t.dtype), " (expected ", dtype_name(dtype), ")");
  }
  if (!(t.device == device)) {
    fail("tensor ", name, " device ", t.device.str(), " (expected ", device.str(),
         ", the problem's device)");
  }
  if (t.rank != static_cast<int>(shape.size())) {
    fail("tensor ", name, " rank ", t.rank, " shape ", t.shape_str(), " (expected rank ",
         shape.size(), ")");
  }
  int i = 0;
  for (int64_t want : shape) {
    // A negative expected extent means "any" (the page count of a pool).
    if (want >= 0 && t.shape[i] != want) {
      fail("tensor ", name, " shape ", t.shape_str(), " dim ", i, " is ", t.shape[i],
           " (expected ", want, ")");
    }
    if (t.shape[i] < 0) fail("tensor ", name, " shape ", t.shape_str(), " has a negative extent");
    ++i;
  }
  if (t.rank > 0 && t.shape[t.rank - 1] > 1 && t.strides[t.rank - 1] != 1) {
    fail("tensor ", name, " last-dim stride ", t.strides[t.rank - 1], " (expected 1)");
  }
}

void check_absent(const char* name, const TensorView& t, const char* why) {
  if (t.defined()) fail("tensor ", name, " is given but ", why);
}

// No output shares its buffer with an input or another output: a backend may write an output
// before it has read every input (sparse_decode writes topk, then reads it).
void check_outputs_apart(Op op, const Tensors& t) {
  struct Named {
    const char* name;
    const TensorView* view;
  };
  std::vector<Named> outputs, others;
  if (reads_attention_inputs(op)) {
    outputs.push_back({"out", &t.out});
    outputs.push_back({"lse", &t.lse});
    others.insert(
        others.end(),
        {{"q", &t.q}, {"k_cache", &t.k_cache}, {"v_cache", &t.v_cache}, {"sink", &t.sink}});
  }
  if (reads_index_inputs(op)) {
    outputs.push_back({"topk", &t.topk});
    others.insert(others.end(), {{"index_q", &t.index_q}, {"index_k_cache", &t.index_k_cache}});
  }
  if (reads_topk_input(op)) others.push_back({"topk", &t.topk});
  others.insert(others.begin(), outputs.begin(), outputs.end());
  for (const Named& o : outputs) {
    if (!o.view->defined()) continue;
    for (const Named& x : others) {
      if (x.view != o.view && x.view->data == o.view->data) {
        fail("tensor ", o.name, " aliases ", x.name, " (expected a separate buffer)");
      }
    }
  }
}

}  // namespace

void validate_problem(const Problem& p) {
  if (static_cast<int>(p.op) >= kNumOps) {
    fail("op ", static_cast<int>(p.op), " (expected one of the ", kNumOps, " ops)");
  }
  if (!is_float(p.q_dtype)) fail("q_dtype ", dtype_name(p.q_dtype), " (expected f32, f16 or bf16)");
  if (!is_float(p.kv_dtype)) {
    fail("kv_dtype ", dtype_name(p.kv_dtype), " (expected f32, f16 or bf16)");
  }
  check_positive("page_size", p.page_size);
  if (reads_attention_inputs(p.op)) {
    check_positive("num_q_heads", p.num_q_heads);
    check_positive("num_kv_heads", p.num_kv_heads);
    if (p.num_q_heads % p.num_kv_heads != 0) {
      fail("num_q_heads ", p.num_q_heads, " % num_kv_heads ", p.num_kv_heads,
           " != 0 (expected num_q_heads a multiple of num_kv_heads)");
    }
    if (p.head_dim < 1 || p.head_dim > kMaxHeadDim) {
      fail("head_dim ", p.head_dim, " (expected 1..", kMaxHeadDim, ")");
    }
    if (!(p.sm_scale >= 0.0f) || !std::isfinite(p.sm_scale)) {
      fail("sm_scale ", p.sm_scale, " (expected finite >= 0; 0 means 1/sqrt(head_dim))");
    }
  }
  if (!is_dense(p.op)) {
    check_positive("num_index_heads", p.num_index_heads);
    check_positive("block_size", p.block_size);
    check_positive("topk", p.topk);
  }
  if (reads_index_inputs(p.op)) {
    if (p.index_dim < 1 || p.index_dim > kMaxHeadDim) {
      fail("index_dim ", p.index_dim, " (expected 1..", kMaxHeadDim, ")");
    }
    if (p.init_blocks < 0) fail("init_blocks ", p.init_blocks, " (expected >= 0)");
    if (p.local_blocks < 0) fail("local_blocks ", p.local_blocks, " (expected >= 0)");
    if (p.init_blocks + p.local_blocks > p.topk) {
      fail("init_blocks ", p.init_blocks, " + local_blocks ", p.local_blocks, " > topk ", p.topk,
           " (expected forced blocks to fit in topk)");
    }
    if (p.score_type != ScoreType::max && p.score_type != ScoreType::lse) {
      fail("score_type ", static_cast<int>(p.score_type), " (expected max or lse)");
    }
    if (!(p.index_scale >= 0.0f) || !std::isfinite(p.index_scale)) {
      fail("index_scale ", p.index_scale, " (expected finite >= 0; 0 means 1/sqrt(index_dim))");
    }
  }
  if (attends_selected_blocks(p.op) && p.num_index_heads % p.num_kv_heads != 0) {
    fail("num_index_heads ", p.num_index_heads, " % num_kv_heads ", p.num_kv_heads,
         " != 0 (expected num_index_heads a multiple of num_kv_heads)");
  }
}

MaxPage validate_layout(const Problem& p, const BatchLayout& l) {
  if (l.page_size != p.page_size) {
    fail("layout.page_size ", l.page_size, " != problem.page_size ", p.page_size,
         " (expected equal)");
  }
  const int n = l.num_requests();
  if (n == 0) fail("batch is empty (q_len has 0 requests; expected at least 1)");
  if (static_cast<int>(l.kv_len.size()) != n) {
    fail("kv_len size ", l.kv_len.size(), " (expected ", n, ", the size of q_len)");
  }
  if (static_cast<int>(l.q_indptr.size()) != n + 1) {
    fail("q_indptr size ", l.q_indptr.size(), " (expected ", n + 1, ")");
  }
  if (static_cast<int>(l.page_indptr.size()) != n + 1) {
    fail("page_indptr size ", l.page_indptr.size(), " (expected ", n + 1, ")");
  }
  if (l.q_indptr[0] != 0) fail("q_indptr[0] ", l.q_indptr[0], " (expected 0)");
  // The whole CSR structure of the page table is checked before any page id is read: with
  // page_indptr non-decreasing from 0 to page_ids.size(), every request's slice is in bounds.
  if (l.page_indptr[0] != 0) fail("page_indptr[0] ", l.page_indptr[0], " (expected 0)");
  for (int b = 0; b < n; ++b) {
    if (l.page_indptr[b + 1] < l.page_indptr[b]) {
      fail("request ", b, ": page_indptr decreases (page_indptr[", b, "] ", l.page_indptr[b],
           " -> page_indptr[", b + 1, "] ", l.page_indptr[b + 1], "; expected non-decreasing)");
    }
  }
  if (l.page_indptr[n] != static_cast<int64_t>(l.page_ids.size())) {
    fail("page_indptr[", n, "] ", l.page_indptr[n], " (expected ", l.page_ids.size(),
         ", the size of page_ids)");
  }
  MaxPage max_page;
  for (int b = 0; b < n; ++b) {
    const int32_t q = l.q_len[b], kv = l.kv_len[b];
    if (q < 1) fail("request ", b, ": q_len ", q, " (expected >= 1)");
    if (kv < q) {
      fail("request ", b, ": q_len ", q, " > kv_len ", kv, " (q_len must be <= kv_len)");
    }
    if (is_decode(p.op) && q != 1) {
      fail("request ", b, ": q_len ", q, " (expected 1 for ", op_name(p.op), ")");
    }
    if (l.q_indptr[b + 1] - l.q_indptr[b] != q) {
      fail("request ", b, ": q_indptr[", b + 1, "] - q_indptr[", b, "] = ",
           l.q_indptr[b + 1] - l.q_indptr[b], " (expected q_len ", q, ")");
    }
    const int64_t have = static_cast<int64_t>(l.page_indptr[b + 1]) - l.page_indptr[b];
    const int64_t need = (static_cast<int64_t>(kv) + p.page_size - 1) / p.page_size;
    if (have < need) {
      fail("request ", b, ": page list length ", have, " < ", need,
           " (expected >= ceil(kv_len ", kv, " / page_size ", p.page_size, "))");
    }
    for (int64_t i = l.page_indptr[b]; i < l.page_indptr[b + 1]; ++i) {
      if (l.page_ids[i] < 0) {
        fail("request ", b, ": page id ", l.page_ids[i], " at page_ids[", i, "] (expected >= 0)");
      }
      // Pages past ceil(kv_len / page_size) are never read, so only the needed ones count.
      if (i - l.page_indptr[b] < need && l.page_ids[i] > max_page.id) max_page = {l.page_ids[i], b, i};
    }
  }
  return max_page;
}

void validate_tensors(const Problem& p, const BatchLayout& l, const MaxPage& max_page,
                      const Tensors& t) {
  const Device& dev = p.device;
  const int64_t T = l.total_q();
  auto check_pool = [&](const char* name, const TensorView& pool) {
    if (pool.defined() && pool.rank >= 1 && max_page.id >= pool.shape[0]) {
      fail("request ", max_page.request, ": page id ", max_page.id, " at page_ids[",
           max_page.index, "] >= ", name, " pages ", pool.shape[0],
           " (expected page ids < the pool's shape[0])");
    }
  };
  if (reads_index_inputs(p.op)) {
    check_tensor("index_q", t.index_q, p.q_dtype, dev, {T, p.num_index_heads, p.index_dim});
    check_tensor("index_k_cache", t.index_k_cache, p.kv_dtype, dev,
                 {-1, p.page_size, 1, p.index_dim});
    check_pool("index_k_cache", t.index_k_cache);
    check_tensor("topk", t.topk, DType::i32, dev, {p.num_index_heads, T, p.topk});
  }
  if (reads_attention_inputs(p.op)) {
    check_tensor("q", t.q, p.q_dtype, dev, {T, p.num_q_heads, p.head_dim});
    check_tensor("k_cache", t.k_cache, p.kv_dtype, dev,
                 {-1, p.page_size, p.num_kv_heads, p.head_dim});
    check_tensor("v_cache", t.v_cache, p.kv_dtype, dev,
                 {-1, p.page_size, p.num_kv_heads, p.head_dim});
    if (t.v_cache.shape[0] != t.k_cache.shape[0]) {
      fail("tensor v_cache pages ", t.v_cache.shape[0], " (expected ", t.k_cache.shape[0],
           ", the pages of k_cache)");
    }
    check_pool("k_cache", t.k_cache);
    check_tensor("out", t.out, p.q_dtype, dev, {T, p.num_q_heads, p.head_dim});
    if (p.write_lse) {
      check_tensor("lse", t.lse, DType::f32, dev, {T, p.num_q_heads});
    } else {
      check_absent("lse", t.lse, "write_lse is false (expected lse iff write_lse)");
    }
    if (p.has_sink) {
      check_tensor("sink", t.sink, DType::f32, dev, {p.num_q_heads});
    } else {
      check_absent("sink", t.sink, "has_sink is false (expected sink iff has_sink)");
    }
  }
  if (reads_topk_input(p.op)) {
    check_tensor("topk", t.topk, DType::i32, dev, {p.num_index_heads, T, p.topk});
  }
  check_outputs_apart(p.op, t);
  // A caller's selection is read on the host; an op that writes topk needs no rows checked.
  if (!reads_topk_input(p.op) || !dev.is_host()) return;
  const int32_t* sel = static_cast<const int32_t*>(t.topk.data);
  for (int b = 0; b < l.num_requests(); ++b) {
    for (int64_t tok = 0; tok < l.q_len[b]; ++tok) {
      const int64_t row = l.q_indptr[b] + tok;
      const int64_t pos = l.kv_len[b] - l.q_len[b] + tok;
      const int64_t nvis = pos / p.block_size + 1;
      for (int h = 0; h < p.num_index_heads; ++h) {
        int64_t prev = -1;
        bool tail = false;
        for (int k = 0; k < p.topk; ++k) {
          const int32_t c =
              sel[h * t.topk.strides[0] + row * t.topk.strides[1] + k * t.topk.strides[2]];
          const char* bad = nullptr;
          if (c == -1) {
            tail = true;
            continue;
          }
          if (tail) bad = "a block id after a -1 (expected -1 only as a tail)";
          else if (c < 0 || c >= nvis) bad = "out of range";
          else if (c <= prev) bad = "not ascending and unique";
          if (bad) {
            fail("request ", b, ": topk[", h, ", ", row, ", ", k, "] = ", c, " is ", bad,
                 " (expected ascending unique ids in [0, ", nvis, ") then -1)");
          }
          prev = c;
        }
      }
    }
  }
}

}  // namespace attnrt
