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
#include "sparse_harness.h"

namespace {

using namespace gpu_test;
using namespace sparse_test;

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

// sparse_decode is the two decode ops in sequence: the same top-k and the same output bits as
// the indexer's call followed by sparse attend on its selections (GQA group of 4, two index heads
// per KV head: the union path; top-k 5; sink and lse).
TEST(CudaSparse, SparseDecodeEqualsIndexThenAttend) {
  REQUIRE_GPU();
  for (int dtype : {ATTNRT_BF16, ATTNRT_F16}) {
    SCOPED_TRACE(dtype);
    const Batch B = make_batch(dtype, 8, 2, 4, 64, 64, {1, 1, 1}, {5000, 77, 12345}, 41 + dtype);
    SparseParams S;
    S.B = 64;
    S.K = 5;
    S.init = 1;
    S.local = 2;
    S.sink = true;
    S.lse = true;
    const Paging P = make_paging(B, 32, 8);
    const SparseDecodeOut got = run_sparse_decode(B, S, P);
    const std::vector<int32_t> topk = run_index(B, S, P, true);
    EXPECT_EQ(got.topk, topk);
    const AttendOut two = run_attend(ATTNRT_OP_SPARSE_ATTEND_DECODE, B, S, P, &topk);
    EXPECT_TRUE(got.att.o == two.o &&
                std::memcmp(got.att.lse.data(), two.lse.data(), two.lse.size() * 4) == 0)
        << "sparse_decode differs from index then attend";
    std::vector<double> ro, rl;
    ref_attend(B, S, &got.topk, true, ro, rl);
    double w = 0;
    expect_close(B, S, got.att, ro, rl, &w);
  }
}

// A run the plugin refuses writes nothing (plugin.h's contract): a sparse_decode whose query
// rows are not 16-byte aligned is refused before its indexer half writes topk.
TEST(CudaSparse, RefusedSparseDecodeWritesNothing) {
  REQUIRE_GPU();
  const Batch B = make_batch(ATTNRT_BF16, 8, 2, 2, 64, 64, {1, 1}, {3000, 700}, 17);
  SparseParams S;
  S.B = 64;
  S.K = 4;
  S.lse = true;
  const Paging P = make_paging(B, 32, 5);
  DeviceBatch D(B, P, S, ATTNRT_OP_SPARSE_DECODE);
  attnrt_problem p = problem_of(ATTNRT_OP_SPARSE_DECODE, B, S, P.ps);
  attnrt_layout L = layout_of(B, P);
  attnrt_plan plan = nullptr;
  ASSERT_EQ(g_plugin->plan(&p, &L, &plan), ATTNRT_OK) << g_plugin->last_error();
  attnrt_tensors ts = D.tensors(ATTNRT_OP_SPARSE_DECODE);
  ts.q.data = static_cast<char*>(ts.q.data) + 2;  // one element on: 2-byte aligned rows
  D.poison();
  EXPECT_EQ(g_plugin->run(plan, &ts, nullptr), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("aligned"), std::string::npos)
      << g_plugin->last_error();
  EXPECT_EQ(g_plugin->synchronize({ATTNRT_DEVICE_CUDA, 0}), ATTNRT_OK) << g_plugin->last_error();
  EXPECT_EQ(D.topk_host(), std::vector<int32_t>(D.topk_count(), -7)) << "topk written";
  const AttendOut o = D.att_host();
  EXPECT_TRUE(std::all_of(o.o.begin(), o.o.end(), [](uint16_t x) { return x == 0x7fc1; }))
      << "out written";
  g_plugin->destroy_plan(plan);
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
  const std::vector<std::vector<int32_t>> steps = {
      {2800, 4900, 1000}, {2801, 4901, 1001}, {2880, 4990, 1090}, {3000, 5000, 1300}};
  Batch B;
  Paging P;
  shorter_step(Bmax, Pmax, steps[0], &B, &P);
  attnrt_layout L = layout_of(B, P);
  const attnrt_problem pi = problem_of(ATTNRT_OP_SPARSE_INDEX_DECODE, B, S, P.ps);
  const attnrt_problem pa = problem_of(ATTNRT_OP_SPARSE_ATTEND_DECODE, B, S, P.ps);
  attnrt_plan plan_i = nullptr, plan_a = nullptr;
  ASSERT_EQ(g_plugin->plan(&pi, &L, &plan_i), ATTNRT_OK) << g_plugin->last_error();
  ASSERT_EQ(g_plugin->plan(&pa, &L, &plan_a), ATTNRT_OK) << g_plugin->last_error();
  // Every step's rows and pages are in the longest one's.
  DeviceBatch D(Bmax, Pmax, S, ATTNRT_OP_SPARSE_DECODE);
  const attnrt_tensors ti = D.tensors(ATTNRT_OP_SPARSE_INDEX_DECODE),
                       ta = D.tensors(ATTNRT_OP_SPARSE_ATTEND_DECODE);
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
    shorter_step(Bmax, Pmax, steps[i], &B, &P);
    L = layout_of(B, P);
    if (i > 0) {
      ASSERT_EQ(g_plugin->update_plan(plan_i, &L), ATTNRT_OK) << g_plugin->last_error();
      ASSERT_EQ(g_plugin->update_plan(plan_a, &L), ATTNRT_OK) << g_plugin->last_error();
    }
    D.poison();
    ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    const std::vector<int32_t> topk = D.topk_host();
    int ties = 0;
    check_topk(B, S, topk, ref_scores(B, S), &ties);
    const AttendOut got = D.att_host();
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
