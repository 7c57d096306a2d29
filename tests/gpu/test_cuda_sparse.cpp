// GPU tests of the CUDA plugin's MiniMax sparse ops (spec/minimax-sparse.md §3-§5) through its C
// ABI (dlopen), against a double-precision host reference written here:
//   * indexer: ids ascending, unique, in range, -1 padded after min(K, nvis); forced blocks in;
//     the selected set equal to the reference's (a differing id must be a near-tie in double);
//   * sparse attend: bf16/f16 outputs within atol = rtol = 5e-3 of the reference, lse 1e-3;
//   * paged == unpaged bit for bit (page sizes 1..256), repeat runs bit-identical;
//   * context <= topk * block: indexer + sparse attend equal dense attention;
//   * a long-context decode (ATTNRT_SPARSE_LONG_CTX tokens, default 524288).
// Outputs are NaN-poisoned before every run. Without a CUDA device every test is skipped.
// ATTNRT_GPU_BENCH=1 enables the M3 per-rank timing test.
#include <cuda_runtime.h>

#include "plugin_harness.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

using namespace gpu_test;

// Fast approximate N(0,1) (Irwin-Hall of 4 uniforms) for large buffers.
struct FastNormal {
  uint64_t s;
  explicit FastNormal(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint32_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return static_cast<uint32_t>(s >> 16);
  }
  float operator()() {
    float a = 0;
    for (int i = 0; i < 4; ++i) a += (next() & 0xffffff) * (1.0f / 16777216.0f);
    return (a - 2.0f) * 1.7320508f;
  }
};

// A batch: logical per-token data (encoded 16-bit) and a paged placement of it.
struct Batch {
  int dtype = ATTNRT_BF16;
  int hq = 16, hkv = 1, hidx = 1, d = 128, didx = 128;
  std::vector<int32_t> q_len, kv_len;
  std::vector<int64_t> q_indptr;
  int64_t T = 0;
  // logical, request-major: token j of request b at tok_off[b] + j
  std::vector<int64_t> tok_off;
  std::vector<uint16_t> k, v, ik;  // [tokens, hkv, d], [tokens, 1, didx]
  std::vector<uint16_t> q, iq;     // [T, hq, d], [T, hidx, didx]
  std::vector<float> sink;
  float dec(uint16_t u) const { return dtype == ATTNRT_BF16 ? from_bf16(u) : from_f16(u); }
  uint16_t enc(float f) const { return dtype == ATTNRT_BF16 ? to_bf16(f) : to_f16(f); }
  int pos(int b, int64_t t) const {
    return kv_len[b] - q_len[b] + static_cast<int>(t - q_indptr[b]);
  }
  int req_of(int64_t t) const {
    int b = 0;
    while (q_indptr[b + 1] <= t) ++b;
    return b;
  }
};

Batch make_batch(int dtype, int hq, int hkv, int hidx, int d, int didx, std::vector<int32_t> ql,
                 std::vector<int32_t> kl, uint64_t seed, bool attend_data = true,
                 bool index_data = true) {
  Batch B;
  B.dtype = dtype;
  B.hq = hq;
  B.hkv = hkv;
  B.hidx = hidx;
  B.d = d;
  B.didx = didx;
  B.q_len = std::move(ql);
  B.kv_len = std::move(kl);
  const int n = static_cast<int>(B.q_len.size());
  B.q_indptr.assign(n + 1, 0);
  B.tok_off.assign(n + 1, 0);
  for (int b = 0; b < n; ++b) {
    B.q_indptr[b + 1] = B.q_indptr[b] + B.q_len[b];
    B.tok_off[b + 1] = B.tok_off[b] + B.kv_len[b];
  }
  B.T = B.q_indptr[n];
  const int64_t toks = B.tok_off[n];
  FastNormal r(seed);
  auto fill = [&](std::vector<uint16_t>& x, size_t count) {
    x.resize(count);
    for (auto& e : x) e = B.enc(r());
  };
  if (attend_data) {
    fill(B.k, static_cast<size_t>(toks) * hkv * d);
    fill(B.v, static_cast<size_t>(toks) * hkv * d);
    fill(B.q, static_cast<size_t>(B.T) * hq * d);
  }
  if (index_data) {
    fill(B.ik, static_cast<size_t>(toks) * didx);
    fill(B.iq, static_cast<size_t>(B.T) * hidx * didx);
  }
  B.sink.resize(hq);
  for (auto& s : B.sink) s = r() * 2.f;
  return B;
}

// Paged placement: page_ids scattered by `seed` (seed 0: in order).
struct Paging {
  int ps = 16;
  std::vector<int32_t> page_indptr, page_ids;
  int num_pages = 0;
};

Paging make_paging(const Batch& B, int ps, uint64_t seed) {
  Paging P;
  P.ps = ps;
  const int n = static_cast<int>(B.q_len.size());
  P.page_indptr.assign(n + 1, 0);
  for (int b = 0; b < n; ++b) P.page_indptr[b + 1] = P.page_indptr[b] + (B.kv_len[b] + ps - 1) / ps;
  const int total = P.page_indptr[n];
  P.num_pages = total + 2;
  std::vector<int32_t> perm(P.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  if (seed) std::shuffle(perm.begin(), perm.end(), std::mt19937_64(seed));
  P.page_ids.assign(perm.begin(), perm.begin() + total);
  return P;
}

// Scatters logical [tokens, H, D] into a pool [pages, ps, H, D]; unused rows get junk.
std::vector<uint16_t> to_pool(const Batch& B, const Paging& P, const std::vector<uint16_t>& x,
                              int H, int D) {
  std::vector<uint16_t> pool(static_cast<size_t>(P.num_pages) * P.ps * H * D, 0x3f80);
  const size_t row = static_cast<size_t>(H) * D;
  for (size_t b = 0; b < B.q_len.size(); ++b)
    for (int64_t j = 0; j < B.kv_len[b]; ++j) {
      const int64_t page = P.page_ids[P.page_indptr[b] + j / P.ps];
      std::memcpy(&pool[(page * P.ps + j % P.ps) * row], &x[(B.tok_off[b] + j) * row], row * 2);
    }
  return pool;
}

attnrt_layout layout_of(const Batch& B, const Paging& P) {
  return attnrt_layout{static_cast<int32_t>(B.q_len.size()), P.ps, B.q_len.data(), B.kv_len.data(),
                       B.q_indptr.data(), P.page_indptr.data(), P.page_ids.data(), 0};
}

struct SparseParams {
  int B = 128, K = 16, init = 0, local = 1, score_lse = 0;
  bool sink = false, lse = true;
};

attnrt_problem problem_of(int op, const Batch& B, const SparseParams& S, int ps) {
  attnrt_problem p{};
  p.op = op;
  p.device = {ATTNRT_DEVICE_CUDA, 0};
  p.q_dtype = p.kv_dtype = B.dtype;
  p.page_size = ps;
  p.num_q_heads = B.hq;
  p.num_kv_heads = B.hkv;
  p.head_dim = B.d;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(B.d));
  p.has_sink = S.sink;
  p.write_lse = S.lse;
  p.num_index_heads = B.hidx;
  p.index_dim = B.didx;
  p.block_size = S.B;
  p.topk = S.K;
  p.init_blocks = S.init;
  p.local_blocks = S.local;
  p.score_type = S.score_lse;
  p.index_scale = 1.f / std::sqrt(static_cast<float>(B.didx));
  return p;
}

// ---- host references (double) ----------------------------------------------------------------

// Block scores [hidx, T, nvis] (forced values applied) for every row.
std::vector<std::vector<double>> ref_scores(const Batch& B, const SparseParams& S) {
  std::vector<std::vector<double>> out(static_cast<size_t>(B.hidx) * B.T);
  const double scale = 1.0 / std::sqrt(static_cast<double>(B.didx));
  std::vector<float> ikf(B.ik.size());
  for (size_t i = 0; i < B.ik.size(); ++i) ikf[i] = B.dec(B.ik[i]);
  for (size_t b = 0; b < B.q_len.size(); ++b)
    for (int64_t t = B.q_indptr[b]; t < B.q_indptr[b + 1]; ++t) {
      const int p = B.pos(static_cast<int>(b), t);
      const int nvis = p / S.B + 1;
      for (int h = 0; h < B.hidx; ++h) {
        std::vector<double> qv(B.didx);
        for (int x = 0; x < B.didx; ++x) qv[x] = B.dec(B.iq[(t * B.hidx + h) * B.didx + x]);
        std::vector<double> sc(nvis);
        for (int c = 0; c < nvis; ++c) {
          double m = -INFINITY;
          std::vector<double> s;
          for (int j = c * S.B; j < std::min((c + 1) * S.B, p + 1); ++j) {
            const float* kr = &ikf[(B.tok_off[b] + j) * B.didx];
            double acc = 0;
            for (int x = 0; x < B.didx; ++x) acc += qv[x] * kr[x];
            s.push_back(acc * scale);
            m = std::max(m, s.back());
          }
          double v = m;
          if (S.score_lse) {
            double sum = 0;
            for (double x : s) sum += std::exp(x - m);
            v = m + std::log(sum);
          }
          if (c < S.init) v = 1e30;
          if (c >= nvis - S.local) v = 1e29;
          sc[c] = v;
        }
        out[h * B.T + t] = std::move(sc);
      }
    }
  return out;
}

// Checks the device top-k [hidx, T, K] against the reference scores. *near_ties: the number of
// (head, row) pairs whose set differs from the reference's only by near-ties.
void check_topk(const Batch& B, const SparseParams& S, const std::vector<int32_t>& topk,
                const std::vector<std::vector<double>>& sc, int* near_ties) {
  *near_ties = 0;
  for (int h = 0; h < B.hidx; ++h)
    for (int64_t t = 0; t < B.T; ++t) {
      const std::vector<double>& s = sc[h * B.T + t];
      const int nvis = static_cast<int>(s.size());
      const int keff = std::min(S.K, nvis);
      const int32_t* row = &topk[(h * B.T + t) * S.K];
      std::vector<int> ids(nvis);
      std::iota(ids.begin(), ids.end(), 0);
      std::stable_sort(ids.begin(), ids.end(), [&](int a, int c) { return s[a] > s[c]; });
      std::set<int> ref(ids.begin(), ids.begin() + keff), got;
      const double kth = s[ids[keff - 1]];
      bool differs = false;
      for (int k = 0; k < S.K; ++k) {
        if (k >= keff) {
          ASSERT_EQ(row[k], -1) << "h " << h << " t " << t << " k " << k << ": pad must be -1";
          continue;
        }
        ASSERT_GE(row[k], 0) << "h " << h << " t " << t << " k " << k;
        ASSERT_LT(row[k], nvis) << "h " << h << " t " << t << " k " << k;
        if (k > 0) {
          ASSERT_GT(row[k], row[k - 1]) << "not ascending/unique: h " << h << " t " << t;
        }
        got.insert(row[k]);
        if (!ref.count(row[k])) {
          differs = true;
          // Only a near-tie with the reference's K-th score may differ.
          ASSERT_GE(s[row[k]], kth - 1e-4 * (1 + std::fabs(kth)))
              << "h " << h << " t " << t << ": block " << row[k] << " score " << s[row[k]]
              << " below the K-th score " << kth;
        }
      }
      for (int c = 0; c < nvis; ++c) {
        if (s[c] >= 1e29) {
          ASSERT_TRUE(got.count(c)) << "forced block " << c << " missing";
        }
      }
      *near_ties += differs;
    }
}

// Random valid selections [hidx, T, K]: the query's own block, then random distinct visible
// blocks, ascending, -1 padded.
std::vector<int32_t> random_topk(const Batch& B, const SparseParams& S, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> topk(static_cast<size_t>(B.hidx) * B.T * S.K, -1);
  for (size_t b = 0; b < B.q_len.size(); ++b)
    for (int64_t t = B.q_indptr[b]; t < B.q_indptr[b + 1]; ++t) {
      const int nvis = B.pos(static_cast<int>(b), t) / S.B + 1;
      for (int h = 0; h < B.hidx; ++h) {
        std::set<int> sel{nvis - 1};
        const int want = std::min<int>(S.K, nvis) - static_cast<int>(rng() % 2) * (nvis > 2);
        while (static_cast<int>(sel.size()) < std::max(1, want)) sel.insert(static_cast<int>(rng() % nvis));
        int k = 0;
        for (int c : sel) topk[(h * B.T + t) * S.K + k++] = c;
      }
    }
  return topk;
}

// Attention reference over the union of each group's selected blocks (dense when sel empty).
void ref_attend(const Batch& B, const SparseParams& S, const std::vector<int32_t>* topk,
                bool decode_rows, std::vector<double>& o, std::vector<double>& lse) {
  const int rows = static_cast<int>(B.T);
  o.assign(static_cast<size_t>(rows) * B.hq * B.d, 0);
  lse.assign(static_cast<size_t>(rows) * B.hq, 0);
  const int G = B.hq / B.hkv, R = B.hidx / B.hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(B.d));
  (void)decode_rows;
  for (size_t b = 0; b < B.q_len.size(); ++b)
    for (int64_t t = B.q_indptr[b]; t < B.q_indptr[b + 1]; ++t) {
      const int p = B.pos(static_cast<int>(b), t);
      for (int g = 0; g < B.hkv; ++g) {
        std::vector<int> keys;
        if (topk) {
          std::set<int> blocks;
          for (int ih = g * R; ih < (g + 1) * R; ++ih)
            for (int k = 0; k < S.K; ++k) {
              const int c = (*topk)[(ih * B.T + t) * S.K + k];
              if (c >= 0) blocks.insert(c);
            }
          for (int c : blocks)
            for (int j = c * S.B; j < (c + 1) * S.B && j <= p; ++j) keys.push_back(j);
        } else {
          for (int j = 0; j <= p; ++j) keys.push_back(j);
        }
        for (int h = g * G; h < (g + 1) * G; ++h) {
          std::vector<double> s(keys.size());
          double m = -INFINITY;
          for (size_t i = 0; i < keys.size(); ++i) {
            const size_t kb = ((B.tok_off[b] + keys[i]) * B.hkv + g) * B.d;
            double acc = 0;
            for (int x = 0; x < B.d; ++x) acc += B.dec(B.q[(t * B.hq + h) * B.d + x]) * B.dec(B.k[kb + x]);
            s[i] = acc * scale;
            m = std::max(m, s[i]);
          }
          if (S.sink) m = std::max(m, static_cast<double>(B.sink[h]));
          double L = 0;
          std::vector<double> acc(B.d, 0);
          for (size_t i = 0; i < keys.size(); ++i) {
            const double w = std::exp(s[i] - m);
            L += w;
            const size_t vb = ((B.tok_off[b] + keys[i]) * B.hkv + g) * B.d;
            for (int x = 0; x < B.d; ++x) acc[x] += w * B.dec(B.v[vb + x]);
          }
          if (S.sink) L += std::exp(B.sink[h] - m);
          for (int x = 0; x < B.d; ++x) o[(t * B.hq + h) * B.d + x] = L > 0 ? acc[x] / L : 0;
          lse[t * B.hq + h] = L > 0 ? m + std::log(L) : -INFINITY;
        }
      }
    }
}

// ---- device runs -------------------------------------------------------------------------------

// Runs the indexer twice (NaN-poisoned output; repeats must be bit-identical).
std::vector<int32_t> run_index(const Batch& B, const SparseParams& S, const Paging& P, bool decode,
                               double* ms = nullptr, int timed = 0) {
  const int op = decode ? ATTNRT_OP_SPARSE_INDEX_DECODE : ATTNRT_OP_SPARSE_INDEX_EXTEND;
  attnrt_problem p = problem_of(op, B, S, P.ps);
  attnrt_layout L = layout_of(B, P);
  std::vector<int32_t> out(static_cast<size_t>(B.hidx) * B.T * S.K);
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_OK) << g_plugin->last_error();
  attnrt_plan plan = nullptr;
  EXPECT_EQ(g_plugin->plan(&p, &L, &plan), ATTNRT_OK) << g_plugin->last_error();
  if (!plan) return out;
  std::vector<uint16_t> pool = to_pool(B, P, B.ik, 1, B.didx);
  Dev dq(B.iq.size() * 2), dk(pool.size() * 2), dt(out.size() * 4);
  dq.up(B.iq.data(), B.iq.size() * 2);
  dk.up(pool.data(), pool.size() * 2);
  attnrt_tensors ts{};
  ts.index_q = tensor(dq.p, B.dtype, 3, {B.T, B.hidx, B.didx});
  ts.index_k_cache = tensor(dk.p, B.dtype, 4, {P.num_pages, P.ps, 1, B.didx});
  ts.topk = tensor(dt.p, ATTNRT_I32, 3, {B.hidx, B.T, S.K});
  std::vector<int32_t> first;
  for (int rep = 0; rep < 2; ++rep) {
    std::vector<int32_t> poison(out.size(), -7);
    dt.up(poison.data(), poison.size() * 4);
    EXPECT_EQ(g_plugin->run(plan, &ts, nullptr), ATTNRT_OK) << g_plugin->last_error();
    EXPECT_EQ(g_plugin->synchronize({1, 0}), ATTNRT_OK) << g_plugin->last_error();
    dt.down(out.data(), out.size() * 4);
    if (rep == 0) first = out;
  }
  EXPECT_EQ(first, out) << "indexer repeat not bit-identical";
  if (ms && timed > 0) {
    for (int i = 0; i < 3; ++i) g_plugin->run(plan, &ts, nullptr);
    g_plugin->synchronize({1, 0});
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < timed; ++i) g_plugin->run(plan, &ts, nullptr);
    g_plugin->synchronize({1, 0});
    *ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
          timed;
  }
  g_plugin->destroy_plan(plan);
  return out;
}

struct AttendOut {
  std::vector<uint16_t> o;
  std::vector<float> lse;
};

// op: sparse_attend_* (topk given) or dense_* (topk ignored). Two runs, bit-identical.
AttendOut run_attend(int op, const Batch& B, const SparseParams& S, const Paging& P,
                     const std::vector<int32_t>* topk, double* ms = nullptr, int timed = 0) {
  attnrt_problem p = problem_of(op, B, S, P.ps);
  attnrt_layout L = layout_of(B, P);
  AttendOut r;
  r.o.resize(static_cast<size_t>(B.T) * B.hq * B.d);
  r.lse.resize(static_cast<size_t>(B.T) * B.hq);
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_OK) << g_plugin->last_error();
  attnrt_plan plan = nullptr;
  EXPECT_EQ(g_plugin->plan(&p, &L, &plan), ATTNRT_OK) << g_plugin->last_error();
  if (!plan) return r;
  std::vector<uint16_t> kp = to_pool(B, P, B.k, B.hkv, B.d), vp = to_pool(B, P, B.v, B.hkv, B.d);
  Dev dq(B.q.size() * 2), dk(kp.size() * 2), dv(vp.size() * 2), dout(r.o.size() * 2),
      dlse(r.lse.size() * 4), dsink(B.sink.size() * 4), dt(topk ? topk->size() * 4 : 16);
  dq.up(B.q.data(), B.q.size() * 2);
  dk.up(kp.data(), kp.size() * 2);
  dv.up(vp.data(), vp.size() * 2);
  dsink.up(B.sink.data(), B.sink.size() * 4);
  if (topk) dt.up(topk->data(), topk->size() * 4);
  attnrt_tensors ts{};
  ts.q = tensor(dq.p, B.dtype, 3, {B.T, B.hq, B.d});
  ts.k_cache = tensor(dk.p, B.dtype, 4, {P.num_pages, P.ps, B.hkv, B.d});
  ts.v_cache = tensor(dv.p, B.dtype, 4, {P.num_pages, P.ps, B.hkv, B.d});
  ts.out = tensor(dout.p, B.dtype, 3, {B.T, B.hq, B.d});
  if (S.lse) ts.lse = tensor(dlse.p, ATTNRT_F32, 2, {B.T, B.hq});
  if (S.sink) ts.sink = tensor(dsink.p, ATTNRT_F32, 1, {B.hq});
  if (topk) ts.topk = tensor(dt.p, ATTNRT_I32, 3, {B.hidx, B.T, S.K});
  AttendOut first;
  for (int rep = 0; rep < 2; ++rep) {
    std::vector<uint16_t> poison(r.o.size(), 0x7fc1);
    std::vector<float> lp(r.lse.size(), std::numeric_limits<float>::quiet_NaN());
    dout.up(poison.data(), poison.size() * 2);
    dlse.up(lp.data(), lp.size() * 4);
    EXPECT_EQ(g_plugin->run(plan, &ts, nullptr), ATTNRT_OK) << g_plugin->last_error();
    EXPECT_EQ(g_plugin->synchronize({1, 0}), ATTNRT_OK) << g_plugin->last_error();
    dout.down(r.o.data(), r.o.size() * 2);
    dlse.down(r.lse.data(), r.lse.size() * 4);
    if (rep == 0) first = r;
  }
  EXPECT_TRUE(first.o == r.o && std::memcmp(first.lse.data(), r.lse.data(), r.lse.size() * 4) == 0)
      << "attend repeat not bit-identical";
  if (ms && timed > 0) {
    for (int i = 0; i < 3; ++i) g_plugin->run(plan, &ts, nullptr);
    g_plugin->synchronize({1, 0});
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < timed; ++i) g_plugin->run(plan, &ts, nullptr);
    g_plugin->synchronize({1, 0});
    *ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
          timed;
  }
  g_plugin->destroy_plan(plan);
  return r;
}

// Elementwise allclose(atol = rtol = 5e-3) and lse within 1e-3; *worst: the max abs error.
void expect_close(const Batch& B, const SparseParams& S, const AttendOut& got,
                  const std::vector<double>& ro, const std::vector<double>& rl, double* worst) {
  *worst = 0;
  int bad = 0;
  for (size_t i = 0; i < ro.size(); ++i) {
    const double v = B.dec(got.o[i]);
    const double err = std::fabs(v - ro[i]);
    *worst = std::max(*worst, std::isfinite(v) ? err : INFINITY);
    if (!(err <= 5e-3 + 5e-3 * std::fabs(ro[i]))) {
      if (bad++ < 5) ADD_FAILURE() << "out[" << i << "] = " << v << " ref " << ro[i];
    }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << ro.size() << " outputs off";
  if (!S.lse) return;
  for (size_t i = 0; i < rl.size(); ++i) {
    ASSERT_LE(std::fabs(got.lse[i] - rl[i]), 1e-3) << "lse[" << i << "] " << got.lse[i] << " ref " << rl[i];
  }
}

std::vector<int32_t> ones(int n, int v) { return std::vector<int32_t>(n, v); }

// ---- tests -------------------------------------------------------------------------------------

TEST(CudaSparse, ProbeReasons) {
  REQUIRE_GPU();
  Batch B;
  SparseParams S;
  attnrt_problem p = problem_of(ATTNRT_OP_SPARSE_INDEX_DECODE, B, S, 128);
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_OK) << g_plugin->last_error();
  p.index_dim = 96;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("index_dim 96"), std::string::npos);
  p = problem_of(ATTNRT_OP_SPARSE_ATTEND_EXTEND, B, S, 16);
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_OK) << g_plugin->last_error();
  p.head_dim = 256;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("head_dim 256"), std::string::npos);
  p.head_dim = 128;
  p.q_dtype = p.kv_dtype = ATTNRT_F32;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("dtype"), std::string::npos);
}

TEST(CudaSparse, IndexerMatchesReference) {
  REQUIRE_GPU();
  struct C {
    bool decode;
    int dtype, hidx, didx, B, ps, K, init, local, lse, n, ql, kl;
  };
  const C cases[] = {
      {true, ATTNRT_BF16, 1, 128, 128, 128, 16, 0, 1, 0, 3, 1, 4000},
      {true, ATTNRT_BF16, 4, 64, 64, 16, 16, 2, 4, 1, 4, 1, 3000},
      {true, ATTNRT_F16, 8, 64, 32, 64, 5, 0, 1, 0, 8, 1, 1500},   // top-k 5, batched
      {true, ATTNRT_BF16, 1, 128, 128, 256, 1, 0, 1, 1, 2, 1, 900},
      {true, ATTNRT_BF16, 2, 128, 16, 1, 32, 1, 2, 0, 2, 1, 700},
      {false, ATTNRT_BF16, 1, 128, 128, 128, 16, 0, 1, 0, 2, 200, 2500},
      {false, ATTNRT_F16, 4, 128, 64, 32, 8, 2, 4, 1, 2, 90, 1200},
      {false, ATTNRT_BF16, 1, 64, 48, 16, 4, 1, 2, 0, 3, 33, 600},  // block 48: not a chunk multiple
      {false, ATTNRT_BF16, 4, 128, 128, 48, 16, 1, 2, 1, 1, 300, 300},  // no prefix
      {false, ATTNRT_BF16, 2, 32, 16, 16, 4, 1, 1, 0, 2, 40, 300},  // index_dim 32 (tiny preset)
      {true, ATTNRT_F16, 2, 32, 16, 16, 4, 1, 1, 1, 3, 1, 500},
  };
  int it = 0;
  for (const C& c : cases) {
    SCOPED_TRACE(it);
    std::vector<int32_t> ql, kl;
    std::mt19937 rng(50 + it);
    for (int b = 0; b < c.n; ++b) {
      const int q = c.decode ? 1 : 1 + static_cast<int>(rng() % c.ql);
      ql.push_back(q);
      kl.push_back(std::max(q, static_cast<int>(q + rng() % (c.kl - c.ql + 1))));
    }
    Batch B = make_batch(c.dtype, 16, 1, c.hidx, 128, c.didx, ql, kl, 900 + it, false, true);
    SparseParams S;
    S.B = c.B;
    S.K = c.K;
    S.init = c.init;
    S.local = c.local;
    S.score_lse = c.lse;
    Paging P = make_paging(B, c.ps, 77 + it);
    std::vector<int32_t> topk = run_index(B, S, P, c.decode);
    int ties = 0;
    check_topk(B, S, topk, ref_scores(B, S), &ties);
    std::printf("indexer case %d: %d near-tie rows of %lld\n", it, ties,
                static_cast<long long>(B.T * B.hidx));
    std::fflush(stdout);
    ++it;
  }
}

TEST(CudaSparse, AttendMatchesReference) {
  REQUIRE_GPU();
  struct C {
    bool decode;
    int dtype, hq, hkv, hidx, d, B, ps, K, n, ql, kl;
    bool sink, lse;
  };
  const C cases[] = {
      {true, ATTNRT_BF16, 16, 1, 1, 128, 128, 128, 16, 3, 1, 5000, false, true},
      {true, ATTNRT_BF16, 16, 1, 1, 128, 64, 16, 8, 5, 1, 3000, true, true},
      {true, ATTNRT_F16, 32, 8, 8, 64, 32, 64, 16, 4, 1, 1023, false, true},
      {true, ATTNRT_BF16, 8, 4, 4, 64, 64, 256, 1, 6, 1, 769, true, false},
      {true, ATTNRT_BF16, 16, 2, 4, 128, 128, 32, 4, 2, 1, 2600, false, true},  // union R=2
      {true, ATTNRT_BF16, 32, 1, 1, 128, 128, 128, 16, 1, 1, 257, false, true},  // 2 head tiles
      {false, ATTNRT_BF16, 16, 1, 1, 128, 128, 128, 16, 2, 160, 3000, false, true},
      {false, ATTNRT_F16, 16, 2, 4, 64, 64, 16, 8, 2, 70, 1500, true, true},
      {false, ATTNRT_BF16, 8, 1, 2, 128, 48, 1, 6, 2, 40, 700, false, true},   // block 48, page 1
      {false, ATTNRT_BF16, 16, 1, 1, 128, 128, 48, 16, 1, 260, 260, true, true},  // no prefix
  };
  int it = 0;
  for (const C& c : cases) {
    SCOPED_TRACE(it);
    std::vector<int32_t> ql, kl;
    std::mt19937 rng(70 + it);
    for (int b = 0; b < c.n; ++b) {
      const int q = c.decode ? 1 : 1 + static_cast<int>(rng() % c.ql);
      ql.push_back(q);
      kl.push_back(std::max(q, static_cast<int>(q + rng() % (c.kl - c.ql + 1))));
    }
    Batch B = make_batch(c.dtype, c.hq, c.hkv, c.hidx, c.d, 64, ql, kl, 300 + it, true, false);
    SparseParams S;
    S.B = c.B;
    S.K = c.K;
    S.sink = c.sink;
    S.lse = c.lse;
    Paging P = make_paging(B, c.ps, 11 + it);
    std::vector<int32_t> topk = random_topk(B, S, 5 + it);
    const int op = c.decode ? ATTNRT_OP_SPARSE_ATTEND_DECODE : ATTNRT_OP_SPARSE_ATTEND_EXTEND;
    AttendOut got = run_attend(op, B, S, P, &topk);
    std::vector<double> ro, rl;
    ref_attend(B, S, &topk, c.decode, ro, rl);
    double w = 0;
    expect_close(B, S, got, ro, rl, &w);
    std::printf("attend case %d: max abs err %.2e\n", it, w);
    std::fflush(stdout);
    ++it;
  }
}

TEST(CudaSparse, PagedEqualsUnpagedBitForBit) {
  REQUIRE_GPU();
  for (int decode = 0; decode < 2; ++decode) {
    SCOPED_TRACE(decode);
    std::vector<int32_t> ql = decode ? ones(3, 1) : std::vector<int32_t>{512, 100, 7};
    std::vector<int32_t> kl{4096, 2500, 777};
    Batch B = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, ql, kl, 4242);
    SparseParams S;
    S.B = 128;
    S.K = 16;
    S.sink = true;
    Paging P1 = make_paging(B, 1, 0);  // token addressing, in order
    std::vector<int32_t> t1 = run_index(B, S, P1, decode);
    AttendOut a1 = run_attend(decode ? ATTNRT_OP_SPARSE_ATTEND_DECODE : ATTNRT_OP_SPARSE_ATTEND_EXTEND,
                              B, S, P1, &t1);
    for (int ps : {16, 48, 64, 128, 256}) {
      SCOPED_TRACE(ps);
      Paging P = make_paging(B, ps, 1000 + ps);
      std::vector<int32_t> t = run_index(B, S, P, decode);
      EXPECT_EQ(t, t1) << "indexer differs at page " << ps;
      AttendOut a = run_attend(decode ? ATTNRT_OP_SPARSE_ATTEND_DECODE : ATTNRT_OP_SPARSE_ATTEND_EXTEND,
                               B, S, P, &t1);
      EXPECT_TRUE(a.o == a1.o) << "attend out differs at page " << ps;
      EXPECT_EQ(std::memcmp(a.lse.data(), a1.lse.data(), a.lse.size() * 4), 0)
          << "attend lse differs at page " << ps;
    }
  }
}

// Context <= topk * block: every visible block is selected, so indexer + sparse attend is dense
// causal attention (compared with the dense reference and the plugin's dense op).
TEST(CudaSparse, ShortContextEqualsDense) {
  REQUIRE_GPU();
  for (int decode = 0; decode < 2; ++decode) {
    SCOPED_TRACE(decode);
    std::vector<int32_t> ql = decode ? ones(4, 1) : std::vector<int32_t>{300, 64, 1, 129};
    std::vector<int32_t> kl{2048, 1000, 129, 1500};
    Batch B = make_batch(ATTNRT_BF16, 16, 2, 2, 128, 128, ql, kl, 777);
    SparseParams S;
    S.B = 128;
    S.K = 16;
    Paging P = make_paging(B, 64, 9);
    std::vector<int32_t> topk = run_index(B, S, P, decode);
    for (size_t b = 0; b < ql.size(); ++b)
      for (int64_t t = B.q_indptr[b]; t < B.q_indptr[b + 1]; ++t) {
        const int nvis = B.pos(static_cast<int>(b), t) / S.B + 1;
        for (int h = 0; h < B.hidx; ++h)
          for (int k = 0; k < S.K; ++k)
            ASSERT_EQ(topk[(h * B.T + t) * S.K + k], k < nvis ? k : -1);
      }
    AttendOut sp = run_attend(decode ? ATTNRT_OP_SPARSE_ATTEND_DECODE : ATTNRT_OP_SPARSE_ATTEND_EXTEND,
                              B, S, P, &topk);
    std::vector<double> ro, rl;
    ref_attend(B, S, nullptr, decode, ro, rl);  // dense causal
    double w = 0;
    expect_close(B, S, sp, ro, rl, &w);
    AttendOut dn = run_attend(decode ? ATTNRT_OP_DENSE_DECODE : ATTNRT_OP_DENSE_EXTEND, B, S, P, nullptr);
    double worst = 0;
    for (size_t i = 0; i < sp.o.size(); ++i)
      worst = std::max(worst, std::fabs(double(B.dec(sp.o[i])) - B.dec(dn.o[i])));
    EXPECT_LT(worst, 1e-2) << "sparse vs plugin dense";
    std::printf("short context (decode %d): sparse vs plugin dense max abs diff %.2e\n", decode, worst);
    std::fflush(stdout);
  }
}

// Long-context decode, M3 per-rank shape, indexer + attend, checked against the reference.
TEST(CudaSparse, LongContextDecode) {
  REQUIRE_GPU();
  int ctx = 524288;
  if (const char* e = std::getenv("ATTNRT_SPARSE_LONG_CTX")) ctx = std::atoi(e);
  Batch B = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, {1, 1}, {ctx, ctx - 777}, 512);
  SparseParams S;
  S.B = 128;
  S.K = 16;
  S.sink = true;
  Paging P = make_paging(B, 128, 3);
  std::vector<int32_t> topk = run_index(B, S, P, true);
  int ties = 0;
  check_topk(B, S, topk, ref_scores(B, S), &ties);
  AttendOut got = run_attend(ATTNRT_OP_SPARSE_ATTEND_DECODE, B, S, P, &topk);
  std::vector<double> ro, rl;
  ref_attend(B, S, &topk, true, ro, rl);
  double w = 0;
  expect_close(B, S, got, ro, rl, &w);
  std::printf("long context %d: near-tie rows %d, max abs err %.2e\n", ctx, ties, w);
  std::fflush(stdout);
}

// M3 per-rank timings (ATTNRT_GPU_BENCH=1): indexer, attend, their sum, and the plugin's dense
// op on the same shape. Host wall clock over 20 queued runs after 3 warm-ups.
// Sparse decode under a CUDA graph: the indexer and sparse attend of one step captured once;
// update_plan gives both plans new lengths and page lists (same requests) and the replay matches
// the reference each time. The longest step crosses block boundaries, so new blocks appear.
TEST(CudaSparse, DecodeGraphReplaysWithNewLengths) {
  REQUIRE_GPU();
  ASSERT_NE(g_plugin->update_plan, nullptr);
  SparseParams S;
  S.B = 64;
  S.K = 8;
  S.local = 1;
  const std::vector<int32_t> longest = {3000, 5000, 1300};
  const Batch Bmax = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, {1, 1, 1}, longest, 31);
  const Paging Pmax = make_paging(Bmax, 64, 5);
  // The layout of shorter contexts: each request's first pages of the longest layout.
  auto step = [&](const std::vector<int32_t>& kv, Batch* B, Paging* P) {
    *B = Bmax;
    B->kv_len = kv;
    *P = Pmax;
    P->page_indptr.assign(1, 0);
    P->page_ids.clear();
    for (size_t b = 0; b < kv.size(); ++b) {
      const int np = (kv[b] + P->ps - 1) / P->ps;
      P->page_ids.insert(P->page_ids.end(), Pmax.page_ids.begin() + Pmax.page_indptr[b],
                         Pmax.page_ids.begin() + Pmax.page_indptr[b] + np);
      P->page_indptr.push_back(static_cast<int32_t>(P->page_ids.size()));
    }
  };
  const std::vector<std::vector<int32_t>> steps = {
      {2800, 4900, 1000}, {2801, 4901, 1001}, {2880, 4990, 1090}, {3000, 5000, 1300}};
  Batch B;
  Paging P;
  step(steps[0], &B, &P);
  attnrt_layout L = layout_of(B, P);
  const attnrt_problem pi = problem_of(ATTNRT_OP_SPARSE_INDEX_DECODE, B, S, P.ps);
  const attnrt_problem pa = problem_of(ATTNRT_OP_SPARSE_ATTEND_DECODE, B, S, P.ps);
  attnrt_plan plan_i = nullptr, plan_a = nullptr;
  ASSERT_EQ(g_plugin->plan(&pi, &L, &plan_i), ATTNRT_OK) << g_plugin->last_error();
  ASSERT_EQ(g_plugin->plan(&pa, &L, &plan_a), ATTNRT_OK) << g_plugin->last_error();
  const std::vector<uint16_t> ikp = to_pool(Bmax, Pmax, Bmax.ik, 1, Bmax.didx),
                              kp = to_pool(Bmax, Pmax, Bmax.k, 1, Bmax.d),
                              vp = to_pool(Bmax, Pmax, Bmax.v, 1, Bmax.d);
  const size_t n_topk = static_cast<size_t>(B.hidx) * B.T * S.K, n_out = B.q.size();
  Dev diq(B.iq.size() * 2), dik(ikp.size() * 2), dq(B.q.size() * 2), dk(kp.size() * 2),
      dv(vp.size() * 2), dt(n_topk * 4), dout(n_out * 2), dlse(B.T * B.hq * 4);
  diq.up(B.iq.data(), B.iq.size() * 2);
  dik.up(ikp.data(), ikp.size() * 2);
  dq.up(B.q.data(), B.q.size() * 2);
  dk.up(kp.data(), kp.size() * 2);
  dv.up(vp.data(), vp.size() * 2);
  attnrt_tensors ti{}, ta{};
  ti.index_q = tensor(diq.p, B.dtype, 3, {B.T, B.hidx, B.didx});
  ti.index_k_cache = tensor(dik.p, B.dtype, 4, {Pmax.num_pages, Pmax.ps, 1, B.didx});
  ti.topk = tensor(dt.p, ATTNRT_I32, 3, {B.hidx, B.T, S.K});
  ta.q = tensor(dq.p, B.dtype, 3, {B.T, B.hq, B.d});
  ta.k_cache = tensor(dk.p, B.dtype, 4, {Pmax.num_pages, Pmax.ps, 1, B.d});
  ta.v_cache = tensor(dv.p, B.dtype, 4, {Pmax.num_pages, Pmax.ps, 1, B.d});
  ta.out = tensor(dout.p, B.dtype, 3, {B.T, B.hq, B.d});
  ta.lse = tensor(dlse.p, ATTNRT_F32, 2, {B.T, B.hq});
  ta.topk = ti.topk;
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const int32_t ri = g_plugin->run(plan_i, &ti, st);
  const int32_t ra = g_plugin->run(plan_a, &ta, st);
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  ASSERT_EQ(ri, ATTNRT_OK) << g_plugin->last_error();
  ASSERT_EQ(ra, ATTNRT_OK) << g_plugin->last_error();
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE(i);
    step(steps[i], &B, &P);
    L = layout_of(B, P);
    if (i > 0) {
      ASSERT_EQ(g_plugin->update_plan(plan_i, &L), ATTNRT_OK) << g_plugin->last_error();
      ASSERT_EQ(g_plugin->update_plan(plan_a, &L), ATTNRT_OK) << g_plugin->last_error();
    }
    std::vector<int32_t> tpoison(n_topk, -7);
    std::vector<uint16_t> opoison(n_out, 0x7fc1);
    dt.up(tpoison.data(), tpoison.size() * 4);
    dout.up(opoison.data(), opoison.size() * 2);
    ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    std::vector<int32_t> topk(n_topk);
    dt.down(topk.data(), topk.size() * 4);
    int ties = 0;
    check_topk(B, S, topk, ref_scores(B, S), &ties);
    AttendOut got;
    got.o.resize(n_out);
    got.lse.resize(static_cast<size_t>(B.T) * B.hq);
    dout.down(got.o.data(), got.o.size() * 2);
    dlse.down(got.lse.data(), got.lse.size() * 4);
    std::vector<double> ro, rl;
    ref_attend(B, S, &topk, true, ro, rl);
    double worst = 0;
    expect_close(B, S, got, ro, rl, &worst);
  }
  // Past the plan's room (far longer contexts) update_plan refuses instead of misreading.
  Batch Bl = Bmax;
  Bl.kv_len = {200000, 10, 10};
  Paging Pl = make_paging(Bl, 64, 0);
  attnrt_layout Ll = layout_of(Bl, Pl);
  EXPECT_EQ(g_plugin->update_plan(plan_i, &Ll), ATTNRT_UNAVAILABLE);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  g_plugin->destroy_plan(plan_i);
  g_plugin->destroy_plan(plan_a);
}

TEST(CudaSparse, BenchM3) {
  REQUIRE_GPU();
  if (!std::getenv("ATTNRT_GPU_BENCH")) GTEST_SKIP() << "set ATTNRT_GPU_BENCH=1 to time";
  struct Shape {
    const char* name;
    int n, ql, kl;
  };
  const Shape shapes[] = {{"decode 1x64k", 1, 1, 65536},     {"decode 1x128k", 1, 1, 131072},
                          {"decode 16x64k", 16, 1, 65536},   {"decode 64x64k", 64, 1, 65536},
                          {"decode 64x128k", 64, 1, 131072}, {"extend 8192 at 64k", 1, 8192, 65536}};
  for (const Shape& s : shapes) {
    // Random data would take minutes on the host at 64 x 128k: tile a random 1M-token pattern.
    Batch B = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, ones(s.n, s.ql), ones(s.n, 1024), 1);
    const size_t per = 1024;
    B.kv_len = ones(s.n, s.kl);
    B.tok_off.assign(s.n + 1, 0);
    for (int b = 0; b < s.n; ++b) B.tok_off[b + 1] = B.tok_off[b] + s.kl;
    const size_t toks = static_cast<size_t>(B.tok_off[s.n]);
    for (std::vector<uint16_t>* x : {&B.k, &B.v, &B.ik}) {
      const size_t row = 128;
      std::vector<uint16_t> pat(x->begin(), x->begin() + per * row);
      x->resize(toks * row);
      for (size_t i = pat.size(); i < x->size(); i += pat.size())
        std::copy(pat.begin(), pat.begin() + std::min(pat.size(), x->size() - i), x->begin() + i);
    }
    SparseParams S;
    S.B = 128;
    S.K = 16;
    S.lse = false;
    Paging P = make_paging(B, 128, 5);
    const bool dec = s.ql == 1;
    double ti = 0, ta = 0, td = 0;
    std::vector<int32_t> topk = run_index(B, S, P, dec, &ti, 20);
    run_attend(dec ? ATTNRT_OP_SPARSE_ATTEND_DECODE : ATTNRT_OP_SPARSE_ATTEND_EXTEND, B, S, P, &topk,
               &ta, 20);
    run_attend(dec ? ATTNRT_OP_DENSE_DECODE : ATTNRT_OP_DENSE_EXTEND, B, S, P, nullptr, &td,
               dec ? 20 : 2);
    const double ik_bytes = static_cast<double>(toks) * 128 * 2;
    std::printf("BENCH %-20s indexer %8.4f ms (%5.2f TB/s idx-K)  attend %8.4f ms  sum %8.4f ms  "
                "dense %8.4f ms  dense/sum %.2fx\n",
                s.name, ti, ik_bytes / ti / 1e9, ta, ti + ta, td, td / (ti + ta));
    std::fflush(stdout);
  }
}

}  // namespace
