// GPU tests of the Hopper fast-path plugin (libattnrt_cuda_sm90.so, backend "cuda_sm90"):
// its fused decode indexer against the double-precision reference of sparse_harness.h (top-k
// ascending, unique, -1 padded, equal as sets up to near-ties, forced blocks in, repeats
// bit-identical), graph capture + update_plan replay, a 512k context, the probe's reasons by
// name, and run() refusing (before writing) a cache whose pages are not contiguous.
// Every test skips without a CUDA device; on a device other than sm_90 only the probe test runs.
// ATTNRT_GPU_BENCH=1 times it beside the generic cuda plugin's indexer on the M3 decode shapes.
#include "sparse_harness.h"

namespace {

using namespace gpu_test;
using namespace sparse_test;

int cc_major() {
  int dev = 0, major = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  return major;
}

#define REQUIRE_HOPPER()                                                                  \
  do {                                                                                    \
    REQUIRE_GPU();                                                                        \
    if (cc_major() != 9) GTEST_SKIP() << "cuda_sm90 serves compute capability 9.x only"; \
  } while (0)

// The production shape: one index head, index_dim 128, block = page = 128, top-16, max.
SparseParams m3_params(int init = 0, int local = 1) {
  SparseParams S;
  S.B = 128;
  S.K = 16;
  S.init = init;
  S.local = local;
  return S;
}

Batch decode_batch(int dtype, const std::vector<int32_t>& kv, uint64_t seed) {
  return make_batch(dtype, 16, 1, 1, 128, 128, std::vector<int32_t>(kv.size(), 1), kv, seed,
                    false, true);
}

TEST(CudaSm90, ProbeReasons) {
  REQUIRE_GPU();
  const Batch B = decode_batch(ATTNRT_BF16, {300}, 1);
  attnrt_problem p = problem_of(ATTNRT_OP_SPARSE_INDEX_DECODE, B, m3_params(), 128);
  if (cc_major() == 9) {
    EXPECT_EQ(g_plugin->probe(&p), ATTNRT_OK) << g_plugin->last_error();
  } else {
    EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
    EXPECT_NE(std::string(g_plugin->last_error()).find("compute capability"), std::string::npos);
  }
  // Every unmet requirement is named.
  p.page_size = 64;
  p.topk = 5;
  p.index_dim = 64;
  p.score_type = 1;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  const std::string why = g_plugin->last_error();
  for (const char* s : {"page_size 64", "topk 5", "index_dim 64", "score_type 1"})
    EXPECT_NE(why.find(s), std::string::npos) << "'" << s << "' missing from: " << why;
  p = problem_of(ATTNRT_OP_SPARSE_INDEX_EXTEND, B, m3_params(), 128);
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("op not served"), std::string::npos);
  p = problem_of(ATTNRT_OP_SPARSE_ATTEND_DECODE, B, m3_params(), 128);
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
}

TEST(CudaSm90, IndexDecodeMatchesReference) {
  REQUIRE_HOPPER();
  struct C {
    int dtype, init, local;
    std::vector<int32_t> kv;
  };
  const C cases[] = {
      {ATTNRT_BF16, 0, 1, {300}},                 // fewer blocks than top-k: all selected
      {ATTNRT_BF16, 0, 1, {2048, 2049, 2177}},    // exactly 16, 17 and 18 blocks
      {ATTNRT_BF16, 1, 2, {4000, 130, 9001, 1}},  // ragged, forced init and local blocks
      {ATTNRT_F16, 0, 1, {20000, 7777}},
      {ATTNRT_BF16, 2, 1, {65536}},
  };
  int it = 0;
  for (const C& c : cases) {
    SCOPED_TRACE(it);
    const Batch B = decode_batch(c.dtype, c.kv, 300 + it);
    const SparseParams S = m3_params(c.init, c.local);
    const Paging P = make_paging(B, 128, 11 + it);
    const std::vector<int32_t> topk = run_index(B, S, P, true);
    int ties = 0;
    check_topk(B, S, topk, ref_scores(B, S), &ties);
    std::printf("sm90 indexer case %d: %d near-tie rows of %lld\n", it, ties,
                static_cast<long long>(B.T));
    ++it;
  }
}

// A batch of many requests (more CTAs than one wave, several CTAs per request).
TEST(CudaSm90, IndexDecodeLargeBatch) {
  REQUIRE_HOPPER();
  std::mt19937 rng(7);
  std::vector<int32_t> kv;
  for (int b = 0; b < 40; ++b) kv.push_back(1 + static_cast<int>(rng() % 40000));
  const Batch B = decode_batch(ATTNRT_BF16, kv, 77);
  const SparseParams S = m3_params(1, 1);
  const Paging P = make_paging(B, 128, 9);
  int ties = 0;
  check_topk(B, S, run_index(B, S, P, true), ref_scores(B, S), &ties);
}

TEST(CudaSm90, LongContextDecode) {
  REQUIRE_HOPPER();
  int ctx = 524288;
  if (const char* e = std::getenv("ATTNRT_SPARSE_LONG_CTX")) ctx = std::atoi(e);
  const Batch B = decode_batch(ATTNRT_BF16, {ctx, ctx - 777}, 512);
  const SparseParams S = m3_params();
  const Paging P = make_paging(B, 128, 3);
  int ties = 0;
  check_topk(B, S, run_index(B, S, P, true), ref_scores(B, S), &ties);
  std::printf("sm90 long context %d: near-tie rows %d\n", ctx, ties);
}

// A cache whose pages are not contiguous (two heads' slots interleaved) is refused before any
// output is written, so the host can fall back.
TEST(CudaSm90, RunRefusesNonContiguousPages) {
  REQUIRE_HOPPER();
  const Batch B = decode_batch(ATTNRT_BF16, {3000}, 5);
  const SparseParams S = m3_params();
  const Paging P = make_paging(B, 128, 2);
  attnrt_problem p = problem_of(ATTNRT_OP_SPARSE_INDEX_DECODE, B, S, 128);
  attnrt_layout L = layout_of(B, P);
  attnrt_plan plan = nullptr;
  ASSERT_EQ(g_plugin->plan(&p, &L, &plan), ATTNRT_OK) << g_plugin->last_error();
  Dev dq(B.iq.size() * 2), dk(static_cast<size_t>(P.num_pages) * 128 * 256 * 2), dt(16 * 4);
  attnrt_tensors ts{};
  ts.index_q = tensor(dq.p, B.dtype, 3, {B.T, 1, 128});
  ts.index_k_cache = tensor(dk.p, B.dtype, 4, {P.num_pages, 128, 1, 128});
  ts.index_k_cache.strides[1] = 256;  // token rows 256 elements apart
  ts.index_k_cache.strides[0] = 128 * 256;
  ts.topk = tensor(dt.p, ATTNRT_I32, 3, {1, B.T, 16});
  std::vector<int32_t> poison(16, -7), out(16);
  dt.up(poison.data(), poison.size() * 4);
  EXPECT_EQ(g_plugin->run(plan, &ts, nullptr), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("contiguous"), std::string::npos)
      << g_plugin->last_error();
  g_plugin->synchronize({ATTNRT_DEVICE_CUDA, 0});
  dt.down(out.data(), out.size() * 4);
  EXPECT_EQ(out, poison) << "refused run wrote its output";
  g_plugin->destroy_plan(plan);
}

// Captured once in a CUDA graph, replayed after update_plan with new lengths (new blocks appear):
// the completion counters reset themselves, so every replay selects afresh.
TEST(CudaSm90, GraphReplaysWithNewLengths) {
  REQUIRE_HOPPER();
  const SparseParams S = m3_params(1, 1);
  const std::vector<int32_t> longest = {9000, 30000, 2100};
  const Batch Bmax = decode_batch(ATTNRT_BF16, longest, 31);
  const Paging Pmax = make_paging(Bmax, 128, 5);
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
      {8000, 29000, 1900}, {8001, 29001, 1901}, {8300, 29500, 2048}, {9000, 30000, 2100}};
  Batch B;
  Paging P;
  step(steps[0], &B, &P);
  attnrt_layout L = layout_of(B, P);
  const attnrt_problem pi = problem_of(ATTNRT_OP_SPARSE_INDEX_DECODE, B, S, 128);
  attnrt_plan plan = nullptr;
  ASSERT_EQ(g_plugin->plan(&pi, &L, &plan), ATTNRT_OK) << g_plugin->last_error();
  const std::vector<uint16_t> ikp = to_pool(Bmax, Pmax, Bmax.ik, 1, 128);
  const size_t n_topk = static_cast<size_t>(B.T) * S.K;
  Dev diq(B.iq.size() * 2), dik(ikp.size() * 2), dt(n_topk * 4);
  diq.up(B.iq.data(), B.iq.size() * 2);
  dik.up(ikp.data(), ikp.size() * 2);
  attnrt_tensors ti{};
  ti.index_q = tensor(diq.p, B.dtype, 3, {B.T, 1, 128});
  ti.index_k_cache = tensor(dik.p, B.dtype, 4, {Pmax.num_pages, 128, 1, 128});
  ti.topk = tensor(dt.p, ATTNRT_I32, 3, {1, B.T, S.K});
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const int32_t r = g_plugin->run(plan, &ti, st);
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  ASSERT_EQ(r, ATTNRT_OK) << g_plugin->last_error();
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE(i);
    step(steps[i], &B, &P);
    L = layout_of(B, P);
    if (i > 0) {
      ASSERT_EQ(g_plugin->update_plan(plan, &L), ATTNRT_OK) << g_plugin->last_error();
    }
    for (int rep = 0; rep < 2; ++rep) {  // a second replay of the same step: counters reset
      std::vector<int32_t> poison(n_topk, -7), topk(n_topk);
      dt.up(poison.data(), poison.size() * 4);
      ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
      dt.down(topk.data(), topk.size() * 4);
      int ties = 0;
      check_topk(B, S, topk, ref_scores(B, S), &ties);
    }
  }
  Batch Bl = Bmax;
  Bl.kv_len = {400000, 10, 10};
  Paging Pl = make_paging(Bl, 128, 0);
  attnrt_layout Ll = layout_of(Bl, Pl);
  EXPECT_EQ(g_plugin->update_plan(plan, &Ll), ATTNRT_UNAVAILABLE);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  g_plugin->destroy_plan(plan);
}

// M3 per-rank decode indexer: cuda_sm90 beside the generic cuda plugin, same data, same call.
TEST(CudaSm90, BenchM3) {
  REQUIRE_HOPPER();
  if (!std::getenv("ATTNRT_GPU_BENCH")) GTEST_SKIP() << "set ATTNRT_GPU_BENCH=1 to time";
  std::string why;
  const attnrt_plugin_v1* generic = open_plugin(plugin_file_path(ATTNRT_CUDA_GENERIC_FILE), &why);
  ASSERT_NE(generic, nullptr) << why;
  struct Shape {
    const char* name;
    int n, kl;
  };
  const Shape shapes[] = {{"decode 1x64k", 1, 65536},   {"decode 1x128k", 1, 131072},
                          {"decode 16x64k", 16, 65536}, {"decode 64x64k", 64, 65536},
                          {"decode 64x128k", 64, 131072}};
  for (const Shape& s : shapes) {
    // Tile a random 1024-token pattern over the context (host generation would take minutes).
    Batch B = decode_batch(ATTNRT_BF16, std::vector<int32_t>(s.n, 1024), 1);
    B.kv_len.assign(s.n, s.kl);
    B.tok_off.assign(s.n + 1, 0);
    for (int b = 0; b < s.n; ++b) B.tok_off[b + 1] = B.tok_off[b] + s.kl;
    const size_t toks = static_cast<size_t>(B.tok_off[s.n]), row = 128;
    std::vector<uint16_t> pat(B.ik.begin(), B.ik.begin() + 1024 * row);
    B.ik.resize(toks * row);
    for (size_t i = pat.size(); i < B.ik.size(); i += pat.size())
      std::copy(pat.begin(), pat.begin() + std::min(pat.size(), B.ik.size() - i), B.ik.begin() + i);
    const SparseParams S = m3_params();
    const Paging P = make_paging(B, 128, 5);
    double t_fast = 0, t_gen = 0;
    const std::vector<int32_t> a = run_index(B, S, P, true, &t_fast, 50);
    const std::vector<int32_t> g = run_index(B, S, P, true, &t_gen, 50, generic);
    const double bytes = static_cast<double>(toks) * row * 2;
    std::printf("BENCH sm90 %-16s fast %8.4f ms (%5.2f TB/s)  generic %8.4f ms (%5.2f TB/s)  "
                "generic/fast %.2fx  same selections: %s\n",
                s.name, t_fast, bytes / t_fast / 1e9, t_gen, bytes / t_gen / 1e9, t_gen / t_fast,
                a == g ? "yes" : "no (near-ties)");
    std::fflush(stdout);
  }
}

}  // namespace
