// The reference backend: direct transcription of spec/minimax-sparse.md §3-§5 in double.
// Clarity over speed: it is the ground truth every other backend is compared with.
#include "backends/reference/reference_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

namespace attnrt {
namespace {

// Element offset of token j's row for head h in a paged cache [pages, page_size, H, D].
int64_t cache_offset(const TensorView& cache, const BatchLayout& layout, int b, int64_t j,
                     int h) {
  const int ps = layout.page_size;
  const int64_t page = layout.page_ids[layout.page_indptr[b] + j / ps];
  return page * cache.strides[0] + (j % ps) * cache.strides[1] + h * cache.strides[2];
}

double dot_q_k(const TensorView& q, int64_t qoff, const TensorView& k, int64_t koff, int d) {
  double s = 0.0;
  for (int i = 0; i < d; ++i) {
    s += static_cast<double>(load_as_f32(q.data, q.dtype, qoff + i)) *
         static_cast<double>(load_as_f32(k.data, k.dtype, koff + i));
  }
  return s;
}

// Attention of one (row, q head) over an explicit key set (absolute positions).
void attend_row(const Problem& pr, const BatchLayout& layout, const Tensors& t, int b, int64_t row,
                int h, int g, const std::vector<int64_t>& keys) {
  const int d = pr.head_dim;
  const double scale = pr.effective_sm_scale();
  const int64_t qoff = row * t.q.strides[0] + h * t.q.strides[1];
  std::vector<double> s(keys.size());
  double m = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < keys.size(); ++i) {
    s[i] = scale * dot_q_k(t.q, qoff, t.k_cache, cache_offset(t.k_cache, layout, b, keys[i], g), d);
    m = std::max(m, s[i]);
  }
  double sink = 0.0;
  if (pr.has_sink) {
    sink = static_cast<double>(load_as_f32(t.sink.data, DType::f32, h * t.sink.strides[0]));
    m = std::max(m, sink);
  }
  std::vector<double> acc(d, 0.0);
  double denom = 0.0;
  if (std::isfinite(m)) {
    for (size_t i = 0; i < keys.size(); ++i) {
      const double w = std::exp(s[i] - m);
      denom += w;
      const int64_t voff = cache_offset(t.v_cache, layout, b, keys[i], g);
      for (int x = 0; x < d; ++x) {
        acc[x] += w * static_cast<double>(load_as_f32(t.v_cache.data, t.v_cache.dtype, voff + x));
      }
    }
    if (pr.has_sink) denom += std::exp(sink - m);  // sink: denominator only, value 0
  }
  const int64_t ooff = row * t.out.strides[0] + h * t.out.strides[1];
  for (int x = 0; x < d; ++x) {
    const double v = denom > 0.0 ? acc[x] / denom : 0.0;
    store_from_f32(t.out.data, t.out.dtype, ooff + x * t.out.strides[2], static_cast<float>(v));
  }
  if (pr.write_lse) {
    const double lse =
        denom > 0.0 ? m + std::log(denom) : -std::numeric_limits<double>::infinity();
    static_cast<float*>(t.lse.data)[row * t.lse.strides[0] + h * t.lse.strides[1]] =
        static_cast<float>(lse);
  }
}

void compute_attend(const Problem& pr, const BatchLayout& layout, const Tensors& t) {
  const int hq = pr.num_q_heads, hkv = pr.num_kv_heads;
  const int group = hq / hkv;
  const bool sparse = attends_selected_blocks(pr.op);
  const int r_idx = sparse ? pr.num_index_heads / hkv : 0;
  for (int b = 0; b < layout.num_requests(); ++b) {
    const int64_t kv = layout.kv_len[b], ql = layout.q_len[b];
    for (int64_t tok = 0; tok < ql; ++tok) {
      const int64_t row = layout.q_indptr[b] + tok;
      const int64_t p = kv - ql + tok;  // absolute position of this query
      for (int g = 0; g < hkv; ++g) {
        std::vector<int64_t> keys;
        if (!sparse) {
          keys.resize(p + 1);
          std::iota(keys.begin(), keys.end(), int64_t{0});
        } else {
          std::set<int64_t> blocks;  // union over the group's index heads, -1 ignored
          for (int ih = g * r_idx; ih < (g + 1) * r_idx; ++ih) {
            for (int k = 0; k < pr.topk; ++k) {
              const int32_t c = static_cast<const int32_t*>(
                  t.topk.data)[ih * t.topk.strides[0] + row * t.topk.strides[1] +
                               k * t.topk.strides[2]];
              if (c >= 0) blocks.insert(c);
            }
          }
          for (int64_t c : blocks) {
            for (int64_t j = c * pr.block_size; j < (c + 1) * pr.block_size; ++j) {
              if (j <= p && j < kv) keys.push_back(j);
            }
          }
        }
        for (int h = g * group; h < (g + 1) * group; ++h) {
          attend_row(pr, layout, t, b, row, h, g, keys);
        }
      }
    }
  }
}

void compute_index(const Problem& pr, const BatchLayout& layout, const Tensors& t) {
  const int B = pr.block_size, K = pr.topk, di = pr.index_dim;
  const double scale = pr.effective_index_scale();
  int32_t* out = static_cast<int32_t*>(t.topk.data);
  for (int b = 0; b < layout.num_requests(); ++b) {
    const int64_t kv = layout.kv_len[b], ql = layout.q_len[b];
    for (int64_t tok = 0; tok < ql; ++tok) {
      const int64_t row = layout.q_indptr[b] + tok;
      const int64_t p = kv - ql + tok;
      const int64_t nvis = p / B + 1;
      for (int ih = 0; ih < pr.num_index_heads; ++ih) {
        const int64_t qoff = row * t.index_q.strides[0] + ih * t.index_q.strides[1];
        std::vector<double> score(nvis);
        for (int64_t c = 0; c < nvis; ++c) {
          const int64_t end = std::min<int64_t>((c + 1) * B, p + 1);
          double m = -std::numeric_limits<double>::infinity();
          std::vector<double> s;
          for (int64_t j = c * B; j < end; ++j) {
            s.push_back(scale * dot_q_k(t.index_q, qoff, t.index_k_cache,
                                        cache_offset(t.index_k_cache, layout, b, j, 0), di));
            m = std::max(m, s.back());
          }
          double v = m;
          if (pr.score_type == ScoreType::lse && std::isfinite(m)) {
            double sum = 0.0;
            for (double x : s) sum += std::exp(x - m);
            v = m + std::log(sum);
          }
          if (std::isnan(v)) v = -1e30;
          if (c < pr.init_blocks) v = 1e30;
          if (c >= nvis - pr.local_blocks) v = 1e29;  // local overrides init
          score[c] = v;
        }
        const int64_t keff = std::min<int64_t>(K, nvis);
        std::vector<int64_t> ids(nvis);
        std::iota(ids.begin(), ids.end(), int64_t{0});
        // Ties go to the lower block id (spec: compared as sets, any tie order is allowed).
        std::stable_sort(ids.begin(), ids.end(),
                         [&](int64_t a, int64_t c) { return score[a] > score[c]; });
        ids.resize(keff);
        std::sort(ids.begin(), ids.end());
        for (int k = 0; k < K; ++k) {
          out[ih * t.topk.strides[0] + row * t.topk.strides[1] + k * t.topk.strides[2]] =
              k < keff ? static_cast<int32_t>(ids[k]) : -1;
        }
      }
    }
  }
}

class ReferencePlan final : public BackendPlan {};

class ReferenceBackend final : public Backend {
 public:
  const std::string& name() const override { return name_; }
  int priority() const override { return 0; }
  std::vector<Device> devices() const override { return {Device::cpu()}; }
  Availability probe(const Problem& problem) const override {
    if (!problem.device.is_host()) {
      return Availability::no("reference serves host memory only, not " + problem.device.str());
    }
    return Availability::yes();
  }
  std::unique_ptr<BackendPlan> plan(const Problem&, const BatchLayout&, Workspace&) override {
    return std::make_unique<ReferencePlan>();
  }
  void run(const BackendPlan&, const Problem& problem, const BatchLayout& layout,
           const Tensors& tensors, Workspace&) override {
    reference_compute(problem, layout, tensors);
  }

 private:
  std::string name_ = "reference";
};

}  // namespace

void reference_compute(const Problem& problem, const BatchLayout& layout, const Tensors& tensors) {
  // sparse_decode does both, in this order: attention reads the topk the indexer just wrote.
  if (reads_index_inputs(problem.op)) compute_index(problem, layout, tensors);
  if (reads_attention_inputs(problem.op)) compute_attend(problem, layout, tensors);
}

std::unique_ptr<Backend> make_reference_backend() { return std::make_unique<ReferenceBackend>(); }

}  // namespace attnrt
