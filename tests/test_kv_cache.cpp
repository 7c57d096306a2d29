// The paged KV cache, the page allocator, and the property that paging never changes a result:
// the same keys behind a scrambled page table give bit-identical outputs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
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

// The same logical keys stored (a) in order, one request after another, and (b) behind a
// scrambled page table; every backend must give bit-identical outputs and lse.
void expect_paging_invariant(const std::string& backend, Op op, int ps, DType dt) {
  SCOPED_TRACE(backend + " " + op_name(op) + " page " + std::to_string(ps) + " " + dtype_name(dt));
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const bool dec = is_decode(op);
  const std::vector<int32_t> kv = {70, 33, 129};
  const std::vector<int32_t> ql = dec ? std::vector<int32_t>{1, 1, 1} : std::vector<int32_t>{9, 33, 5};
  const int Hq = 8, Hkv = 2, D = 64;
  int pages = 0;
  for (int32_t n : kv) pages += (n + ps - 1) / ps;
  PageAllocator scrambled(pages, ps, seed);
  std::vector<std::vector<int32_t>> ordered(kv.size());
  std::vector<PageAllocator::RequestId> ids;
  int next = 0;
  for (size_t b = 0; b < kv.size(); ++b) {
    ids.push_back(scrambled.create());
    scrambled.append(ids.back(), kv[b]);
    for (int i = 0; i < (kv[b] + ps - 1) / ps; ++i) ordered[b].push_back(next++);
  }
  const BatchLayout la = BatchLayout::make(ps, ql, kv, ordered);
  const BatchLayout lb = scrambled.layout(ids, ql);
  ASSERT_NE(la.page_ids, lb.page_ids);

  const int64_t T = la.total_q();
  HostTensor q(dt, {T, Hq, D}), ka(dt, {pages, ps, Hkv, D}), va(dt, {pages, ps, Hkv, D});
  test::fill_normal(q, rng);
  test::fill_normal(ka, rng);
  test::fill_normal(va, rng);
  // Copy logical page (b, i) of the ordered cache into its scrambled slot.
  HostTensor kb(dt, {pages, ps, Hkv, D}), vb(dt, {pages, ps, Hkv, D});
  const size_t page_bytes = size_t(ps) * Hkv * D * dtype_size(dt);
  for (size_t i = 0; i < la.page_ids.size(); ++i) {
    std::memcpy(kb.bytes.data() + lb.page_ids[i] * page_bytes, ka.bytes.data() + la.page_ids[i] * page_bytes,
                page_bytes);
    std::memcpy(vb.bytes.data() + lb.page_ids[i] * page_bytes, va.bytes.data() + la.page_ids[i] * page_bytes,
                page_bytes);
  }
  Problem p;
  p.op = op;
  p.q_dtype = p.kv_dtype = dt;
  p.page_size = ps;
  p.num_q_heads = Hq;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.write_lse = true;
  Runtime rt(forced(backend));
  HostTensor oa(dt, {T, Hq, D}), ob(dt, {T, Hq, D}), sa(DType::f32, {T, Hq}), sb(DType::f32, {T, Hq});
  for (HostTensor* t : {&oa, &ob, &sa, &sb}) test::poison(*t);
  Tensors ta{q.view, ka.view, va.view, oa.view, sa.view, {}, {}, {}, {}};
  Tensors tb{q.view, kb.view, vb.view, ob.view, sb.view, {}, {}, {}, {}};
  rt.execute(p, la, ta);
  rt.execute(p, lb, tb);
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

}  // namespace
}  // namespace attnrt
