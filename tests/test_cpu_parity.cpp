// cpu backend vs an independent double-precision naive implementation written here (spec
// minimax-sparse.md §3-§5), on random shapes; outputs poisoned first; repeats bit-identical.
// Every test runs once per kernel set (AVX-512 with BF16, AVX-512, AVX2, baseline) and skips the
// ones the CPU lacks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>

#include "backends/cpu/cpu_backend.h"
#include "backends/reference/reference_backend.h"
#include "support.h"

namespace attnrt {
// gtest (and ctest's test names) print a CpuIsa parameter by name.
void PrintTo(CpuIsa isa, std::ostream* os) {
  *os << cpu_isa_name(isa);
}
}  // namespace attnrt

namespace attnrt::test {
namespace {

struct Case {
  BatchLayout layout;
  int num_pages = 0;
};

Case make_case(std::mt19937_64& rng, int page_size, int nreq, bool decode, int max_kv) {
  std::vector<int32_t> ql, kl;
  for (int b = 0; b < nreq; ++b) {
    int kv = 1 + static_cast<int>(rng() % max_kv);
    kl.push_back(kv);
    ql.push_back(decode ? 1 : 1 + static_cast<int>(rng() % std::min(kv, 40)));
  }
  int total = 0;
  for (int kv : kl) total += (kv + page_size - 1) / page_size;
  std::vector<int32_t> perm(total);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<int32_t>> pages;
  int at = 0;
  for (int kv : kl) {
    int n = (kv + page_size - 1) / page_size;
    pages.emplace_back(perm.begin() + at, perm.begin() + at + n);
    at += n;
  }
  return {BatchLayout::make(page_size, ql, kl, pages), total};
}

double kv_at(const HostTensor& c, const BatchLayout& L, int b, int64_t j, int h, int x) {
  int64_t page = L.page_ids[L.page_indptr[b] + j / L.page_size];
  return c.get(c.view.offset({page, j % L.page_size, h, x}));
}

// Naive attention (dense or sparse) in double.
void naive_attend(const Problem& p, const BatchLayout& L, const HostTensor& q, const HostTensor& k,
                  const HostTensor& v, const HostTensor* sink, const HostTensor* topk,
                  HostTensor& out, HostTensor& lse) {
  const int Hq = p.num_q_heads, Hkv = p.num_kv_heads, D = p.head_dim, G = Hq / Hkv;
  const double sc = p.effective_sm_scale();
  for (int b = 0; b < L.num_requests(); ++b)
    for (int64_t r = L.q_indptr[b]; r < L.q_indptr[b + 1]; ++r) {
      int64_t pos = L.kv_len[b] - L.q_len[b] + (r - L.q_indptr[b]);
      for (int hq = 0; hq < Hq; ++hq) {
        int g = hq / G;
        std::vector<int64_t> J;
        for (int64_t j = 0; j <= pos; ++j) {
          bool ok = true;
          if (topk) {
            ok = false;
            int R = p.num_index_heads / Hkv;
            for (int i = 0; i < R && !ok; ++i)
              for (int kk = 0; kk < p.topk; ++kk)
                if (static_cast<const int32_t*>(topk->view.data)[topk->view.offset({g * R + i, r, kk})] ==
                    j / p.block_size)
                  ok = true;
          }
          if (ok) J.push_back(j);
        }
        std::vector<double> z;
        double m = -INFINITY;
        for (int64_t j : J) {
          double d = 0;
          for (int x = 0; x < D; ++x) d += q.get(q.view.offset({r, hq, x})) * kv_at(k, L, b, j, g, x);
          z.push_back(d * sc);
          m = std::max(m, z.back());
        }
        double sk = sink ? sink->get(hq) : -INFINITY;
        m = std::max(m, sk);
        double Ls = sink ? std::exp(sk - m) : 0.0;
        for (double zz : z) Ls += std::exp(zz - m);
        for (int x = 0; x < D; ++x) {
          double o = 0;
          for (size_t i = 0; i < J.size(); ++i) o += std::exp(z[i] - m) * kv_at(v, L, b, J[i], g, x);
          out.set(out.view.offset({r, hq, x}), Ls > 0 ? static_cast<float>(o / Ls) : 0.f);
        }
        lse.set(lse.view.offset({r, hq}), Ls > 0 ? static_cast<float>(m + std::log(Ls)) : -INFINITY);
      }
    }
}

// The cpu backend with the kernel set of the test's parameter; skips when the CPU lacks it.
class CpuParity : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!cpu_supports(GetParam()))
      GTEST_SKIP() << "this CPU lacks " << cpu_isa_name(GetParam()) << " (it has "
                   << cpu_isa_name(supported_cpu_isa()) << ")";
    be_ = make_cpu_backend(2, GetParam());
  }
  std::unique_ptr<Backend> be_;
};

std::unique_ptr<BackendPlan> plan_of(Backend& be, const Problem& p, const BatchLayout& L,
                                     Workspace& ws) {
  EXPECT_TRUE(be.probe(p).available) << be.probe(p).reason;
  return be.plan(p, L, ws);
}

// Runs one attention problem on the cpu backend and checks it against naive_attend: tolerance,
// no NaN, bit-identical repeat. minimal_selection: sparse rows select only their own block.
void check_attend(Backend& be, Workspace& ws, const Problem& p, const Case& c,
                  std::mt19937_64& rng, bool minimal_selection = false) {
  const bool sparse = reads_topk_input(p.op);
  const BatchLayout& L = c.layout;
  const int64_t T = L.total_q();
  const int D = p.head_dim;
  HostTensor q(p.q_dtype, {T, p.num_q_heads, D});
  HostTensor k(p.kv_dtype, {c.num_pages, p.page_size, p.num_kv_heads, D});
  HostTensor v(p.kv_dtype, {c.num_pages, p.page_size, p.num_kv_heads, D});
  HostTensor sink(DType::f32, {p.num_q_heads});
  HostTensor topk(DType::i32, {std::max(1, p.num_index_heads), T, std::max(1, p.topk)});
  fill_normal(q, rng);
  fill_normal(k, rng);
  fill_normal(v, rng);
  fill_normal(sink, rng);
  // Random legal selections: ascending unique visible block ids, own block always in.
  for (int b = 0; sparse && b < L.num_requests(); ++b)
    for (int64_t r = L.q_indptr[b]; r < L.q_indptr[b + 1]; ++r) {
      int64_t pos = L.kv_len[b] - L.q_len[b] + (r - L.q_indptr[b]);
      int nvis = static_cast<int>(pos / p.block_size + 1);
      for (int h = 0; h < p.num_index_heads; ++h) {
        std::vector<int32_t> ids(nvis);
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end() - 1, rng);
        std::swap(ids[0], ids.back());
        int n = minimal_selection ? 1 : std::min(p.topk, nvis);
        std::sort(ids.begin(), ids.begin() + n);
        auto* o = static_cast<int32_t*>(topk.view.data);
        for (int kk = 0; kk < p.topk; ++kk) o[topk.view.offset({h, r, kk})] = kk < n ? ids[kk] : -1;
      }
    }
  HostTensor out(p.q_dtype, {T, p.num_q_heads, D}), lse(DType::f32, {T, p.num_q_heads});
  HostTensor ro(p.q_dtype, {T, p.num_q_heads, D}), rl(DType::f32, {T, p.num_q_heads});
  poison(out);
  poison(lse);
  Tensors t;
  t.q = q.view;
  t.k_cache = k.view;
  t.v_cache = v.view;
  t.out = out.view;
  t.lse = lse.view;
  if (p.has_sink) t.sink = sink.view;
  if (sparse) t.topk = topk.view;
  auto pl = plan_of(be, p, L, ws);
  be.run(*pl, p, L, t, ws);
  naive_attend(p, L, q, k, v, p.has_sink ? &sink : nullptr, sparse ? &topk : nullptr, ro, rl);
  SCOPED_TRACE(p.describe());
  EXPECT_FALSE(has_nan(out));
  if (p.q_dtype == DType::f32) {
    EXPECT_LE(rel_l2(out, ro), 1e-5);
  } else {
    EXPECT_TRUE(allclose(out, ro, 5e-3, 5e-3)) << max_abs_diff(out, ro);
  }
  EXPECT_LE(max_abs_diff(lse, rl), 1e-3);
  // Bit-identical repeat, lse included.
  HostTensor out2(p.q_dtype, {T, p.num_q_heads, D}), lse2(DType::f32, {T, p.num_q_heads});
  poison(out2);
  poison(lse2);
  t.out = out2.view;
  t.lse = lse2.view;
  be.run(*pl, p, L, t, ws);
  EXPECT_EQ(0, std::memcmp(out.view.data, out2.view.data, out.bytes.size()));
  EXPECT_EQ(0, std::memcmp(lse.view.data, lse2.view.data, lse.bytes.size()));
}

TEST_P(CpuParity, AttendSweep) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Backend& be = *be_;
  Workspace ws(Device::cpu(), std::make_shared<HostMemory>());
  const int page_sizes[] = {1, 16, 64, 128};
  const DType dtypes[] = {DType::bf16, DType::f32, DType::f16};
  for (int it = 0; it < 18; ++it) {
    Problem p;
    const bool sparse = it % 2 == 1;
    const bool decode = it % 4 >= 2;
    p.op = sparse ? (decode ? Op::sparse_attend_decode : Op::sparse_attend_extend)
                  : (decode ? Op::dense_decode : Op::dense_extend);
    p.q_dtype = p.kv_dtype = dtypes[it % 3];
    p.page_size = page_sizes[it % 4];
    p.num_kv_heads = 1 + static_cast<int>(rng() % 2);
    const int G = 1 << (rng() % 5);
    p.num_q_heads = p.num_kv_heads * G;
    // 37 and 40: remainders of every register blocking (dims in blocks of 16, 12, 6, 4, 2, 1);
    // 37 with bf16 too (iteration 6), which the bf16 dot-product tiles leave to the f32 tiles.
    p.head_dim = (it % 5 == 0) ? 128 : (it % 7 == 3 ? 40 : (it % 9 == 4 || it % 9 == 6 ? 37 : 64));
    p.has_sink = rng() % 2;
    p.write_lse = true;
    p.block_size = 16;
    p.topk = 1 + static_cast<int>(rng() % 8);
    p.num_index_heads = p.num_kv_heads * (1 + static_cast<int>(rng() % 2));
    Case c = make_case(rng, p.page_size, 1 + static_cast<int>(rng() % 4), decode, 150);
    check_attend(be, ws, p, c, rng);
  }
}

// Long-context decode with few requests: the plan splits the keys (split-KV) and merges the
// partial results by their lse. Every dtype; GQA 16:1 and 4:1; sparse rows that select only a
// 2-token block, so most splits are empty (they must contribute nothing and never NaN).
TEST_P(CpuParity, SplitKvDecode) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Backend& be = *be_;
  Workspace ws(Device::cpu(), std::make_shared<HostMemory>());
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  for (int it = 0; it < 8; ++it) {
    Problem p;
    const bool sparse = it % 2 == 1;
    p.op = sparse ? Op::sparse_attend_decode : Op::dense_decode;
    p.q_dtype = p.kv_dtype = dtypes[it % 3];
    p.page_size = it % 4 < 2 ? 16 : 128;
    p.num_kv_heads = 1;
    p.num_q_heads = it % 3 == 2 ? 4 : 16;
    p.head_dim = 128;
    p.has_sink = it % 4 == 3;
    p.write_lse = true;
    p.block_size = 64;
    p.topk = 32;
    p.num_index_heads = 1;
    const int nreq = 1 + static_cast<int>(rng() % 2);
    std::vector<int32_t> ql(nreq, 1), kl;
    for (int b = 0; b < nreq; ++b)
      kl.push_back(it == 7 ? 64 * 60 + 2 : 3000 + static_cast<int>(rng() % 6000));
    int total = 0;
    std::vector<std::vector<int32_t>> pages;
    for (int kv : kl) {
      std::vector<int32_t> pg((kv + p.page_size - 1) / p.page_size);
      for (auto& x : pg) x = total++;
      std::shuffle(pg.begin(), pg.end(), rng);
      pages.push_back(pg);
    }
    Case c{BatchLayout::make(p.page_size, ql, kl, pages), total};
    check_attend(be, ws, p, c, rng, /*minimal_selection=*/it == 7);
  }
}

// Checks every top-k row of an indexer's output against naive block scores in double: ids in
// range, ascending, -1 padding after min(topk, visible blocks), and each selected block scoring
// at least the k-th best (up to near-ties: the selection is compared as a set, spec §3).
void expect_topk_rows_valid(const Problem& p, const BatchLayout& L, const HostTensor& iq,
                            const HostTensor& ik, const HostTensor& topk) {
  const double s = p.effective_index_scale();
  const auto* got = static_cast<const int32_t*>(topk.view.data);
  for (int b = 0; b < L.num_requests(); ++b)
    for (int64_t r = L.q_indptr[b]; r < L.q_indptr[b + 1]; ++r) {
      int64_t pos = L.kv_len[b] - L.q_len[b] + (r - L.q_indptr[b]);
      int nvis = static_cast<int>(pos / p.block_size + 1);
      for (int h = 0; h < p.num_index_heads; ++h) {
        std::vector<double> S(nvis);
        for (int cc = 0; cc < nvis; ++cc) {
          double mx = -INFINITY, acc = 0;
          std::vector<double> z;
          for (int64_t j = cc * p.block_size; j < (cc + 1) * p.block_size && j <= pos; ++j) {
            double d = 0;
            for (int x = 0; x < p.index_dim; ++x)
              d += iq.get(iq.view.offset({r, h, x})) * kv_at(ik, L, b, j, 0, x);
            z.push_back(d * s);
            mx = std::max(mx, d * s);
          }
          for (double zz : z) acc += std::exp(zz - mx);
          S[cc] = p.score_type == ScoreType::max ? mx : mx + std::log(acc);
          if (cc < p.init_blocks) S[cc] = 1e30;
          if (cc >= nvis - p.local_blocks) S[cc] = 1e29;
        }
        int keff = std::min(p.topk, nvis);
        std::vector<double> sorted = S;
        std::sort(sorted.rbegin(), sorted.rend());
        const double thr = sorted[keff - 1];
        for (int kk = 0; kk < p.topk; ++kk) {
          int32_t id = got[topk.view.offset({h, r, kk})];
          if (kk >= keff) {
            EXPECT_EQ(id, -1);
            continue;
          }
          ASSERT_GE(id, 0);
          ASSERT_LT(id, nvis);
          if (kk > 0) {
            EXPECT_LT(got[topk.view.offset({h, r, kk - 1})], id);
          }
          // Set equality up to near-ties at the threshold.
          EXPECT_GE(S[id], thr - 1e-3 * std::max(1.0, std::abs(thr)));
        }
      }
    }
}

TEST_P(CpuParity, IndexTopkAsSet) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Backend& be = *be_;
  Workspace ws(Device::cpu(), std::make_shared<HostMemory>());
  for (int it = 0; it < 8; ++it) {
    Problem p;
    const bool decode = it % 2;
    p.op = decode ? Op::sparse_index_decode : Op::sparse_index_extend;
    p.q_dtype = p.kv_dtype = it % 3 == 0 ? DType::bf16 : (it % 3 == 1 ? DType::f32 : DType::f16);
    // Iterations 1 and 3: one index head (the single-row decode path), 3 with pages of 7 keys so
    // that blocks of 16 span pages.
    p.page_size = (it % 4 == 0) ? 1 : (it == 3 ? 7 : 16);
    p.num_index_heads = decode && it < 4 ? 1 : 1 + static_cast<int>(rng() % 3);
    p.index_dim = 64;
    p.block_size = 16;
    p.topk = 1 + static_cast<int>(rng() % 12);
    p.init_blocks = (it % 4 == 3 && p.topk >= 3) ? 1 : 0;
    p.local_blocks = (it % 4 >= 2 && p.topk >= 3) ? 2 : 0;
    p.score_type = it % 3 == 1 ? ScoreType::lse : ScoreType::max;
    Case c = make_case(rng, p.page_size, 1 + static_cast<int>(rng() % 4), decode, 300);
    const BatchLayout& L = c.layout;
    const int64_t T = L.total_q();
    HostTensor iq(p.q_dtype, {T, p.num_index_heads, p.index_dim});
    HostTensor ik(p.kv_dtype, {c.num_pages, p.page_size, 1, p.index_dim});
    HostTensor topk(DType::i32, {p.num_index_heads, T, p.topk});
    fill_normal(iq, rng);
    fill_normal(ik, rng);
    poison(topk);
    Tensors t;
    t.index_q = iq.view;
    t.index_k_cache = ik.view;
    t.topk = topk.view;
    auto pl = plan_of(be, p, L, ws);
    be.run(*pl, p, L, t, ws);
    SCOPED_TRACE(p.describe());
    expect_topk_rows_valid(p, L, iq, ik, topk);
  }
}

// Fresh inputs of one sparse_decode call, outputs poisoned (topk included).
struct SparseDecodeData {
  HostTensor q, k, v, sink, iq, ik, topk, out, lse;
  SparseDecodeData(const Problem& p, const Case& c, std::mt19937_64& rng) {
    const int64_t T = c.layout.total_q();
    q = HostTensor(p.q_dtype, {T, p.num_q_heads, p.head_dim});
    k = HostTensor(p.kv_dtype, {c.num_pages, p.page_size, p.num_kv_heads, p.head_dim});
    v = HostTensor(p.kv_dtype, {c.num_pages, p.page_size, p.num_kv_heads, p.head_dim});
    sink = HostTensor(DType::f32, {p.num_q_heads});
    iq = HostTensor(p.q_dtype, {T, p.num_index_heads, p.index_dim});
    ik = HostTensor(p.kv_dtype, {c.num_pages, p.page_size, 1, p.index_dim});
    for (HostTensor* t : {&q, &k, &v, &sink, &iq, &ik}) fill_normal(*t, rng);
    topk = HostTensor(DType::i32, {p.num_index_heads, T, p.topk});
    out = HostTensor(p.q_dtype, {T, p.num_q_heads, p.head_dim});
    lse = HostTensor(DType::f32, {T, p.num_q_heads});
    poison_outputs();
  }
  void poison_outputs() {
    poison(topk);
    poison(out);
    poison(lse);
  }
  Tensors tensors(const Problem& p) {
    Tensors t;
    t.q = q.view;
    t.k_cache = k.view;
    t.v_cache = v.view;
    t.out = out.view;
    t.lse = lse.view;
    if (p.has_sink) t.sink = sink.view;
    t.index_q = iq.view;
    t.index_k_cache = ik.view;
    t.topk = topk.view;
    return t;
  }
};

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.bytes.size() == b.bytes.size() &&
         std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0;
}

// sparse_decode on the cpu backend: its top-k rows pass the indexer's check against the naive
// scores (sets, up to near-ties), its out and lse match the reference backend's attention over
// those selections within the sparse decode tolerances, and it equals the cpu backend's own
// sparse_index_decode then sparse_attend_decode bit for bit. Short and long contexts (up to 250
// blocks to choose from), every dtype, GQA, two index heads per KV head, forced blocks, both score
// types, sink or not.
TEST_P(CpuParity, SparseDecode) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Backend& be = *be_;
  Workspace ws(Device::cpu(), std::make_shared<HostMemory>());
  const DType dtypes[] = {DType::bf16, DType::f32, DType::f16};
  const int page_sizes[] = {16, 1, 128, 7};
  for (int it = 0; it < 8; ++it) {
    Problem p;
    p.op = Op::sparse_decode;
    p.q_dtype = p.kv_dtype = dtypes[it % 3];
    p.page_size = page_sizes[it % 4];
    p.num_kv_heads = 1 + static_cast<int>(rng() % 2);
    p.num_q_heads = p.num_kv_heads * (it % 2 ? 16 : 1 << (rng() % 4));
    p.head_dim = it % 2 ? 128 : 64;
    p.has_sink = rng() % 2;
    p.write_lse = true;
    p.num_index_heads = p.num_kv_heads * (1 + static_cast<int>(rng() % 2));
    p.index_dim = 64;
    p.block_size = 16;
    p.topk = 2 + static_cast<int>(rng() % 8);
    p.init_blocks = it % 4 == 3 ? 1 : 0;
    p.local_blocks = it % 4 >= 2 ? 1 : 0;
    p.score_type = it % 3 == 1 ? ScoreType::lse : ScoreType::max;
    // Iterations 4-7: long contexts, one or two requests.
    Case c = make_case(rng, p.page_size, it < 4 ? 1 + static_cast<int>(rng() % 4) : 1 + it % 2,
                       /*decode=*/true, it < 4 ? 300 : 4000);
    SCOPED_TRACE(p.describe());
    const BatchLayout& L = c.layout;
    SparseDecodeData d(p, c, rng);
    auto pl = plan_of(be, p, L, ws);
    be.run(*pl, p, L, d.tensors(p), ws);
    EXPECT_FALSE(has_nan(d.out));
    expect_topk_rows_valid(p, L, d.iq, d.ik, d.topk);

    // The reference's attention over the cpu's own selections (a near-tie may pick another
    // block than the reference's indexer; the rows check above bounds that).
    Problem attend = p;
    attend.op = Op::sparse_attend_decode;
    const int64_t T = L.total_q();
    HostTensor ro(p.q_dtype, {T, p.num_q_heads, p.head_dim}), rl(DType::f32, {T, p.num_q_heads});
    Tensors ref = d.tensors(p);
    ref.index_q = ref.index_k_cache = TensorView{};
    ref.out = ro.view;
    ref.lse = rl.view;
    reference_compute(attend, L, ref);
    if (p.q_dtype == DType::f32) {
      EXPECT_LE(rel_l2(d.out, ro), 1e-5);
    } else {
      EXPECT_TRUE(allclose(d.out, ro, 5e-3, 5e-3)) << max_abs_diff(d.out, ro);
    }
    EXPECT_LE(max_abs_diff(d.lse, rl), 1e-3);

    // The cpu backend's own two steps on the same inputs: bit-identical.
    const HostTensor topk1 = d.topk, out1 = d.out, lse1 = d.lse;
    d.poison_outputs();
    Problem index = p;
    index.op = Op::sparse_index_decode;
    Tensors ti = d.tensors(p);
    auto pi = plan_of(be, index, L, ws);
    be.run(*pi, index, L, ti, ws);
    auto pa = plan_of(be, attend, L, ws);
    be.run(*pa, attend, L, ti, ws);
    EXPECT_TRUE(same_bytes(d.topk, topk1));
    EXPECT_TRUE(same_bytes(d.out, out1));
    EXPECT_TRUE(same_bytes(d.lse, lse1));
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, CpuParity,
                         ::testing::Values(CpuIsa::avx512_bf16, CpuIsa::avx512, CpuIsa::avx2,
                                           CpuIsa::baseline),
                         [](const ::testing::TestParamInfo<CpuIsa>& i) {
                           return std::string(cpu_isa_name(i.param));
                         });

}  // namespace
}  // namespace attnrt::test
