// GPU tests of the CUDA plugin's dense ops through its C ABI (dlopen), against a double-precision
// host reference written here. Outputs are poisoned (NaN) before every run; repeats must be
// bit-identical; a decode plan captured in a CUDA graph must replay correctly after update_plan
// gives it new lengths. Without a CUDA device every test is skipped with the plugin's reason.
// Timings: `attnrt bench --device cuda:0` (bench/cuda_side_by_side.py).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "plugin_harness.h"

namespace {

using namespace gpu_test;

#define OKC(x) ASSERT_EQ((x), ATTNRT_OK) << g_plugin->last_error()

struct Case {
  int op = ATTNRT_OP_DENSE_EXTEND;
  int dtype = ATTNRT_BF16;
  int hq = 8, hkv = 2, d = 128, page = 16;
  bool sink = false, lse = true;
  std::vector<int> q_len, kv_len;
  int64_t total_q() const {
    int64_t t = 0;
    for (int x : q_len) t += x;
    return t;
  }
};

struct Result {
  double rel_o = 0, max_lse = 0;
  int64_t over_tol = 0;  // elements outside atol = rtol = 5e-3 (design.md §6)
  bool all_written = true, repeat_identical = true;
};

// One batch's data placed in a paged pool with scattered physical pages. Each request owns
// enough pages for its kv_len in `c`; a layout for shorter lengths uses prefixes of them.
struct Inputs {
  std::vector<std::vector<int32_t>> pages;
  int num_pages = 0;
  std::vector<uint16_t> q, kc, vc;
  std::vector<float> sink;
};

Inputs make_inputs(const Case& c, uint32_t seed) {
  Inputs in;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  int total_pages = 0;
  for (int kv : c.kv_len) total_pages += (kv + c.page - 1) / c.page;
  in.num_pages = total_pages + 3;
  std::vector<int32_t> perm(in.num_pages);
  for (int i = 0; i < in.num_pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  int next = 0;
  for (int kv : c.kv_len) {
    const int np = (kv + c.page - 1) / c.page;
    in.pages.emplace_back(perm.begin() + next, perm.begin() + next + np);
    next += np;
  }
  auto enc = [&](float f) { return c.dtype == ATTNRT_BF16 ? to_bf16(f) : to_f16(f); };
  in.q.resize(c.total_q() * c.hq * c.d);
  in.kc.resize(static_cast<size_t>(in.num_pages) * c.page * c.hkv * c.d);
  in.vc.resize(in.kc.size());
  for (auto& x : in.q) x = enc(nd(rng));
  for (auto& x : in.kc) x = enc(nd(rng));
  for (auto& x : in.vc) x = enc(nd(rng));
  // Cache slots past each request's last key hold NaN: a kernel must neither read them into a
  // result nor let a zero weight meet them (0 * NaN is NaN).
  const size_t row_elems = static_cast<size_t>(c.hkv) * c.d;
  std::vector<bool> used(in.num_pages, false);
  for (size_t b = 0; b < c.kv_len.size(); ++b) {
    for (int32_t pg : in.pages[b]) used[pg] = true;
    if (in.pages[b].empty()) continue;
    const int kv = c.kv_len[b];
    const int64_t last = in.pages[b].back();
    for (int r = kv - (static_cast<int>(in.pages[b].size()) - 1) * c.page; r < c.page; ++r)
      for (size_t e = 0; e < row_elems; ++e) in.kc[(last * c.page + r) * row_elems + e] =
          in.vc[(last * c.page + r) * row_elems + e] = 0x7fc1;
  }
  for (int pg = 0; pg < in.num_pages; ++pg)
    if (!used[pg])
      for (auto* pool : {&in.kc, &in.vc})
        std::fill(pool->begin() + pg * c.page * row_elems,
                  pool->begin() + (pg + 1) * c.page * row_elems, uint16_t{0x7fc1});
  in.sink.resize(c.hq);
  for (auto& x : in.sink) x = nd(rng) * 2.f;
  return in;
}

// The host arrays of an attnrt_layout for c's lengths over in's pages.
struct Layout {
  std::vector<int32_t> q_len, kv_len, page_indptr, page_ids;
  std::vector<int64_t> q_indptr;
  attnrt_layout view(int page) const {
    return attnrt_layout{static_cast<int32_t>(q_len.size()), page, q_len.data(), kv_len.data(),
                         q_indptr.data(), page_indptr.data(), page_ids.data(), 0};
  }
};

Layout layout_of(const Case& c, const Inputs& in) {
  Layout L;
  const int n = static_cast<int>(c.q_len.size());
  L.q_len.assign(c.q_len.begin(), c.q_len.end());
  L.kv_len.assign(c.kv_len.begin(), c.kv_len.end());
  L.q_indptr.assign(n + 1, 0);
  L.page_indptr.assign(n + 1, 0);
  for (int b = 0; b < n; ++b) {
    const int np = (c.kv_len[b] + c.page - 1) / c.page;
    L.q_indptr[b + 1] = L.q_indptr[b] + c.q_len[b];
    L.page_indptr[b + 1] = L.page_indptr[b] + np;
    L.page_ids.insert(L.page_ids.end(), in.pages[b].begin(), in.pages[b].begin() + np);
  }
  return L;
}

// Double-precision causal GQA attention of every query row of c over in's pool: out [T, hq, d]
// and lse [T, hq] (natural log), with the sink logit when c.sink.
void reference(const Case& c, const Inputs& in, std::vector<double>* ro, std::vector<double>* rl) {
  auto dec = [&](uint16_t u) { return c.dtype == ATTNRT_BF16 ? from_bf16(u) : from_f16(u); };
  const int D = c.d, G = c.hq / c.hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  ro->assign(c.total_q() * c.hq * D, 0.0);
  rl->assign(c.total_q() * c.hq, 0.0);
  int64_t t = 0;
  for (size_t b = 0; b < c.q_len.size(); ++b)
    for (int i = 0; i < c.q_len[b]; ++i, ++t) {
      const int pos = c.kv_len[b] - c.q_len[b] + i;
      for (int h = 0; h < c.hq; ++h) {
        auto row = [&](int j) {
          const int64_t page = in.pages[b][j / c.page];
          return ((page * c.page + j % c.page) * c.hkv + h / G) * D;
        };
        std::vector<double> s(pos + 1);
        double m = -INFINITY;
        for (int j = 0; j <= pos; ++j) {
          double acc = 0;
          for (int k = 0; k < D; ++k) acc += dec(in.q[(t * c.hq + h) * D + k]) * dec(in.kc[row(j) + k]);
          s[j] = acc * scale;
          m = std::max(m, s[j]);
        }
        if (c.sink) m = std::max(m, static_cast<double>(in.sink[h]));
        double L = 0;
        std::vector<double> o(D, 0.0);
        for (int j = 0; j <= pos; ++j) {
          const double p = std::exp(s[j] - m);
          L += p;
          for (int k = 0; k < D; ++k) o[k] += p * dec(in.vc[row(j) + k]);
        }
        if (c.sink) L += std::exp(in.sink[h] - m);
        for (int k = 0; k < D; ++k) (*ro)[(t * c.hq + h) * D + k] = o[k] / L;
        (*rl)[t * c.hq + h] = m + std::log(L);
      }
    }
}

attnrt_problem problem_of(const Case& c) {
  attnrt_problem p{};
  p.op = c.op;
  p.device = {ATTNRT_DEVICE_CUDA, 0};
  p.q_dtype = p.kv_dtype = c.dtype;
  p.page_size = c.page;
  p.num_q_heads = c.hq;
  p.num_kv_heads = c.hkv;
  p.head_dim = c.d;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(c.d));
  p.has_sink = c.sink;
  p.write_lse = c.lse;
  return p;
}

// The inputs on the device and the tensors that name them; out/lse poisoned by poison().
struct DeviceBatch {
  Dev q, k, v, out, lse, sink;
  attnrt_tensors ts{};
  size_t out_elems, lse_elems;
  DeviceBatch(const Case& c, const Inputs& in)
      : q(in.q.size() * 2), k(in.kc.size() * 2), v(in.vc.size() * 2), out(in.q.size() * 2),
        lse(c.total_q() * c.hq * 4), sink(in.sink.size() * 4), out_elems(in.q.size()),
        lse_elems(c.total_q() * c.hq) {
    q.up(in.q.data(), q.bytes);
    k.up(in.kc.data(), k.bytes);
    v.up(in.vc.data(), v.bytes);
    sink.up(in.sink.data(), in.sink.size() * 4);
    const int64_t T = c.total_q();
    ts.q = tensor(q.p, c.dtype, 3, {T, c.hq, c.d});
    ts.k_cache = tensor(k.p, c.dtype, 4, {in.num_pages, c.page, c.hkv, c.d});
    ts.v_cache = tensor(v.p, c.dtype, 4, {in.num_pages, c.page, c.hkv, c.d});
    ts.out = tensor(out.p, c.dtype, 3, {T, c.hq, c.d});
    if (c.lse) ts.lse = tensor(lse.p, ATTNRT_F32, 2, {T, c.hq});
    if (c.sink) ts.sink = tensor(sink.p, ATTNRT_F32, 1, {c.hq});
  }
  void poison() {
    std::vector<uint16_t> po(out_elems, 0x7fc1);  // NaN in both bf16 and f16
    std::vector<float> pl(lse_elems, std::numeric_limits<float>::quiet_NaN());
    out.up(po.data(), po.size() * 2);
    lse.up(pl.data(), pl.size() * 4);
  }
  void download(std::vector<uint16_t>* o, std::vector<float>* l) const {
    o->resize(out_elems);
    l->resize(lse_elems);
    out.down(o->data(), o->size() * 2);
    lse.down(l->data(), l->size() * 4);
  }
};

// Compares a device result with the reference; NaN (an unwritten element) fails.
Result compare(const Case& c, const std::vector<uint16_t>& out, const std::vector<float>& lse,
               const std::vector<double>& ro, const std::vector<double>& rl) {
  Result r;
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const float v = c.dtype == ATTNRT_BF16 ? from_bf16(out[i]) : from_f16(out[i]);
    if (!std::isfinite(v)) r.all_written = false;
    num += (v - ro[i]) * (v - ro[i]);
    den += ro[i] * ro[i];
    if (!(std::fabs(v - ro[i]) <= 5e-3 + 5e-3 * std::fabs(ro[i]))) ++r.over_tol;
  }
  r.rel_o = std::sqrt(num / std::max(den, 1e-30));
  if (c.lse) {
    for (size_t i = 0; i < lse.size(); ++i) {
      if (!std::isfinite(lse[i])) r.all_written = false;
      r.max_lse = std::max(r.max_lse, std::fabs(lse[i] - rl[i]));
    }
  }
  return r;
}

// Runs one case `reps` times (repeat check) and compares with the double reference.
Result run_case(const Case& c, uint32_t seed, int reps = 2) {
  Result r;
  const Inputs in = make_inputs(c, seed);
  std::vector<double> ro, rl;
  reference(c, in, &ro, &rl);
  const Layout lay = layout_of(c, in);
  const attnrt_layout L = lay.view(c.page);
  const attnrt_problem p = problem_of(c);
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_OK) << g_plugin->last_error();
  attnrt_plan plan = nullptr;
  EXPECT_EQ(g_plugin->plan(&p, &L, &plan), ATTNRT_OK) << g_plugin->last_error();
  if (!plan) return r;
  DeviceBatch db(c, in);
  std::vector<uint16_t> out, first;
  std::vector<float> lse, first_lse;
  for (int rep = 0; rep < reps; ++rep) {
    db.poison();
    EXPECT_EQ(g_plugin->run(plan, &db.ts, nullptr), ATTNRT_OK) << g_plugin->last_error();
    EXPECT_EQ(g_plugin->synchronize({1, 0}), ATTNRT_OK) << g_plugin->last_error();
    db.download(&out, &lse);
    if (rep == 0) {
      first = out;
      first_lse = lse;
    } else if (first != out || std::memcmp(first_lse.data(), lse.data(), lse.size() * 4) != 0) {
      r.repeat_identical = false;
    }
  }
  const bool same = r.repeat_identical;
  r = compare(c, out, lse, ro, rl);
  r.repeat_identical = same;
  g_plugin->destroy_plan(plan);
  return r;
}

void expect_good(const Result& r, const Case& c, uint32_t seed) {
  EXPECT_TRUE(r.all_written) << "unwritten (NaN) output, seed " << seed;
  EXPECT_TRUE(r.repeat_identical) << "repeat not bit-identical, seed " << seed;
  EXPECT_LT(r.rel_o, c.dtype == ATTNRT_BF16 ? 1e-2 : 5e-3) << "seed " << seed << " op " << c.op
                                                           << " d " << c.d;
  EXPECT_EQ(r.over_tol, 0) << "elements outside atol=rtol=5e-3, seed " << seed;
  if (c.lse) {
    EXPECT_LT(r.max_lse, 1e-3) << "seed " << seed;
  }
}

void expect_good(const Case& c, uint32_t seed) { expect_good(run_case(c, seed), c, seed); }

TEST(CudaPlugin, LoadsAndReportsDevice) {
  REQUIRE_GPU();
  char buf[256] = "";
  OKC(g_plugin->describe_device({1, 0}, buf, sizeof buf));
  EXPECT_NE(std::string(buf).find("sm_"), std::string::npos) << buf;
  std::printf("device: %s\n", buf);
  // On compute capability 9.0 the extend tests below run the wgmma kernel unless it is turned off.
  const char* w = std::getenv("ATTNRT_CUDA_WGMMA");
  const bool off = w != nullptr && std::strcmp(w, "0") == 0;
  if (std::string(buf).find("sm_90") != std::string::npos) {
    EXPECT_EQ(std::string(buf).find("wgmma") != std::string::npos, !off) << buf;
  }
}

TEST(CudaPlugin, ProbeReasons) {
  REQUIRE_GPU();
  attnrt_problem p{};
  p.op = ATTNRT_OP_DENSE_EXTEND;
  p.device = {1, 0};
  p.q_dtype = p.kv_dtype = ATTNRT_F32;
  p.page_size = 16;
  p.num_q_heads = 8;
  p.num_kv_heads = 2;
  p.head_dim = 128;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("dtype"), std::string::npos);
  p.q_dtype = p.kv_dtype = ATTNRT_BF16;
  p.head_dim = 96;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("head_dim 96"), std::string::npos);
  p.head_dim = 128;
  p.op = ATTNRT_OP_SPARSE_ATTEND_DECODE;  // sparse ops: test_cuda_sparse.cpp; block_size 0 here
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("block_size 0"), std::string::npos);
  p.op = ATTNRT_OP_DENSE_DECODE;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_OK) << g_plugin->last_error();
}

TEST(CudaPlugin, ExtendRandomSweep) {
  REQUIRE_GPU();
  std::mt19937 rng(1234);
  const int dims[] = {64, 128, 256};
  const int pages[] = {1, 16, 32, 64, 128};
  for (int it = 0; it < 12; ++it) {
    Case c;
    c.op = ATTNRT_OP_DENSE_EXTEND;
    c.dtype = it % 2 ? ATTNRT_F16 : ATTNRT_BF16;
    c.d = dims[it % 3];
    c.page = pages[it % 5];
    c.hkv = 1 + it % 3;
    c.hq = c.hkv * (1 + (it % 4));
    c.sink = it % 3 == 1;
    c.lse = it % 4 != 3;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int b = 0; b < n; ++b) {
      const int ql = 1 + static_cast<int>(rng() % 40);
      c.q_len.push_back(ql);
      c.kv_len.push_back(ql + static_cast<int>(rng() % 200));
    }
    SCOPED_TRACE(it);
    expect_good(c, 100 + it);
  }
}

// Prompts of several 128-row query tiles over contexts of several 128-key tiles, prefixes not a
// multiple of the tile: the d = 128 extend kernels' tile loop, diagonal masks and paging.
TEST(CudaPlugin, ExtendLongPrompts) {
  REQUIRE_GPU();
  std::mt19937 rng(4321);
  const int pages[] = {1, 64, 128, 48, 16, 256, 64};
  for (int it = 0; it < 7; ++it) {
    Case c;
    c.op = ATTNRT_OP_DENSE_EXTEND;
    c.dtype = it % 2 ? ATTNRT_F16 : ATTNRT_BF16;
    c.d = 128;
    c.page = pages[it];
    c.hkv = 1 + it % 2;
    c.hq = c.hkv * (it == 6 ? 8 : it < 3 ? 4 : 2);
    c.sink = it % 3 == 2;
    c.lse = it != 4;
    const int n = 1 + it % 3;
    for (int b = 0; b < n; ++b) {
      const int ql = 100 + static_cast<int>(rng() % 500);
      c.q_len.push_back(ql);
      c.kv_len.push_back(ql + static_cast<int>(rng() % 2) * static_cast<int>(rng() % 400));
    }
    SCOPED_TRACE(it);
    expect_good(c, 300 + it);
  }
}

// Contexts whose K/V over all KV heads exceeds half of the device's L2: the plan orders the
// blocks in sections of fewer KV heads (extend_block), so a head's tiles no longer run next to
// every other head's. Lengths are sized from the L2 at hand so this holds on any device.
TEST(CudaPlugin, ExtendKvBeyondL2) {
  REQUIRE_GPU();
  int l2 = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0), cudaSuccess);
  const int dims[] = {128, 64};
  for (int it = 0; it < 2; ++it) {
    Case c;
    c.op = ATTNRT_OP_DENSE_EXTEND;
    c.dtype = it ? ATTNRT_F16 : ATTNRT_BF16;
    c.d = dims[it];
    c.page = it ? 16 : 64;
    c.hkv = 4;
    c.hq = 8;
    c.sink = it == 1;
    // Keys over both requests: 1.3x the count at which all 4 heads' K/V (2-byte) fill L2 / 2.
    const int keys = static_cast<int>(1.3 * (l2 / 2) / (c.hkv * 2.0 * c.d * 2)) + 1;
    c.q_len = {130, 21};
    c.kv_len = {keys / 2 + 7, keys - keys / 2 - 7};
    int64_t all = 0;
    for (int kv : c.kv_len) all += kv;
    ASSERT_GT(c.hkv * 2 * all * c.d * 2, l2 / 2);
    SCOPED_TRACE(it);
    expect_good(c, 500 + it);
  }
}

TEST(CudaPlugin, DecodeRandomSweepWithSplits) {
  REQUIRE_GPU();
  std::mt19937 rng(99);
  const int dims[] = {64, 128, 256};
  const int pages[] = {1, 16, 32, 64, 128};
  for (int it = 0; it < 12; ++it) {
    Case c;
    c.op = ATTNRT_OP_DENSE_DECODE;
    c.dtype = it % 2 ? ATTNRT_BF16 : ATTNRT_F16;
    c.d = dims[it % 3];
    c.page = pages[it % 5];
    c.hkv = 1 + it % 2;
    c.hq = c.hkv * (1 + (it % 4) * 2);
    c.sink = it % 3 == 0;
    c.lse = it % 4 != 2;
    const int n = 1 + static_cast<int>(rng() % 5);
    for (int b = 0; b < n; ++b) {
      c.q_len.push_back(1);
      // Long single contexts force several splits (some possibly short/empty at the tail).
      c.kv_len.push_back(1 + static_cast<int>(rng() % (it < 4 ? 9000 : 700)));
    }
    SCOPED_TRACE(it);
    expect_good(c, 300 + it);
  }
}

// A decode plan captured in a CUDA graph replays correctly after update_plan refreshes its
// device metadata with new lengths and page lists (same requests, same addresses).
TEST(CudaPlugin, DecodeGraphReplaysWithNewLengths) {
  REQUIRE_GPU();
  ASSERT_NE(g_plugin->update_plan, nullptr);
  Case maxc;  // page room for the longest lengths used below
  maxc.op = ATTNRT_OP_DENSE_DECODE;
  maxc.hq = 8;
  maxc.hkv = 2;
  maxc.page = 16;
  maxc.q_len = {1, 1, 1, 1};
  maxc.kv_len = {6000, 3000, 9000, 900};
  const Inputs in = make_inputs(maxc, 4242);
  const std::vector<std::vector<int>> steps = {
      {5000, 2500, 8000, 600}, {5001, 2501, 8001, 601}, {6000, 3000, 9000, 900}, {1, 17, 4096, 650}};
  Case c = maxc;
  c.kv_len = steps[0];
  Layout lay = layout_of(c, in);
  attnrt_layout L = lay.view(c.page);
  const attnrt_problem p = problem_of(c);
  attnrt_plan plan = nullptr;
  OKC(g_plugin->plan(&p, &L, &plan));
  DeviceBatch db(c, in);
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const int32_t captured = g_plugin->run(plan, &db.ts, st);
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  ASSERT_EQ(captured, ATTNRT_OK) << g_plugin->last_error();
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE(i);
    c.kv_len = steps[i];
    lay = layout_of(c, in);
    L = lay.view(c.page);
    if (i > 0) {
      OKC(g_plugin->update_plan(plan, &L));
    }
    db.poison();
    ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    std::vector<uint16_t> out;
    std::vector<float> lse;
    db.download(&out, &lse);
    std::vector<double> ro, rl;
    reference(c, in, &ro, &rl);
    expect_good(compare(c, out, lse, ro, rl), c, 4242);
  }
  // A layout the plan cannot absorb (another request count) is refused, not misread.
  Case other = c;
  other.q_len = {1, 1, 1};
  other.kv_len = {10, 10, 10};
  Layout lo = layout_of(other, in);
  attnrt_layout L3 = lo.view(c.page);
  EXPECT_EQ(g_plugin->update_plan(plan, &L3), ATTNRT_UNAVAILABLE);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  g_plugin->destroy_plan(plan);
}

}  // namespace
