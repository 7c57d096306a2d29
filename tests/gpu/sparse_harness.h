// Shared by the sparse GPU test binaries (generic plugin and the sm90 fast path): batches of
// random data with a paged placement, the double-precision host references of the indexer and
// of sparse attend, the top-k checker, and one-call runners of a plugin's op (outputs poisoned,
// repeats bit-identical). Include once per test binary, after plugin_harness.h.
#pragma once

#include <cuda_runtime.h>

#include "attnrt/problem.h"
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

// Functions here are not inline: each test binary includes this header in its one source file.
namespace sparse_test {

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

// A decode step of shorter contexts than (Bmax, Pmax): the same data, kv_len = kv, and each
// request's first pages of Pmax (as a cache holds them while the sequences grow).
void shorter_step(const Batch& Bmax, const Paging& Pmax, const std::vector<int32_t>& kv, Batch* B,
                  Paging* P) {
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

// Mean time of `timed` runs queued back to back after 3 warm-ups (host clock, warm L2).
double queued_ms(const attnrt_plugin_v1* pg, attnrt_plan plan, const attnrt_tensors& ts, int timed) {
  for (int i = 0; i < 3; ++i) pg->run(plan, &ts, nullptr);
  pg->synchronize({1, 0});
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < timed; ++i) pg->run(plan, &ts, nullptr);
  pg->synchronize({1, 0});
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
         timed;
}

struct AttendOut {
  std::vector<uint16_t> o;
  std::vector<float> lse;
};

// A batch on cuda:0: the inputs of `op` (the caches scattered into P's page pool; sparse_decode:
// every input of the indexer and of the attend) and a buffer for every output. tensors(op) views
// what `op`, or a step of it, reads and writes (sink and lse as S asks, topk for the sparse ops);
// poison() fills the outputs with values no op writes; topk_host() and att_host() read them back.
// A graph test builds it from the longest step's (Bmax, Pmax): shorter steps keep the same pool
// and query rows.
struct DeviceBatch {
  const Batch& B;
  const Paging& P;
  const SparseParams S;
  Dev iq, ik, q, k, v, sink, topk, out, lse;
  DeviceBatch(const Batch& b, const Paging& p, const SparseParams& s, int op)
      : B(b), P(p), S(s), iq(index(op) ? b.iq.size() * 2 : 0),
        ik(index(op) ? pool_bytes(b.hidx, b.didx) : 0), q(attention(op) ? b.q.size() * 2 : 0),
        k(attention(op) ? pool_bytes(b.hkv, b.d) : 0),
        v(attention(op) ? pool_bytes(b.hkv, b.d) : 0), sink(b.sink.size() * 4),
        topk(topk_count() * 4), out(out_count() * 2), lse(lse_count() * 4) {
    if (index(op)) {
      iq.up(B.iq.data(), B.iq.size() * 2);
      upload_pool(ik, B.ik, 1, B.didx);
    }
    if (attention(op)) {
      q.up(B.q.data(), B.q.size() * 2);
      upload_pool(k, B.k, B.hkv, B.d);
      upload_pool(v, B.v, B.hkv, B.d);
    }
    sink.up(B.sink.data(), B.sink.size() * 4);
  }
  // The op families of attnrt/problem.h (ATTNRT_OP_* and attnrt::Op share their numbers).
  static_assert(static_cast<int>(attnrt::Op::dense_extend) == ATTNRT_OP_DENSE_EXTEND &&
                static_cast<int>(attnrt::Op::sparse_decode) == ATTNRT_OP_SPARSE_DECODE &&
                attnrt::kNumOps == ATTNRT_OP_SPARSE_DECODE + 1);
  static bool index(int op) { return attnrt::reads_index_inputs(static_cast<attnrt::Op>(op)); }
  static bool attention(int op) {
    return attnrt::reads_attention_inputs(static_cast<attnrt::Op>(op));
  }
  static bool dense(int op) { return attnrt::is_dense(static_cast<attnrt::Op>(op)); }
  size_t pool_bytes(int h, int d) const {
    return static_cast<size_t>(P.num_pages) * P.ps * h * d * 2;
  }
  void upload_pool(Dev& dst, const std::vector<uint16_t>& x, int h, int d) {
    const std::vector<uint16_t> pool = to_pool(B, P, x, h, d);
    dst.up(pool.data(), pool.size() * 2);
  }
  size_t topk_count() const { return static_cast<size_t>(B.hidx) * B.T * S.K; }
  size_t out_count() const { return static_cast<size_t>(B.T) * B.hq * B.d; }
  size_t lse_count() const { return static_cast<size_t>(B.T) * B.hq; }
  attnrt_tensors tensors(int op) const {
    attnrt_tensors ts{};
    if (index(op)) {
      ts.index_q = tensor(iq.p, B.dtype, 3, {B.T, B.hidx, B.didx});
      ts.index_k_cache = tensor(ik.p, B.dtype, 4, {P.num_pages, P.ps, 1, B.didx});
    }
    if (!dense(op)) ts.topk = tensor(topk.p, ATTNRT_I32, 3, {B.hidx, B.T, S.K});
    if (attention(op)) {
      ts.q = tensor(q.p, B.dtype, 3, {B.T, B.hq, B.d});
      ts.k_cache = tensor(k.p, B.dtype, 4, {P.num_pages, P.ps, B.hkv, B.d});
      ts.v_cache = tensor(v.p, B.dtype, 4, {P.num_pages, P.ps, B.hkv, B.d});
      ts.out = tensor(out.p, B.dtype, 3, {B.T, B.hq, B.d});
      if (S.lse) ts.lse = tensor(lse.p, ATTNRT_F32, 2, {B.T, B.hq});
      if (S.sink) ts.sink = tensor(sink.p, ATTNRT_F32, 1, {B.hq});
    }
    return ts;
  }
  // Topk (an op's output) to -7, out to a NaN bit pattern, lse to NaN.
  void poison() {
    std::vector<int32_t> tp(topk_count(), -7);
    std::vector<uint16_t> op(out_count(), 0x7fc1);
    std::vector<float> lp(lse_count(), std::numeric_limits<float>::quiet_NaN());
    topk.up(tp.data(), tp.size() * 4);
    out.up(op.data(), op.size() * 2);
    lse.up(lp.data(), lp.size() * 4);
  }
  void put_topk(const std::vector<int32_t>& t) {
    if (t.size() != topk_count()) {
      ADD_FAILURE() << "topk of " << t.size() << " entries for a batch of " << topk_count();
      return;
    }
    topk.up(t.data(), t.size() * 4);
  }
  std::vector<int32_t> topk_host() const {
    std::vector<int32_t> t(topk_count());
    topk.down(t.data(), t.size() * 4);
    return t;
  }
  AttendOut att_host() const {
    AttendOut r;
    r.o.resize(out_count());
    r.lse.resize(lse_count());
    out.down(r.o.data(), r.o.size() * 2);
    lse.down(r.lse.data(), r.lse.size() * 4);
    return r;
  }
};

// One op through `plug` (default: the binary's plugin) on `D`: planned, run twice over poisoned
// outputs (a sparse attend's given topk re-uploaded each time); the second run's outputs must
// equal the first's bit for bit. *ms: mean time of `timed` queued runs after 3 warm-ups.
void run_twice(int op, DeviceBatch& D, const std::vector<int32_t>* topk_in, double* ms,
               int timed, const attnrt_plugin_v1* plug, std::vector<int32_t>* topk_out,
               AttendOut* att) {
  const attnrt_plugin_v1* pg = plug ? plug : g_plugin;
  attnrt_problem p = problem_of(op, D.B, D.S, D.P.ps);
  attnrt_layout L = layout_of(D.B, D.P);
  EXPECT_EQ(pg->probe(&p), ATTNRT_OK) << pg->last_error();
  attnrt_plan plan = nullptr;
  EXPECT_EQ(pg->plan(&p, &L, &plan), ATTNRT_OK) << pg->last_error();
  if (!plan) return;
  const attnrt_tensors ts = D.tensors(op);
  std::vector<int32_t> first_topk;
  AttendOut first_att;
  for (int rep = 0; rep < 2; ++rep) {
    D.poison();
    if (topk_in) D.put_topk(*topk_in);
    EXPECT_EQ(pg->run(plan, &ts, nullptr), ATTNRT_OK) << pg->last_error();
    EXPECT_EQ(pg->synchronize({1, 0}), ATTNRT_OK) << pg->last_error();
    if (topk_out) *topk_out = D.topk_host();
    if (att) *att = D.att_host();
    if (rep == 0) {
      if (topk_out) first_topk = *topk_out;
      if (att) first_att = *att;
    }
  }
  if (topk_out) {
    EXPECT_EQ(first_topk, *topk_out) << "op " << op << " repeat: topk not bit-identical";
  }
  if (att) {
    EXPECT_TRUE(first_att.o == att->o &&
                std::memcmp(first_att.lse.data(), att->lse.data(), att->lse.size() * 4) == 0)
        << "op " << op << " repeat: out or lse not bit-identical";
  }
  if (ms && timed > 0) *ms = queued_ms(pg, plan, ts, timed);
  pg->destroy_plan(plan);
}

// The indexer (decode or extend): its topk, from run_twice. The overloads on a DeviceBatch let
// several calls share one device copy of a batch (D built for an op that reads what they read,
// e.g. sparse_decode for both indexer and attend).
std::vector<int32_t> run_index(DeviceBatch& D, bool decode, double* ms = nullptr, int timed = 0,
                               const attnrt_plugin_v1* plug = nullptr) {
  const int op = decode ? ATTNRT_OP_SPARSE_INDEX_DECODE : ATTNRT_OP_SPARSE_INDEX_EXTEND;
  std::vector<int32_t> out(D.topk_count());
  run_twice(op, D, nullptr, ms, timed, plug, &out, nullptr);
  return out;
}
std::vector<int32_t> run_index(const Batch& B, const SparseParams& S, const Paging& P, bool decode,
                               double* ms = nullptr, int timed = 0,
                               const attnrt_plugin_v1* plug = nullptr) {
  DeviceBatch D(B, P, S,
                decode ? ATTNRT_OP_SPARSE_INDEX_DECODE : ATTNRT_OP_SPARSE_INDEX_EXTEND);
  return run_index(D, decode, ms, timed, plug);
}

// op: sparse_attend_* (on the given topk) or dense_* (topk ignored): out and lse, from run_twice.
AttendOut run_attend(int op, DeviceBatch& D, const std::vector<int32_t>* topk,
                     double* ms = nullptr, int timed = 0,
                     const attnrt_plugin_v1* plug = nullptr) {
  AttendOut r;
  r.o.resize(D.out_count());
  r.lse.resize(D.lse_count());
  run_twice(op, D, DeviceBatch::dense(op) ? nullptr : topk, ms, timed, plug, nullptr, &r);
  return r;
}
AttendOut run_attend(int op, const Batch& B, const SparseParams& S, const Paging& P,
                     const std::vector<int32_t>* topk, double* ms = nullptr, int timed = 0,
                     const attnrt_plugin_v1* plug = nullptr) {
  DeviceBatch D(B, P, S, op);
  return run_attend(op, D, topk, ms, timed, plug);
}

// sparse_decode (indexer, then attend on its selections, in one call): both its outputs, from
// run_twice.
struct SparseDecodeOut {
  std::vector<int32_t> topk;
  AttendOut att;
};
SparseDecodeOut run_sparse_decode(DeviceBatch& D, double* ms = nullptr, int timed = 0,
                                  const attnrt_plugin_v1* plug = nullptr) {
  SparseDecodeOut r;
  r.topk.resize(D.topk_count());
  r.att.o.resize(D.out_count());
  r.att.lse.resize(D.lse_count());
  run_twice(ATTNRT_OP_SPARSE_DECODE, D, nullptr, ms, timed, plug, &r.topk, &r.att);
  return r;
}
SparseDecodeOut run_sparse_decode(const Batch& B, const SparseParams& S, const Paging& P,
                                  double* ms = nullptr, int timed = 0,
                                  const attnrt_plugin_v1* plug = nullptr) {
  DeviceBatch D(B, P, S, ATTNRT_OP_SPARSE_DECODE);
  return run_sparse_decode(D, ms, timed, plug);
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

}  // namespace sparse_test
