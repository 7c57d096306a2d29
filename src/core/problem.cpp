#include "attnrt/problem.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "attnrt/errors.h"
#include "core/hash.h"

namespace attnrt {

namespace {
constexpr const char* kOpNames[kNumOps] = {
    "dense_extend",         "dense_decode",         "sparse_index_extend", "sparse_index_decode",
    "sparse_attend_extend", "sparse_attend_decode", "sparse_decode"};
}

const char* op_name(Op op) {
  int i = static_cast<int>(op);
  return (i >= 0 && i < kNumOps) ? kOpNames[i] : "?";
}

Op parse_op(std::string_view s) {
  std::string known;
  for (int i = 0; i < kNumOps; ++i) {
    if (s == kOpNames[i]) return static_cast<Op>(i);
    known += (i ? ", " : "") + std::string(kOpNames[i]);
  }
  throw InvalidArgument("op: unknown op '" + std::string(s) + "' (known: " + known + ")");
}

const char* score_type_name(ScoreType s) { return s == ScoreType::max ? "max" : "lse"; }

float Problem::effective_sm_scale() const {
  return sm_scale != 0.0f ? sm_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

float Problem::effective_index_scale() const {
  return index_scale != 0.0f ? index_scale : 1.0f / std::sqrt(static_cast<float>(index_dim));
}

std::string Problem::describe() const {
  std::ostringstream os;
  os << op_name(op) << " on " << device.str() << ": q " << dtype_name(q_dtype) << ", kv "
     << dtype_name(kv_dtype) << ", page_size " << page_size;
  if (reads_attention_inputs(op)) {
    os << ", heads " << num_q_heads << "/" << num_kv_heads << ", head_dim " << head_dim
       << ", scale " << effective_sm_scale() << (has_sink ? ", sink" : "")
       << (write_lse ? ", lse" : "");
  }
  if (!is_dense(op)) {
    os << ", index_heads " << num_index_heads << ", block " << block_size << ", topk " << topk;
  }
  if (reads_index_inputs(op)) {
    os << ", index_dim " << index_dim << ", score " << score_type_name(score_type) << ", init "
       << init_blocks << ", local " << local_blocks << ", index_scale " << effective_index_scale();
  }
  return os.str();
}

uint64_t Problem::signature() const {
  Hasher h;
  h.add(static_cast<int>(op)).add(static_cast<int>(device.kind)).add(device.index);
  h.add(static_cast<int>(q_dtype)).add(static_cast<int>(kv_dtype)).add(page_size);
  if (reads_attention_inputs(op)) {
    h.add(num_q_heads).add(num_kv_heads).add(head_dim).add(effective_sm_scale());
    h.add(has_sink).add(write_lse);
  }
  if (!is_dense(op)) h.add(num_index_heads).add(block_size).add(topk);
  if (reads_index_inputs(op)) {
    h.add(index_dim).add(init_blocks).add(local_blocks).add(static_cast<int>(score_type));
    h.add(effective_index_scale());
  }
  return h.value();
}

BatchLayout BatchLayout::make(int page_size, std::vector<int32_t> q_len,
                              std::vector<int32_t> kv_len,
                              const std::vector<std::vector<int32_t>>& pages) {
  BatchLayout l;
  l.page_size = page_size;
  l.q_len = std::move(q_len);
  l.kv_len = std::move(kv_len);
  l.q_indptr.assign(1, 0);
  for (int32_t q : l.q_len) l.q_indptr.push_back(l.q_indptr.back() + q);
  l.page_indptr.assign(1, 0);
  for (const auto& p : pages) {
    l.page_ids.insert(l.page_ids.end(), p.begin(), p.end());
    l.page_indptr.push_back(static_cast<int32_t>(l.page_ids.size()));
  }
  return l;
}

int32_t BatchLayout::max_kv_len() const {
  int32_t m = 0;
  for (int32_t k : kv_len) m = std::max(m, k);
  return m;
}

uint64_t BatchLayout::fingerprint() const {
  Hasher h;
  h.add(page_size).add(q_len.size());
  h.add_span(q_len.data(), q_len.size());
  h.add_span(kv_len.data(), kv_len.size());
  h.add_span(q_indptr.data(), q_indptr.size());
  h.add_span(page_indptr.data(), page_indptr.size());
  h.add_span(page_ids.data(), page_ids.size());
  return h.value();
}

}  // namespace attnrt
