// The paged KV cache, the page allocator, and the property that paging never changes a result:
// the same keys behind a scrambled page table give bit-identical outputs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <set>

#include "support.h"

namespace attnrt {
namespace {

using test::HostTensor;
using ::testing::HasSubstr;

RuntimeOptions forced(const std::string& backend) {
  RuntimeOptions o;
  o.plugin_path = "";
  o.search_library_dir = false;
  o.disable = std::vector<std::string>{};
  o.force_backend = backend;
  return o;
}

TEST(PageAllocator, HandsOutUniqueScrambledPagesAndReusesFreedOnes) {
  PageAllocator a(64, 16, test::fresh_seed());
  const auto r0 = a.create(), r1 = a.create();
  a.append(r0, 100);  // 7 pages
  a.append(r1, 16);   // 1 page
  a.append(r1, 1);    // 2 pages
  EXPECT_EQ(a.length(r0), 100);
  EXPECT_EQ(a.pages(r0).size(), 7u);
  EXPECT_EQ(a.pages(r1).size(), 2u);
  EXPECT_EQ(a.free_pages(), 64 - 9);
  std::set<int32_t> seen;
  for (auto r : {r0, r1})
    for (int32_t p : a.pages(r)) {
      EXPECT_TRUE(p >= 0 && p < 64);
      EXPECT_TRUE(seen.insert(p).second) << "page " << p << " given twice";
    }
  // Scrambled: the first request's pages are not simply 0, 1, 2, ...
  std::vector<int32_t> in_order(7);
  for (int i = 0; i < 7; ++i) in_order[i] = i;
  EXPECT_NE(a.pages(r0), in_order);

  const BatchLayout l = a.layout({r0, r1}, {100, 1});
  EXPECT_EQ(l.kv_len, (std::vector<int32_t>{100, 17}));
  EXPECT_EQ(l.q_indptr, (std::vector<int64_t>{0, 100, 101}));
  EXPECT_EQ(l.page_indptr, (std::vector<int32_t>{0, 7, 9}));

  a.free(r0);
  EXPECT_EQ(a.free_pages(), 64 - 2);
  EXPECT_THROW(a.length(r0), InvalidArgument);
  const auto r2 = a.create();
  a.append(r2, 64 * 16 - 2 * 16);  // exactly the rest
  EXPECT_EQ(a.free_pages(), 0);
}

TEST(PageAllocator, ErrorsNameTheNumbers) {
  PageAllocator a(4, 8, 1);
  const auto r = a.create();
  try {
    a.append(r, 33);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("needs 5 more pages"));
    EXPECT_THAT(e.what(), HasSubstr("only 4 are free"));
  }
  EXPECT_EQ(a.length(r), 0);  // a failed append takes nothing
  EXPECT_EQ(a.free_pages(), 4);
  EXPECT_THROW(a.append(7, 1), InvalidArgument);
  EXPECT_THROW(a.append(r, -1), InvalidArgument);
  EXPECT_THROW(PageAllocator(0, 8), InvalidArgument);
  EXPECT_THROW(PageAllocator(4, 0), InvalidArgument);
  EXPECT_THROW(a.layout({r}, {1, 2}), InvalidArgument);
}

TEST(PagedKvCache, PoolsHaveTheContractShapes) {
  Runtime rt(forced(""));
  KvCacheConfig c;
  c.num_layers = 3;
  c.num_pages = 5;
  c.page_size = 7;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.dtype = DType::bf16;
  c.layer_has_index = {false, true, true};
  c.index_dim = 8;
  PagedKvCache cache(rt, c);
  const TensorView k = cache.k(1);
  EXPECT_EQ(k.shape_str(), "[5, 7, 2, 16]");
  EXPECT_EQ(k.dtype, DType::bf16);
  EXPECT_TRUE(k.is_contiguous());
  EXPECT_EQ(cache.v(2).shape_str(), "[5, 7, 2, 16]");
  EXPECT_NE(cache.k(0).data, cache.k(1).data);
  EXPECT_NE(cache.k(0).data, cache.v(0).data);
  EXPECT_EQ(cache.index_k(1).shape_str(), "[5, 7, 1, 8]");
  EXPECT_FALSE(cache.has_index(0));
  EXPECT_THROW(cache.index_k(0), InvalidArgument);
  EXPECT_THROW(cache.k(3), InvalidArgument);
  EXPECT_EQ(cache.bytes(), size_t{3} * 2 * 5 * 7 * 2 * 16 * 2 + size_t{2} * 5 * 7 * 8 * 2);
  // Writable memory of the promised size.
  std::memset(cache.index_k(2).data, 0, 5 * 7 * 8 * 2);

  KvCacheConfig bad = c;
  bad.page_size = 0;
  try {
    PagedKvCache x(rt, bad);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("KvCacheConfig.page_size: got 0"));
  }
  bad = c;
  bad.index_dim = 0;
  EXPECT_THROW(PagedKvCache(rt, bad), InvalidArgument);
  bad = c;
  bad.layer_has_index = {true};
  EXPECT_THROW(PagedKvCache(rt, bad), InvalidArgument);
}

// Copies logical page i of `from` (pages in `from_ids` order) to slot to_ids[i] of `to`.
void copy_pages(const HostTensor& from, const std::vector<int32_t>& from_ids, HostTensor& to,
                const std::vector<int32_t>& to_ids) {
  const size_t page_bytes = static_cast<size_t>(from.view.strides[0]) * dtype_size(from.view.dtype);
  for (size_t i = 0; i < from_ids.size(); ++i)
    std::memcpy(to.bytes.data() + to_ids[i] * page_bytes, from.bytes.data() + from_ids[i] * page_bytes,
                page_bytes);
}

// The same logical keys (and index keys) stored (a) in order, one request after another, and
// (b) behind a scrambled page table; every backend must give bit-identical outputs: out and lse
// of attention, the selected blocks of the indexer.
void expect_paging_invariant(const std::string& backend, Op op, int ps, DType dt) {
  SCOPED_TRACE(backend + " " + op_name(op) + " page " + std::to_string(ps) + " " + dtype_name(dt));
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const bool dec = is_decode(op);
  const std::vector<int32_t> kv = {70, 33, 129};
  const std::vector<int32_t> ql = dec ? std::vector<int32_t>{1, 1, 1} : std::vector<int32_t>{9, 33, 5};
  const int Hq = 8, Hkv = 2, D = 64, Hidx = 4, Didx = 32, B = 16, K = 4;
  int pages = 0;
  for (int32_t n : kv) pages += (n + ps - 1) / ps;
  std::vector<std::vector<int32_t>> ordered(kv.size());
  int next = 0;
  for (size_t b = 0; b < kv.size(); ++b)
    for (int i = 0; i < (kv[b] + ps - 1) / ps; ++i) ordered[b].push_back(next++);
  const BatchLayout la = BatchLayout::make(ps, ql, kv, ordered);
  // A scrambled page table; with few pages a seed can draw the identity order (1 in 720 for 6
  // pages), which would test nothing, so the next seeds are tried.
  BatchLayout lb;
  for (uint64_t s = seed; s < seed + 16 && (lb.page_ids.empty() || lb.page_ids == la.page_ids); ++s) {
    PageAllocator scrambled(pages, ps, s);
    std::vector<PageAllocator::RequestId> ids;
    for (size_t b = 0; b < kv.size(); ++b) {
      ids.push_back(scrambled.create());
      scrambled.append(ids.back(), kv[b]);
    }
    lb = scrambled.layout(ids, ql);
  }
  ASSERT_NE(la.page_ids, lb.page_ids);

  Problem p;
  p.op = op;
  p.q_dtype = p.kv_dtype = dt;
  p.page_size = ps;
  p.num_q_heads = Hq;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.write_lse = reads_attention_inputs(op);
  p.num_index_heads = Hidx;  // 2 index heads per KV head for sparse attend
  p.index_dim = Didx;
  p.block_size = B;
  p.topk = K;
  if (reads_index_inputs(op)) p.init_blocks = p.local_blocks = 1;

  const int64_t T = la.total_q();
  HostTensor q(dt, {T, Hq, D}), ka(dt, {pages, ps, Hkv, D}), va(dt, {pages, ps, Hkv, D});
  HostTensor iq(dt, {T, Hidx, Didx}), ika(dt, {pages, ps, 1, Didx});
  for (HostTensor* t : {&q, &ka, &va, &iq, &ika}) test::fill_normal(*t, rng);
  HostTensor kb(dt, {pages, ps, Hkv, D}), vb(dt, {pages, ps, Hkv, D}), ikb(dt, {pages, ps, 1, Didx});
  copy_pages(ka, la.page_ids, kb, lb.page_ids);
  copy_pages(va, la.page_ids, vb, lb.page_ids);
  copy_pages(ika, la.page_ids, ikb, lb.page_ids);
  // Sparse attend reads a selection: random legal rows (own block always in), the same for both.
  HostTensor sel(DType::i32, {Hidx, T, K});
  for (size_t b = 0; b < kv.size(); ++b)
    for (int64_t r = la.q_indptr[b]; r < la.q_indptr[b + 1]; ++r) {
      const int nvis = static_cast<int>((kv[b] - ql[b] + (r - la.q_indptr[b])) / B + 1);
      for (int h = 0; h < Hidx; ++h) {
        std::vector<int32_t> blocks(nvis);
        std::iota(blocks.begin(), blocks.end(), 0);
        std::shuffle(blocks.begin(), blocks.end() - 1, rng);
        std::swap(blocks[0], blocks.back());
        const int n = std::min(K, 1 + static_cast<int>(rng() % K));
        std::sort(blocks.begin(), blocks.begin() + std::min(n, nvis));
        for (int k = 0; k < K; ++k)
          sel.view.ptr<int32_t>()[(h * T + r) * K + k] = k < std::min(n, nvis) ? blocks[k] : -1;
      }
    }

  Runtime rt(forced(backend));
  HostTensor oa(dt, {T, Hq, D}), ob(dt, {T, Hq, D}), sa(DType::f32, {T, Hq}), sb(DType::f32, {T, Hq});
  HostTensor ta_sel(DType::i32, {Hidx, T, K}), tb_sel(DType::i32, {Hidx, T, K});
  for (HostTensor* t : {&oa, &ob, &sa, &sb, &ta_sel, &tb_sel}) test::poison(*t);
  Tensors ta, tb;
  if (reads_attention_inputs(op)) {
    ta = {q.view, ka.view, va.view, oa.view, sa.view, {}, {}, {}, {}};
    tb = {q.view, kb.view, vb.view, ob.view, sb.view, {}, {}, {}, {}};
  }
  if (reads_index_inputs(op)) {
    ta.index_q = tb.index_q = iq.view;
    ta.index_k_cache = ika.view;
    tb.index_k_cache = ikb.view;
    ta.topk = ta_sel.view;
    tb.topk = tb_sel.view;
  } else if (reads_topk_input(op)) {
    ta.topk = tb.topk = sel.view;
  }
  rt.execute(p, la, ta);
  rt.execute(p, lb, tb);
  EXPECT_EQ(rt.plan(p, la)->backend(), backend);
  if (reads_index_inputs(op)) {
    // Every row was written (valid ids or -1 padding), and identically.
    for (int64_t i = 0; i < ta_sel.numel(); ++i) {
      const int32_t id = ta_sel.view.ptr<int32_t>()[i];
      ASSERT_TRUE(id >= -1 && id < 9) << "element " << i << " = " << id;
    }
    EXPECT_EQ(0, std::memcmp(ta_sel.bytes.data(), tb_sel.bytes.data(), ta_sel.bytes.size()));
  }
  if (!reads_attention_inputs(op)) return;
  ASSERT_FALSE(test::has_nan(oa));
  ASSERT_FALSE(test::has_nan(sa));
  EXPECT_EQ(0, std::memcmp(oa.bytes.data(), ob.bytes.data(), oa.bytes.size()));
  EXPECT_EQ(0, std::memcmp(sa.bytes.data(), sb.bytes.data(), sa.bytes.size()));
}

TEST(PagedKvCache, ScrambledPagesGiveBitIdenticalResults) {
  for (const std::string backend : {"reference", "cpu"})
    for (Op op : {Op::dense_extend, Op::dense_decode})
      for (int ps : {1, 16, 64})
        for (DType dt : {DType::f32, DType::bf16}) expect_paging_invariant(backend, op, ps, dt);
}

TEST(PagedKvCache, ScrambledPagesGiveBitIdenticalSparseResults) {
  for (const std::string backend : {"reference", "cpu"})
    for (Op op : {Op::sparse_index_extend, Op::sparse_index_decode, Op::sparse_attend_extend,
                  Op::sparse_attend_decode, Op::sparse_decode})
      for (int ps : {1, 16, 64})
        for (DType dt : {DType::f32, DType::bf16}) expect_paging_invariant(backend, op, ps, dt);
}

}  // namespace
}  // namespace attnrt
