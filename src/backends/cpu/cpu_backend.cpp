// The cpu backend: tiled online-softmax (flash) attention on host memory.
//
// Work items are (request, kv head, query token); each item processes all G query heads of its
// KV group together against K/V tiles of up to kTile keys, so every K/V row is converted to f32
// and read once per group, never once per head. The paged cache is read through the page table
// tile by tile. Sparse attend visits only the tokens of the selected blocks (union over the R
// index heads of the group). The indexer scores blocks with a running max (or lse) and picks
// top-k with nth_element, then sorts the K ids ascending.
//
// Threads: a small std::thread pool owned by the backend (not OpenMP: TSan + libgomp gives false
// positives). parallel_for is serialised by a mutex, so concurrent callers are safe; scratch is
// per work item (stack / per-call vectors), so no mutable state is shared between calls.
// Determinism: every output element is computed by exactly one work item in a fixed order, so
// results do not depend on the thread count or scheduling.
//
// Limits (reported by probe): host device only; head_dim and index_dim <= 256.
#include "backends/cpu/cpu_backend.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace attnrt {
namespace {

constexpr int kMaxDim = 256;
constexpr int kTile = 32;     // keys per tile
constexpr int kMaxG = 64;     // query heads per group handled on the stack
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

class ThreadPool {
 public:
  explicit ThreadPool(int n) {
    if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
    size_ = n;
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return size_; }
  // Runs fn(i) for i in [0, n) on the pool; the caller participates. Serialised across callers.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
    if (n <= 0) return;
    if (workers_.empty() || n == 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> call_lock(call_mu_);
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      ++gen_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return active_ == 0; });
    fn_ = nullptr;
  }

 private:
  void work() {
    for (;;) {
      int64_t i = next_.fetch_add(1);
      if (i >= n_) break;
      (*fn_)(i);
    }
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || gen_ != seen; });
        if (stop_) return;
        seen = gen_;
      }
      work();
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (--active_ == 0) done_cv_.notify_all();
      }
    }
  }
  std::vector<std::thread> workers_;
  int size_ = 1;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int active_ = 0;
  uint64_t gen_ = 0;
  bool stop_ = false;
};

// Converts n elements of dtype t at p to f32.
inline void to_f32(const void* p, DType t, int n, float* dst) {
  if (t == DType::f32) {
    std::memcpy(dst, p, sizeof(float) * n);
  } else if (t == DType::bf16) {
    const uint16_t* s = static_cast<const uint16_t*>(p);
    for (int i = 0; i < n; ++i) {
      uint32_t u = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(&dst[i], &u, 4);
    }
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(p);
    for (int i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  }
}

inline const char* row_ptr(const TensorView& t, int64_t elem_off) {
  return static_cast<const char*>(t.data) + elem_off * static_cast<int64_t>(dtype_size(t.dtype));
}

// Dot product with 16 independent partial sums in a fixed order: vectorises without
// -ffast-math (no reassociation needed) and stays deterministic.
__attribute__((always_inline)) inline float dot16(const float* a, const float* b, int n) {
  float p[16] = {};
  int x = 0;
  for (; x + 16 <= n; x += 16)
    for (int i = 0; i < 16; ++i) p[i] += a[x + i] * b[x + i];
  float d = 0.f;
  for (; x < n; ++x) d += a[x] * b[x];
  for (int i = 0; i < 16; ++i) d += p[i];
  return d;
}

// One flash tile: scores of G heads vs n keys, online softmax update. Compiled for AVX-512 and
// baseline; the loader picks at run time (no -march tie to the build machine).
__attribute__((target_clones("arch=x86-64-v4", "default"))) void flash_tile(
    int G, int D, int n, const float* q /*[G][D], pre-scaled*/, const float* k /*[n][D]*/,
    const float* v /*[n][D]*/, float* m /*[G]*/, float* l /*[G]*/, float* acc /*[G][D]*/) {
  float s[kTile];
  for (int h = 0; h < G; ++h) {
    const float* qh = q + h * D;
    float mx = m[h];
    for (int j = 0; j < n; ++j) {
      const float* kj = k + j * D;
      const float d = dot16(qh, kj, D);
      s[j] = d;
      mx = std::max(mx, d);
    }
    float corr = (m[h] == kNegInf) ? 0.f : std::exp(m[h] - mx);
    float* a = acc + h * D;
    for (int x = 0; x < D; ++x) a[x] *= corr;
    float sum = 0.f;
    for (int j = 0; j < n; ++j) {
      float pj = std::exp(s[j] - mx);
      sum += pj;
      const float* vj = v + j * D;
      for (int x = 0; x < D; ++x) a[x] += pj * vj[x];
    }
    l[h] = l[h] * corr + sum;
    m[h] = mx;
  }
}

__attribute__((target_clones("arch=x86-64-v4", "default"))) float dot_f32(const float* a,
                                                                          const float* b, int n) {
  return dot16(a, b, n);
}

struct CpuPlan : BackendPlan {
  uint64_t fingerprint = 0;
};

// Token j of request b: element offset of (page row, head h, 0) in a cache view.
inline int64_t cache_off(const TensorView& c, const BatchLayout& L, int b, int64_t j, int h) {
  int64_t page = L.page_ids[L.page_indptr[b] + j / L.page_size];
  return page * c.strides[0] + (j % L.page_size) * c.strides[1] + h * c.strides[2];
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) : pool_(threads) {}
  const std::string& name() const override { return name_; }
  int priority() const override { return 100; }
  std::vector<Device> devices() const override { return {Device::cpu()}; }

  Availability probe(const Problem& p) const override {
    if (!p.device.is_host()) return Availability::no("cpu backend serves host memory only");
    auto fdt = [](DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; };
    if (!fdt(p.q_dtype) || !fdt(p.kv_dtype))
      return Availability::no("cpu backend supports f32/f16/bf16 q and kv only");
    if (is_index(p.op)) {
      if (p.index_dim > kMaxDim) return Availability::no("cpu backend: index_dim > 256");
    } else {
      if (p.head_dim > kMaxDim) return Availability::no("cpu backend: head_dim > 256");
      if (p.num_kv_heads > 0 && p.num_q_heads / p.num_kv_heads > kMaxG)
        return Availability::no("cpu backend: more than 64 q heads per kv head");
    }
    return Availability::yes();
  }

  std::unique_ptr<BackendPlan> plan(const Problem&, const BatchLayout& layout,
                                    Workspace&) override {
    auto pl = std::make_unique<CpuPlan>();
    pl->fingerprint = layout.fingerprint();
    return pl;
  }

  void run(const BackendPlan& plan, const Problem& p, const BatchLayout& L, const Tensors& t,
           Workspace&) override {
    const auto* cp = dynamic_cast<const CpuPlan*>(&plan);
    if (!cp || cp->fingerprint != L.fingerprint())
      throw InvalidArgument("cpu backend: plan was built for a different batch layout");
    if (is_index(p.op))
      run_index(p, L, t);
    else
      run_attend(p, L, t);
  }

 private:
  void run_attend(const Problem& p, const BatchLayout& L, const Tensors& t) {
    const int Hq = p.num_q_heads, Hkv = p.num_kv_heads, D = p.head_dim, G = Hq / Hkv;
    const bool sparse = is_sparse_attend(p.op);
    const int R = sparse ? p.num_index_heads / Hkv : 0;
    const int K = sparse ? p.topk : 0;
    const float scale = p.effective_sm_scale();
    const int64_t T = L.total_q();
    // Work items: (row, kv head). Row -> request via q_indptr.
    std::vector<int> row_req(T);
    for (int b = 0; b < L.num_requests(); ++b)
      for (int64_t r = L.q_indptr[b]; r < L.q_indptr[b + 1]; ++r) row_req[r] = b;
    pool_.parallel_for(T * Hkv, [&](int64_t item) {
      const int64_t r = item / Hkv;
      const int g = static_cast<int>(item % Hkv);
      const int b = row_req[r];
      const int64_t pos = L.kv_len[b] - L.q_len[b] + (r - L.q_indptr[b]);
      std::vector<float> buf(static_cast<size_t>(G) * D * 2 + 2 * kTile * D + 2 * G);
      float* q = buf.data();
      float* acc = q + G * D;
      float* kt = acc + G * D;
      float* vt = kt + kTile * D;
      float* m = vt + kTile * D;
      float* l = m + G;
      for (int h = 0; h < G; ++h) {
        to_f32(row_ptr(t.q, r * t.q.strides[0] + (g * G + h) * t.q.strides[1]), p.q_dtype, D,
               q + h * D);
        for (int x = 0; x < D; ++x) q[h * D + x] *= scale;
        m[h] = kNegInf;
        l[h] = 0.f;
      }
      std::fill(acc, acc + G * D, 0.f);
      int n = 0;
      auto flush = [&] {
        if (n) flash_tile(G, D, n, q, kt, vt, m, l, acc);
        n = 0;
      };
      auto add_key = [&](int64_t j) {
        to_f32(row_ptr(t.k_cache, cache_off(t.k_cache, L, b, j, g)), p.kv_dtype, D, kt + n * D);
        to_f32(row_ptr(t.v_cache, cache_off(t.v_cache, L, b, j, g)), p.kv_dtype, D, vt + n * D);
        if (++n == kTile) flush();
      };
      const int64_t last = std::min<int64_t>(pos, L.kv_len[b] - 1);
      if (!sparse) {
        for (int64_t j = 0; j <= last; ++j) add_key(j);
      } else {
        // Union of the R index heads' ascending lists: merge, dedupe.
        std::vector<int32_t> sel;
        sel.reserve(static_cast<size_t>(R) * K);
        for (int i = 0; i < R; ++i) {
          const int32_t* ids = t.topk.ptr<int32_t>() + (g * R + i) * t.topk.strides[0] +
                               r * t.topk.strides[1];
          for (int k = 0; k < K; ++k)
            if (ids[k * t.topk.strides[2]] >= 0) sel.push_back(ids[k * t.topk.strides[2]]);
        }
        std::sort(sel.begin(), sel.end());
        sel.erase(std::unique(sel.begin(), sel.end()), sel.end());
        const int B = p.block_size;
        for (int32_t c : sel) {
          const int64_t j0 = static_cast<int64_t>(c) * B;
          const int64_t j1 = std::min<int64_t>(j0 + B - 1, last);
          for (int64_t j = j0; j <= j1; ++j) add_key(j);
        }
      }
      flush();
      for (int h = 0; h < G; ++h) {
        const int hq = g * G + h;
        float mm = m[h], ll = l[h];
        float* a = acc + h * D;
        if (p.has_sink) {
          const float sk = t.sink.ptr<float>()[hq * t.sink.strides[0]];
          const float m2 = std::max(mm, sk);
          const float c = (mm == kNegInf) ? 0.f : std::exp(mm - m2);
          ll = ll * c + std::exp(sk - m2);
          for (int x = 0; x < D; ++x) a[x] *= c;
          mm = m2;
        }
        const float inv = ll > 0.f ? 1.f / ll : 0.f;
        void* out = static_cast<char*>(t.out.data) +
                    (r * t.out.strides[0] + hq * t.out.strides[1]) * dtype_size(t.out.dtype);
        for (int x = 0; x < D; ++x) store_from_f32(out, t.out.dtype, x, a[x] * inv);
        if (p.write_lse)
          t.lse.ptr<float>()[r * t.lse.strides[0] + hq * t.lse.strides[1]] =
              ll > 0.f ? mm + std::log(ll) : kNegInf;
      }
    });
  }

  void run_index(const Problem& p, const BatchLayout& L, const Tensors& t) {
    const int H = p.num_index_heads, Di = p.index_dim, B = p.block_size, K = p.topk;
    const float s = p.effective_index_scale();
    const int64_t T = L.total_q();
    std::vector<int> row_req(T);
    for (int b = 0; b < L.num_requests(); ++b)
      for (int64_t r = L.q_indptr[b]; r < L.q_indptr[b + 1]; ++r) row_req[r] = b;
    pool_.parallel_for(T, [&](int64_t r) {
      const int b = row_req[r];
      const int64_t pos = L.kv_len[b] - L.q_len[b] + (r - L.q_indptr[b]);
      const int64_t last = std::min<int64_t>(pos, L.kv_len[b] - 1);
      const int nvis = static_cast<int>(pos / B + 1);
      std::vector<float> q(static_cast<size_t>(H) * Di), kr(Di);
      std::vector<float> mx(static_cast<size_t>(H) * nvis, kNegInf),
          sum(p.score_type == ScoreType::lse ? static_cast<size_t>(H) * nvis : 0, 0.f);
      for (int h = 0; h < H; ++h)
        to_f32(row_ptr(t.index_q, r * t.index_q.strides[0] + h * t.index_q.strides[1]),
               p.q_dtype, Di, q.data() + h * Di);
      // Pass 1: running max per block (keys read once for all heads).
      std::vector<float> logit(static_cast<size_t>(H) * B);
      for (int c = 0; c < nvis; ++c) {
        const int64_t j0 = static_cast<int64_t>(c) * B, j1 = std::min<int64_t>(j0 + B - 1, last);
        for (int64_t j = j0; j <= j1; ++j) {
          to_f32(row_ptr(t.index_k_cache, cache_off(t.index_k_cache, L, b, j, 0)), p.kv_dtype,
                 Di, kr.data());
          for (int h = 0; h < H; ++h) {
            float z = s * dot_f32(q.data() + h * Di, kr.data(), Di);
            logit[h * B + (j - j0)] = z;
            mx[h * nvis + c] = std::max(mx[h * nvis + c], z);
          }
        }
        if (p.score_type == ScoreType::lse) {
          for (int h = 0; h < H; ++h) {
            float m0 = mx[h * nvis + c], acc = 0.f;
            if (m0 == kNegInf) continue;
            for (int64_t j = j0; j <= j1; ++j) acc += std::exp(logit[h * B + (j - j0)] - m0);
            mx[h * nvis + c] = m0 + std::log(acc);
          }
        }
      }
      const int keff = std::min(K, nvis);
      std::vector<int32_t> ids(nvis);
      for (int h = 0; h < H; ++h) {
        float* S = mx.data() + h * nvis;
        for (int c = 0; c < nvis; ++c) {
          if (std::isnan(S[c])) S[c] = -1e30f;
          if (c < p.init_blocks) S[c] = 1e30f;
          if (c >= nvis - p.local_blocks) S[c] = 1e29f;
        }
        for (int c = 0; c < nvis; ++c) ids[c] = c;
        // Descending score, ties to the smaller id: a total order, so deterministic.
        auto better = [S](int32_t a, int32_t bb) { return S[a] > S[bb] || (S[a] == S[bb] && a < bb); };
        if (keff < nvis) std::nth_element(ids.begin(), ids.begin() + keff, ids.end(), better);
        std::sort(ids.begin(), ids.begin() + keff);
        int32_t* o = t.topk.ptr<int32_t>() + h * t.topk.strides[0] + r * t.topk.strides[1];
        for (int k = 0; k < K; ++k) o[k * t.topk.strides[2]] = k < keff ? ids[k] : -1;
      }
    });
  }

  std::string name_ = "cpu";
  ThreadPool pool_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int num_threads) {
  return std::make_unique<CpuBackend>(num_threads);
}

}  // namespace attnrt
