// The reference backend against a second, independently written formulation: keys gathered
// into a contiguous array, plain full softmax. Fresh random inputs, poisoned outputs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <cstring>
#include <set>

#include "backends/reference/reference_backend.h"
#include "support.h"

namespace attnrt {
namespace {

using test::HostTensor;

struct Case {
  Problem p;
  BatchLayout layout;
  HostTensor q, k, v, out, lse, sink, iq, ik, topk;
  int pages = 0;

  // Scrambled physical pages: page i of the batch goes to a shuffled slot.
  Case(Op op, int ps, std::vector<int32_t> ql, std::vector<int32_t> kv, uint64_t seed) {
    std::mt19937_64 rng(seed);
    p.op = op;
    p.page_size = ps;
    p.num_q_heads = 4;
    p.num_kv_heads = 2;
    p.head_dim = 8;
    p.has_sink = reads_attention_inputs(op);
    p.write_lse = reads_attention_inputs(op);
    p.num_index_heads = 2;
    p.index_dim = 8;
    p.block_size = 4;
    p.topk = 3;
    p.local_blocks = 1;
    p.init_blocks = 1;
    for (size_t b = 0; b < kv.size(); ++b) pages += (kv[b] + ps - 1) / ps;
    std::vector<int32_t> ids(pages);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<std::vector<int32_t>> pl(kv.size());
    int n = 0;
    for (size_t b = 0; b < kv.size(); ++b)
      for (int i = 0; i < (kv[b] + ps - 1) / ps; ++i) pl[b].push_back(ids[n++]);
    layout = BatchLayout::make(ps, ql, kv, pl);
    const int64_t T = layout.total_q();
    q = HostTensor(DType::f32, {T, 4, 8});
    k = HostTensor(DType::f32, {pages, ps, 2, 8});
    v = HostTensor(DType::f32, {pages, ps, 2, 8});
    out = HostTensor(DType::f32, {T, 4, 8});
    lse = HostTensor(DType::f32, {T, 4});
    sink = HostTensor(DType::f32, {4});
    iq = HostTensor(DType::f32, {T, 2, 8});
    ik = HostTensor(DType::f32, {pages, ps, 1, 8});
    topk = HostTensor(DType::i32, {2, T, 3});
    for (HostTensor* t : {&q, &k, &v, &sink, &iq, &ik}) test::fill_normal(*t, rng);
    test::poison(out);
    test::poison(lse);
  }
  Tensors tensors() {
    Tensors t;
    if (reads_index_inputs(p.op)) {
      t.index_q = iq.view;
      t.index_k_cache = ik.view;
    }
    if (reads_attention_inputs(p.op)) {
      t.q = q.view;
      t.k_cache = k.view;
      t.v_cache = v.view;
      t.out = out.view;
      t.lse = lse.view;
      t.sink = sink.view;
    }
    if (!is_dense(p.op)) t.topk = topk.view;
    return t;
  }
  // Token j of request b, head h, dim x of a paged cache, read through the page table.
  float at(const HostTensor& c, int b, int j, int h, int x, int nh) const {
    const int ps = p.page_size;
    const int page = layout.page_ids[layout.page_indptr[b] + j / ps];
    return c.get(((static_cast<int64_t>(page) * ps + j % ps) * nh + h) * 8 + x);
  }
};

// Naive attention for one request with the key set chosen by `visible(g, row, j)`.
template <typename Vis>
void naive_attend(const Case& c, std::vector<double>& out, std::vector<double>& lse, Vis visible) {
  const int64_t T = c.layout.total_q();
  out.assign(T * 4 * 8, 0.0);
  lse.assign(T * 4, 0.0);
  const double scale = 1.0 / std::sqrt(8.0);
  for (int b = 0; b < c.layout.num_requests(); ++b) {
    const int kv = c.layout.kv_len[b], ql = c.layout.q_len[b];
    // Gather this request's keys contiguously first.
    std::vector<double> K(kv * 2 * 8), V(kv * 2 * 8);
    for (int j = 0; j < kv; ++j)
      for (int g = 0; g < 2; ++g)
        for (int x = 0; x < 8; ++x) {
          K[(j * 2 + g) * 8 + x] = c.at(c.k, b, j, g, x, 2);
          V[(j * 2 + g) * 8 + x] = c.at(c.v, b, j, g, x, 2);
        }
    for (int t = 0; t < ql; ++t) {
      const int64_t row = c.layout.q_indptr[b] + t;
      const int pos = kv - ql + t;
      for (int h = 0; h < 4; ++h) {
        const int g = h / 2;
        std::vector<double> logits;
        std::vector<int> js;
        for (int j = 0; j < kv; ++j) {
          if (j > pos || !visible(g, row, j)) continue;
          double s = 0;
          for (int x = 0; x < 8; ++x) s += c.q.get((row * 4 + h) * 8 + x) * K[(j * 2 + g) * 8 + x];
          logits.push_back(s * scale);
          js.push_back(j);
        }
        double sum = std::exp(static_cast<double>(c.sink.get(h)));
        for (double l : logits) sum += std::exp(l);
        for (size_t i = 0; i < js.size(); ++i)
          for (int x = 0; x < 8; ++x)
            out[(row * 4 + h) * 8 + x] += std::exp(logits[i]) / sum * V[(js[i] * 2 + g) * 8 + x];
        lse[row * 4 + h] = std::log(sum);
      }
    }
  }
}

void expect_close(const HostTensor& got, const std::vector<double>& want, uint64_t seed) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size()));
  for (int64_t i = 0; i < got.numel(); ++i) {
    ASSERT_NEAR(got.get(i), want[i], 1e-5 * (1 + std::abs(want[i]))) << "i=" << i << " seed " << seed;
  }
}

TEST(Reference, DenseMatchesNaiveAcrossPageSizes) {
  for (Op op : {Op::dense_extend, Op::dense_decode}) {
    for (int ps : {1, 3, 16}) {
      const uint64_t seed = test::fresh_seed();
      const bool dec = is_decode(op);
      Case c(op, ps, dec ? std::vector<int32_t>{1, 1, 1} : std::vector<int32_t>{5, 1, 7},
             {17, 1, 33}, seed);
      reference_compute(c.p, c.layout, c.tensors());
      std::vector<double> o, l;
      naive_attend(c, o, l, [](int, int64_t, int) { return true; });
      expect_close(c.out, o, seed);
      expect_close(c.lse, l, seed);
    }
  }
}

TEST(Reference, SparseAttendMatchesNaiveUnionOfIndexHeads) {
  for (Op op : {Op::sparse_attend_extend, Op::sparse_attend_decode}) {
    const uint64_t seed = test::fresh_seed();
    std::mt19937_64 rng(seed);
    const bool dec = is_decode(op);
    Case c(op, 4, dec ? std::vector<int32_t>{1, 1} : std::vector<int32_t>{6, 3}, {30, 11}, seed);
    c.p.num_index_heads = 4;  // R = 2 index heads per KV head
    c.topk = HostTensor(DType::i32, {4, c.layout.total_q(), 3});
    std::vector<std::set<int>> sel(4 * c.layout.total_q());
    for (int b = 0; b < c.layout.num_requests(); ++b)
      for (int t = 0; t < c.layout.q_len[b]; ++t) {
        const int64_t row = c.layout.q_indptr[b] + t;
        const int nvis = (c.layout.kv_len[b] - c.layout.q_len[b] + t) / 4 + 1;
        for (int h = 0; h < 4; ++h) {
          std::vector<int> ids(nvis);
          std::iota(ids.begin(), ids.end(), 0);
          std::shuffle(ids.begin(), ids.end(), rng);
          ids.resize(std::min(nvis, static_cast<int>(rng() % 3) + 1));
          std::sort(ids.begin(), ids.end());
          for (int k = 0; k < 3; ++k)
            static_cast<int32_t*>(c.topk.view.data)[(h * c.layout.total_q() + row) * 3 + k] =
                                  k < static_cast<int>(ids.size()) ? ids[k] : -1;
          sel[h * c.layout.total_q() + row] = {ids.begin(), ids.end()};
        }
      }
    reference_compute(c.p, c.layout, c.tensors());
    const int64_t T = c.layout.total_q();
    std::vector<double> o, l;
    naive_attend(c, o, l, [&](int g, int64_t row, int j) {
      return sel[(2 * g) * T + row].count(j / 4) || sel[(2 * g + 1) * T + row].count(j / 4);
    });
    expect_close(c.out, o, seed);
    expect_close(c.lse, l, seed);
  }
}

TEST(Reference, IndexRowsAreAscendingUniquePaddedAndForcedAndMatchNaive) {
  const uint64_t seed = test::fresh_seed();
  Case c(Op::sparse_index_extend, 4, {9, 2}, {29, 5}, seed);
  test::poison(c.topk);
  reference_compute(c.p, c.layout, c.tensors());
  const int64_t T = c.layout.total_q();
  const int32_t* sel = static_cast<const int32_t*>(c.topk.view.data);
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < c.layout.q_len[b]; ++t) {
      const int64_t row = c.layout.q_indptr[b] + t;
      const int pos = c.layout.kv_len[b] - c.layout.q_len[b] + t;
      const int nvis = pos / 4 + 1;
      for (int h = 0; h < 2; ++h) {
        // Naive: max score per block, forced init block 0 and last block, top-3 as a set.
        std::vector<std::pair<double, int>> sc;
        for (int blk = 0; blk < nvis; ++blk) {
          double m = -1e300;
          for (int j = blk * 4; j <= std::min(pos, blk * 4 + 3); ++j) {
            double s = 0;
            for (int x = 0; x < 8; ++x) s += c.iq.get((row * 2 + h) * 8 + x) * c.at(c.ik, b, j, 0, x, 1);
            m = std::max(m, s / std::sqrt(8.0));
          }
          if (blk == 0) m = 1e30;
          if (blk == nvis - 1) m = 1e29;
          sc.push_back({-m, blk});
        }
        std::sort(sc.begin(), sc.end());
        std::set<int> want;
        for (int i = 0; i < std::min(3, nvis); ++i) want.insert(sc[i].second);
        std::set<int> got;
        int prev = -1;
        for (int k = 0; k < 3; ++k) {
          const int32_t id = sel[(h * T + row) * 3 + k];
          if (k >= std::min(3, nvis)) {
            EXPECT_EQ(id, -1);
            continue;
          }
          EXPECT_GT(id, prev) << "ascending, unique";
          prev = id;
          got.insert(id);
        }
        EXPECT_EQ(got, want) << "row " << row << " head " << h << " seed " << seed;
        EXPECT_TRUE(got.count(0) && got.count(nvis - 1));
      }
    }
}

// With every visible block within top-k, the indexer must select all of them (ascending, -1
// padded), and sparse attention over that selection is dense attention: bit-identical, since
// the reference visits the same keys in the same order. Runs the reference indexer itself, on
// fresh random inputs, for extend and decode.
TEST(Reference, SparseEqualsDenseWhenEveryVisibleBlockFitsInTopk) {
  for (const bool dec : {false, true}) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(std::string(dec ? "decode" : "extend") + " seed " + std::to_string(seed));
    // Contexts of at most 12 tokens: <= 3 blocks of 4, and topk is 3.
    Case c(dec ? Op::sparse_index_decode : Op::sparse_index_extend, 4,
           dec ? std::vector<int32_t>{1, 1, 1} : std::vector<int32_t>{3, 2, 7}, {11, 9, 12}, seed);
    const int64_t T = c.layout.total_q();
    test::poison(c.topk);
    reference_compute(c.p, c.layout, c.tensors());
    const int32_t* sel = static_cast<const int32_t*>(c.topk.view.data);
    for (int b = 0; b < c.layout.num_requests(); ++b)
      for (int t = 0; t < c.layout.q_len[b]; ++t) {
        const int64_t row = c.layout.q_indptr[b] + t;
        const int nvis = (c.layout.kv_len[b] - c.layout.q_len[b] + t) / 4 + 1;
        for (int h = 0; h < 2; ++h)
          for (int k = 0; k < 3; ++k)
            EXPECT_EQ(sel[(h * T + row) * 3 + k], k < nvis ? k : -1) << "head " << h << " row " << row;
      }

    c.p.op = dec ? Op::sparse_attend_decode : Op::sparse_attend_extend;
    c.p.has_sink = c.p.write_lse = true;
    reference_compute(c.p, c.layout, c.tensors());
    ASSERT_FALSE(test::has_nan(c.out));
    ASSERT_FALSE(test::has_nan(c.lse));
    HostTensor sparse_out = c.out, sparse_lse = c.lse;
    // A repeat is bit-identical.
    test::poison(c.out);
    test::poison(c.lse);
    reference_compute(c.p, c.layout, c.tensors());
    EXPECT_EQ(0, std::memcmp(sparse_out.bytes.data(), c.out.bytes.data(), c.out.bytes.size()));
    EXPECT_EQ(0, std::memcmp(sparse_lse.bytes.data(), c.lse.bytes.data(), c.lse.bytes.size()));

    c.p.op = dec ? Op::dense_decode : Op::dense_extend;
    test::poison(c.out);
    test::poison(c.lse);
    reference_compute(c.p, c.layout, c.tensors());
    EXPECT_EQ(0, std::memcmp(sparse_out.bytes.data(), c.out.bytes.data(), c.out.bytes.size()));
    EXPECT_EQ(0, std::memcmp(sparse_lse.bytes.data(), c.lse.bytes.data(), c.lse.bytes.size()));
  }
}

// sparse_decode is sparse_index_decode, then sparse_attend_decode on the selections it wrote:
// on fresh random inputs with more visible blocks than topk (so the selection is real), its
// topk, out and lse equal those of the two calls exactly (the same code). R = 2 index heads per
// KV head, so the attention takes the union of two selections.
TEST(Reference, SparseDecodeEqualsIndexThenAttend) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Case fused(Op::sparse_decode, 3, {1, 1, 1}, {30, 11, 25}, seed);
  fused.p.num_index_heads = 4;
  fused.iq = HostTensor(DType::f32, {3, 4, 8});
  std::mt19937_64 rng(seed + 1);
  test::fill_normal(fused.iq, rng);
  fused.topk = HostTensor(DType::i32, {4, 3, 3});
  test::poison(fused.topk);
  reference_compute(fused.p, fused.layout, fused.tensors());

  Case steps = fused;  // same inputs; its own outputs
  for (HostTensor* t : {&steps.q, &steps.k, &steps.v, &steps.sink, &steps.iq, &steps.ik,
                        &steps.topk, &steps.out, &steps.lse})
    t->view.data = t->bytes.data();
  test::poison(steps.topk);
  test::poison(steps.out);
  test::poison(steps.lse);
  steps.p.op = Op::sparse_index_decode;
  reference_compute(steps.p, steps.layout, steps.tensors());
  steps.p.op = Op::sparse_attend_decode;
  reference_compute(steps.p, steps.layout, steps.tensors());

  EXPECT_EQ(0,
            std::memcmp(fused.topk.bytes.data(), steps.topk.bytes.data(), fused.topk.bytes.size()));
  EXPECT_EQ(0, std::memcmp(fused.out.bytes.data(), steps.out.bytes.data(), fused.out.bytes.size()));
  EXPECT_EQ(0, std::memcmp(fused.lse.bytes.data(), steps.lse.bytes.data(), fused.lse.bytes.size()));
  ASSERT_FALSE(test::has_nan(fused.out));
  ASSERT_FALSE(test::has_nan(fused.lse));
  // The selection is real: request 0 sees 8 blocks and each of its rows picks 3 of them.
  const int32_t* sel = static_cast<const int32_t*>(fused.topk.view.data);
  for (int h = 0; h < 4; ++h)
    for (int k = 0; k < 3; ++k) EXPECT_GE(sel[(h * 3 + 0) * 3 + k], 0) << "head " << h;
}

}  // namespace
}  // namespace attnrt
