// The canary: before a plugin serves an op on a device, it computes a tiny problem with the same
// static parameters and its answer is compared with the reference backend's. This is what
// catches a fast path that is present and does not crash, but computes wrong numbers.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>

#include "attnrt/errors.h"
#include "backends/reference/reference_backend.h"
#include "registry/plugin_backend.h"

namespace attnrt {
namespace {

struct Buf {
  std::vector<unsigned char> host;
  TensorView view;  // host view
  void* dev = nullptr;
};

class CanaryData {
 public:
  CanaryData(Backend& b, Device d) : backend_(b), device_(d) {
    if (!d.is_host()) {
      mem_ = b.device_memory(d);
      if (!mem_) throw BackendUnavailable(b.name(), "canary", d.str(), "no device memory entry points");
    }
  }
  ~CanaryData() {
    for (Buf* b : bufs_)
      if (b->dev) mem_->free(b->dev);
    for (Buf* b : bufs_) delete b;
  }
  Buf& make(DType t, std::initializer_list<int64_t> shape) {
    Buf* b = new Buf;
    int64_t n = 1;
    for (auto s : shape) n *= s;
    b->host.assign(static_cast<size_t>(n) * dtype_size(t), 0);
    b->view = TensorView::contiguous(b->host.data(), t, Device::cpu(), shape);
    bufs_.push_back(b);
    return *b;
  }
  // The view the backend sees: on the device, with the host contents copied there.
  TensorView upload(Buf& b) {
    if (device_.is_host()) return b.view;
    b.dev = mem_->alloc(b.host.size());
    backend_.copy_to_device(device_, b.dev, b.host.data(), b.host.size());
    TensorView v = b.view;
    v.data = b.dev;
    v.device = device_;
    return v;
  }
  void download(Buf& b) {
    if (device_.is_host()) return;
    backend_.synchronize(device_);
    backend_.copy_to_host(device_, b.host.data(), b.dev, b.host.size());
  }

 private:
  Backend& backend_;
  Device device_;
  std::shared_ptr<DeviceMemory> mem_;
  std::vector<Buf*> bufs_;
};

void fill(Buf& b, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t i = 0; i < b.view.numel(); ++i) store_from_f32(b.view.data, b.view.dtype, i, nd(rng));
}

void poison(Buf& b) {
  if (b.view.dtype == DType::i32) {
    std::memset(b.host.data(), 0x7f, b.host.size());
    return;
  }
  for (int64_t i = 0; i < b.view.numel(); ++i)
    store_from_f32(b.view.data, b.view.dtype, i, std::numeric_limits<float>::quiet_NaN());
}

// max over elements of |a-b| / (1 + |b|); NaN counts as infinite.
double max_err(const Buf& a, const Buf& b) {
  double m = 0;
  for (int64_t i = 0; i < b.view.numel(); ++i) {
    double x = load_as_f32(a.view.data, a.view.dtype, i);
    double y = load_as_f32(b.view.data, b.view.dtype, i);
    if (std::isinf(y) && x == y) continue;  // both -inf lse
    double e = std::fabs(x - y) / (1.0 + std::fabs(y));
    if (std::isnan(e)) return INFINITY;
    m = std::max(m, e);
  }
  return m;
}

// Number of selection rows that differ as sets (or violate ascending / -1 padding).
int64_t topk_mismatches(const Buf& got, const Buf& want) {
  const auto* g = reinterpret_cast<const int32_t*>(got.host.data());
  const auto* w = reinterpret_cast<const int32_t*>(want.host.data());
  int64_t k = want.view.shape[2], rows = want.view.shape[0] * want.view.shape[1], bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int32_t> a(g + r * k, g + (r + 1) * k), b(w + r * k, w + (r + 1) * k);
    bool ascending = true;
    for (int64_t i = 1; i < k; ++i)
      if (a[i] != -1 && a[i] <= a[i - 1]) ascending = false;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (!ascending || a != b) ++bad;
  }
  return bad;
}

}  // namespace

std::string run_canary(Backend& backend, const Problem& problem, Workspace& workspace) {
  const Problem& p = problem;
  const bool decode = is_decode(p.op);
  const int ps = p.page_size;
  // Two requests. Sparse problems get more visible blocks than topk so selection is real.
  int base = is_dense(p.op) ? 37 : (p.topk + 2) * p.block_size + p.block_size / 2 + 3;
  std::vector<int32_t> kv = {base, std::max(1, base / 3 + 1)};
  std::vector<int32_t> ql = decode ? std::vector<int32_t>{1, 1} : std::vector<int32_t>{5, 2};
  std::vector<std::vector<int32_t>> pages(2);
  int next = 0;
  for (int r = 1; r >= 0; --r) {  // request 1 takes low pages: page order is not request order
    int np = (kv[r] + ps - 1) / ps;
    for (int i = 0; i < np; ++i) pages[r].push_back(next++);
    std::reverse(pages[r].begin(), pages[r].end());
  }
  BatchLayout layout = BatchLayout::make(ps, ql, kv, pages);
  const int64_t T = layout.total_q();
  const int num_pages = next;

  std::mt19937_64 rng(0x5eed ^ p.signature());
  std::unique_ptr<CanaryData> data;
  Tensors host, dev;
  std::vector<std::pair<Buf*, Buf*>> outputs;  // (backend's, reference's)
  auto input = [&](TensorView& h, TensorView& d, DType t, std::initializer_list<int64_t> shape) {
    Buf& b = data->make(t, shape);
    fill(b, rng);
    h = b.view;
    d = data->upload(b);
  };
  auto output = [&](TensorView& h, TensorView& d, DType t, std::initializer_list<int64_t> shape) {
    Buf& b = data->make(t, shape);
    Buf& ref = data->make(t, shape);
    poison(b);
    d = data->upload(b);
    h = ref.view;
    outputs.push_back({&b, &ref});
  };
  // Device memory and copies go through the plugin too, so setting up the canary can fail like
  // the plugin's plan and run can: any failure up to the downloaded outputs makes the plugin
  // unavailable with the reason, never an error of the caller's plan().
  auto setup = [&] {
    data = std::make_unique<CanaryData>(backend, p.device);
    // sparse_decode gets the inputs of both steps; its topk is an output, compared like the
    // indexer's, and the reference's sparse_decode is the oracle for topk, out and lse.
    if (reads_index_inputs(p.op)) {
      input(host.index_q, dev.index_q, p.q_dtype, {T, p.num_index_heads, p.index_dim});
      input(host.index_k_cache, dev.index_k_cache, p.kv_dtype, {num_pages, ps, 1, p.index_dim});
      output(host.topk, dev.topk, DType::i32, {p.num_index_heads, T, p.topk});
    }
    if (reads_attention_inputs(p.op)) {
      input(host.q, dev.q, p.q_dtype, {T, p.num_q_heads, p.head_dim});
      input(host.k_cache, dev.k_cache, p.kv_dtype, {num_pages, ps, p.num_kv_heads, p.head_dim});
      input(host.v_cache, dev.v_cache, p.kv_dtype, {num_pages, ps, p.num_kv_heads, p.head_dim});
      if (p.has_sink) input(host.sink, dev.sink, DType::f32, {p.num_q_heads});
      if (reads_topk_input(p.op)) {
        // A legal selection: per row, the query's own block plus random others, ascending.
        Buf& sel = data->make(DType::i32, {p.num_index_heads, T, p.topk});
        auto* s = reinterpret_cast<int32_t*>(sel.host.data());
        for (int h = 0; h < p.num_index_heads; ++h)
          for (int b = 0; b < 2; ++b)
            for (int64_t t = layout.q_indptr[b]; t < layout.q_indptr[b + 1]; ++t) {
              int64_t pos = kv[b] - ql[b] + (t - layout.q_indptr[b]);
              int nvis = static_cast<int>(pos / p.block_size) + 1;
              std::vector<int32_t> ids(nvis);
              for (int i = 0; i < nvis; ++i) ids[i] = i;
              std::shuffle(ids.begin(), ids.end() - 1, rng);
              std::vector<int32_t> pick(ids.end() - 1, ids.end());  // own block
              for (int i = 0; i < nvis - 1 && static_cast<int>(pick.size()) < p.topk; ++i)
                pick.push_back(ids[i]);
              std::sort(pick.begin(), pick.end());
              int32_t* row = s + (static_cast<int64_t>(h) * T + t) * p.topk;
              for (int i = 0; i < p.topk; ++i)
                row[i] = i < static_cast<int>(pick.size()) ? pick[i] : -1;
            }
        host.topk = sel.view;
        dev.topk = data->upload(sel);
      }
      output(host.out, dev.out, p.q_dtype, {T, p.num_q_heads, p.head_dim});
      if (p.write_lse) output(host.lse, dev.lse, DType::f32, {T, p.num_q_heads});
    }
  };

  try {
    setup();
    auto plan = backend.plan(p, layout, workspace);
    backend.run(*plan, p, layout, dev, workspace);
    for (auto& o : outputs) data->download(*o.first);
  } catch (const BackendUnavailable& e) {
    return "canary failed: " + e.reason();
  } catch (const std::exception& e) {
    return std::string("canary failed: ") + e.what();
  }
  reference_compute(p, layout, host);

  const double tol = (p.q_dtype == DType::f32 && p.kv_dtype == DType::f32) ? 1e-3 : 3e-2;
  std::ostringstream why;
  for (auto& [got, want] : outputs) {
    if (want->view.dtype == DType::i32) {
      int64_t bad = topk_mismatches(*got, *want);
      if (bad) {
        why << "canary mismatch (" << bad << " top-k rows differ from the reference)";
        return why.str();
      }
      continue;
    }
    double e = max_err(*got, *want);
    if (!(e <= tol)) {
      why << "canary mismatch (max err " << e << " > tol " << tol << " in "
          << (want->view.data == host.lse.data ? "lse" : "out") << ")";
      return why.str();
    }
  }
  return {};
}

}  // namespace attnrt
