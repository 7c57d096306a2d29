// GPU tests of the Hopper fast-path plugin (libattnrt_cuda_sm90.so, backend "cuda_sm90"):
// its indexer and sparse attend, decode and extend, against the double-precision references of
// sparse_harness.h (top-k ascending, unique, -1 padded, equal as sets up to near-ties, forced
// blocks in; outputs within atol = rtol = 5e-3, lse 1e-3; repeats bit-identical; outputs
// poisoned), sparse_decode (both in one launch) likewise, also run solo (as when another kernel
// holds the SMs its CTAs need, and really beside one), both ops or sparse_decode captured in
// one CUDA graph and replayed after update_plan, a 512k context, the probe's reasons by name,
// and run() refusing (before writing) a cache whose pages are not contiguous.
// First of all, the first runs of f16 plans beside a kernel that waits for them (no code loaded in
// run()). Every test skips without a CUDA device; on a device other than sm_90 only the probe
// test runs.
// ATTNRT_GPU_BENCH=1 times it beside the generic cuda plugin on the M3 decode and extend shapes.
#include <chrono>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "l2_read_flush.h"
#include "sm_occupier.h"
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

void check_sparse_decode_out(const Batch& B, const SparseParams& S, const SparseDecodeOut& got,
                             const std::string& what);
std::string plugin_error_after_failure(const attnrt_plugin_v1* plug);

// What launches beside a kernel that holds all but 4 multiprocessors gave: run()'s status, the
// stream's once done (or after 20 s), the host time from the launch to then, and how many of
// the holding kernel's CTAs still ran then.
struct BesideHeldSms {
  int32_t status = ATTNRT_OK;
  cudaError_t stream = cudaErrorNotReady;
  double ms = 0;
  int still_held = 0, held = 0;
};
// Starts the holding kernel on a stream of its own (it ends when released or after
// `limit_ms`), calls launch() (which enqueues on `st` and returns run()'s status), waits for
// `st`, then releases the holding kernel.
template <class F>
BesideHeldSms run_beside_held_sms(cudaStream_t st, int limit_ms, F launch) {
  BesideHeldSms b;
  cudaStream_t held;
  SmOccupier occ;
  cudaError_t e = cudaStreamCreateWithFlags(&held, cudaStreamNonBlocking);
  if (e == cudaSuccess && (e = sm_occupier_start(4, limit_ms, held, &occ)) != cudaSuccess)
    cudaStreamDestroy(held);
  if (e != cudaSuccess) {
    ADD_FAILURE() << "the kernel holding the SMs did not start: " << cudaGetErrorString(e);
    b.stream = e;
    return b;
  }
  const auto t0 = std::chrono::steady_clock::now();
  b.status = launch();
  while ((b.stream = cudaStreamQuery(st)) == cudaErrorNotReady &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  b.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  b.held = occ.ctas;
  for (int i = 0; i < occ.ctas; ++i) b.still_held += occ.running[i];
  EXPECT_EQ(sm_occupier_release(&occ, held), cudaSuccess);
  cudaStreamDestroy(held);
  return b;
}

// The first test of the binary, so that no kernel of either plugin has run in the process yet:
// the first run() of a plan must not load code. Under CUDA's lazy loading a kernel loads at its
// first launch, and a load may wait for every kernel on the device; a kernel of the engine's on
// another stream that waits for this step (a collective waiting for other ranks) then never
// ends. plan() loads every kernel (plugin.h). Here f16 steps of both plugins (the dtype no other
// test of this binary runs first) are planned, then run beside a kernel that holds all but 4
// multiprocessors until the host lets it go after the steps, or until its 10 s limit: steps
// whose first launch loaded code would end only after that limit, with the kernel gone.
TEST(CudaSm90, FirstRunsLoadNoCode) {
  REQUIRE_HOPPER();
  std::string why;
  const attnrt_plugin_v1* generic = open_plugin(plugin_file_path(ATTNRT_CUDA_GENERIC_FILE), &why);
  ASSERT_NE(generic, nullptr) << why;
  const Batch B = make_batch(ATTNRT_F16, 16, 1, 1, 128, 128, {1}, {20000}, 2100, true, true);
  const SparseParams S = m3_params(1, 2);
  const Paging P = make_paging(B, 128, 2101);
  DeviceBatch D(B, P, S, ATTNRT_OP_SPARSE_DECODE);
  struct Step {
    const attnrt_plugin_v1* plug;
    int op;
    attnrt_plan plan;
  };
  // The fast path's sparse_decode last: its output is the one checked. Not its attend alone:
  // that launches clusters of 16 CTAs, which the 4 free multiprocessors may never hold at once.
  Step steps[] = {{generic, ATTNRT_OP_SPARSE_DECODE, nullptr},
                  {g_plugin, ATTNRT_OP_SPARSE_INDEX_DECODE, nullptr},
                  {g_plugin, ATTNRT_OP_SPARSE_DECODE, nullptr}};
  const attnrt_layout L = layout_of(B, P);
  for (Step& s : steps) {
    attnrt_problem p = problem_of(s.op, B, S, 128);
    const auto p0 = std::chrono::steady_clock::now();
    ASSERT_EQ(s.plug->plan(&p, &L, &s.plan), ATTNRT_OK) << s.plug->last_error();
    std::printf("plan of op %d (%s): %.2f ms\n", s.op, s.plug == generic ? "cuda" : "cuda_sm90",
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p0)
                    .count());
  }
  D.poison();
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  const BesideHeldSms b = run_beside_held_sms(st, 10000, [&] {
    int32_t r = ATTNRT_OK;
    for (const Step& s : steps) {
      const attnrt_tensors ts = D.tensors(s.op);
      if (r == ATTNRT_OK) r = s.plug->run(s.plan, &ts, st);
    }
    return r;
  });
  ASSERT_EQ(b.status, ATTNRT_OK) << g_plugin->last_error() << " / " << generic->last_error();
  ASSERT_EQ(b.stream, cudaSuccess) << "the steps did not finish ("
                                   << cudaGetErrorString(b.stream) << "); "
                                   << plugin_error_after_failure(g_plugin);
  EXPECT_EQ(b.still_held, b.held)
      << "the first runs finished only after the kernel beside them had ended (" << b.ms << " ms)";
  std::printf("first runs of 3 f16 plans beside %d held multiprocessors: %.2f ms\n", b.held, b.ms);
  SparseDecodeOut got;
  got.topk = D.topk_host();
  got.att = D.att_host();
  check_sparse_decode_out(B, S, got, "first run, f16");
  for (const Step& s : steps) s.plug->destroy_plan(s.plan);
  cudaStreamDestroy(st);
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
  if (cc_major() == 9) {
    EXPECT_EQ(g_plugin->probe(&p), ATTNRT_OK) << g_plugin->last_error();
  }
  p.op = ATTNRT_OP_DENSE_DECODE;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("op not served"), std::string::npos);
  const Batch Ba = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, {1}, {300}, 1, false, false);
  p = problem_of(ATTNRT_OP_SPARSE_ATTEND_DECODE, Ba, m3_params(), 128);
  if (cc_major() == 9) {
    EXPECT_EQ(g_plugin->probe(&p), ATTNRT_OK) << g_plugin->last_error();
  }
  p.num_kv_heads = 2;
  p.num_q_heads = 32;
  p.head_dim = 64;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  const std::string why_a = g_plugin->last_error();
  for (const char* s : {"num_kv_heads 2", "num_q_heads 32", "head_dim 64"})
    EXPECT_NE(why_a.find(s), std::string::npos) << "'" << s << "' missing from: " << why_a;
}

TEST(CudaSm90, AttendDecodeMatchesReference) {
  REQUIRE_HOPPER();
  struct C {
    int dtype;
    bool sink, lse;
    std::vector<int32_t> kv;
  };
  // Larger batches take fewer CTAs per request (16 / 4 / 2 / 1 at 20 / 30 / 40 / 70 requests on
  // an H200), each streaming several selected blocks; short requests leave some CTAs no block.
  auto ragged = [](int n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> kv;
    for (int b = 0; b < n; ++b) kv.push_back(1 + static_cast<int>(rng() % (b % 3 ? 40000 : 1500)));
    return kv;
  };
  const C cases[] = {
      {ATTNRT_BF16, false, true, {300}},                  // 3 blocks: 13 empty slots
      {ATTNRT_BF16, true, true, {4000, 130, 9001, 2048}},  // ragged, partial last blocks
      {ATTNRT_F16, true, false, {20000, 7777, 1}},
      {ATTNRT_BF16, false, false, {65536}},
      {ATTNRT_BF16, true, true, ragged(20, 1)},
      {ATTNRT_BF16, false, true, ragged(30, 2)},
      {ATTNRT_F16, true, true, ragged(40, 3)},
      {ATTNRT_BF16, true, false, ragged(70, 4)},
  };
  int it = 0;
  for (const C& c : cases) {
    SCOPED_TRACE(it);
    const Batch B = make_batch(c.dtype, 16, 1, 1, 128, 128, std::vector<int32_t>(c.kv.size(), 1),
                               c.kv, 600 + it, true, false);
    SparseParams S = m3_params();
    S.sink = c.sink;
    S.lse = c.lse;
    const Paging P = make_paging(B, 128, 21 + it);
    std::vector<int32_t> topk = random_topk(B, S, 40 + it);
    // A repeated id counts once (the reference takes the union).
    if (it == 1 || it >= 4) topk[3] = topk[2];
    const AttendOut got = run_attend(ATTNRT_OP_SPARSE_ATTEND_DECODE, B, S, P, &topk);
    std::vector<double> ro, rl;
    ref_attend(B, S, &topk, true, ro, rl);
    double worst = 0;
    expect_close(B, S, got, ro, rl, &worst);
    std::printf("sm90 attend case %d: max abs err %.2e\n", it, worst);
    ++it;
  }
}

// The indexer (decode or extend form) on B through a scrambled page table (seed page_seed):
// top-k checked against the reference; prints the near-tie rows as "<label> case <it>".
void expect_index_matches(const Batch& B, const SparseParams& S, uint32_t page_seed, bool decode,
                          const char* label, int it) {
  const Paging P = make_paging(B, 128, page_seed);
  int ties = 0;
  check_topk(B, S, run_index(B, S, P, decode), ref_scores(B, S), &ties);
  std::printf("%s case %d: %d near-tie rows of %lld\n", label, it, ties,
              static_cast<long long>(B.T));
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
    expect_index_matches(decode_batch(c.dtype, c.kv, 300 + it), m3_params(c.init, c.local),
                         11 + it, true, "sm90 indexer", it);
    ++it;
  }
}

// Extend (prefill with a prefix): ragged requests, tiles of 128 tokens cut mid-request, rows
// with fewer visible blocks than top-k, forced init/local blocks, f16.
TEST(CudaSm90, IndexExtendMatchesReference) {
  REQUIRE_HOPPER();
  struct C {
    int dtype, init, local;
    std::vector<int32_t> ql, kv;
  };
  const C cases[] = {
      {ATTNRT_BF16, 0, 1, {300}, {300}},                       // no prefix: 1..3 blocks visible
      {ATTNRT_BF16, 1, 2, {129, 1, 260}, {2500, 2049, 4100}},  // prefix, ragged, forced blocks
      {ATTNRT_F16, 0, 1, {200, 77}, {9000, 3000}},
      {ATTNRT_BF16, 2, 1, {513}, {20000}},
  };
  int it = 0;
  for (const C& c : cases) {
    SCOPED_TRACE(it);
    expect_index_matches(
        make_batch(c.dtype, 16, 1, 1, 128, 128, c.ql, c.kv, 700 + it, false, true),
        m3_params(c.init, c.local), 13 + it, false, "sm90 index extend", it);
    ++it;
  }
}

// Extend attend: each token over its own selection (own block masked past its position),
// repeated ids and -1 slots, sink and lse on and off; the same call through an in-order and a
// scrambled page table gives the same bits.
TEST(CudaSm90, AttendExtendMatchesReference) {
  REQUIRE_HOPPER();
  struct C {
    int dtype;
    bool sink, lse;
    std::vector<int32_t> ql, kv;
  };
  const C cases[] = {
      {ATTNRT_BF16, false, true, {200}, {200}},
      {ATTNRT_BF16, true, true, {129, 1, 64}, {4000, 2049, 9001}},
      {ATTNRT_F16, true, false, {100, 30}, {3000, 30}},
  };
  int it = 0;
  for (const C& c : cases) {
    SCOPED_TRACE(it);
    const Batch B = make_batch(c.dtype, 16, 1, 1, 128, 128, c.ql, c.kv, 800 + it, true, false);
    SparseParams S = m3_params();
    S.sink = c.sink;
    S.lse = c.lse;
    std::vector<int32_t> topk = random_topk(B, S, 50 + it);
    if (it == 1) {
      topk[5 * S.K + 3] = topk[5 * S.K + 2];  // a repeated id counts once
      for (int k = 0; k < S.K; ++k) topk[7 * S.K + k] = -1;  // nothing selected: o = 0
    }
    const AttendOut got = run_attend(ATTNRT_OP_SPARSE_ATTEND_EXTEND, B, S, make_paging(B, 128, 0), &topk);
    const AttendOut scrambled =
        run_attend(ATTNRT_OP_SPARSE_ATTEND_EXTEND, B, S, make_paging(B, 128, 31 + it), &topk);
    EXPECT_TRUE(got.o == scrambled.o) << "paged placement changed the output bits";
    std::vector<double> ro, rl;
    ref_attend(B, S, &topk, false, ro, rl);
    double worst = 0;
    expect_close(B, S, got, ro, rl, &worst);
    std::printf("sm90 attend extend case %d: max abs err %.2e\n", it, worst);
    ++it;
  }
}

// Every block scores the same (index keys all zero): the selection is decided by ties alone, so
// it must be exactly the forced blocks and then the lowest ids, from 17 to 1563 blocks.
TEST(CudaSm90, IndexDecodeTiesGoToLowestIds) {
  REQUIRE_HOPPER();
  Batch B = decode_batch(ATTNRT_BF16, {70000, 1024 * 128, 200000, 2100}, 91);
  std::fill(B.ik.begin(), B.ik.end(), uint16_t{0});
  const SparseParams S = m3_params(1, 2);
  const Paging P = make_paging(B, 128, 13);
  const std::vector<int32_t> got = run_index(B, S, P, true);
  for (size_t b = 0; b < B.kv_len.size(); ++b) {
    const int nblk = (B.kv_len[b] + 127) / 128;
    std::vector<int32_t> want;
    for (int c = 0; c < 14 && c < nblk - 2; ++c) want.push_back(c);  // init block 0, then lowest
    for (int c = std::max(nblk - 2, 14); c < nblk; ++c) want.push_back(c);  // the local blocks
    want.resize(16, -1);
    const std::vector<int32_t> row(got.begin() + b * 16, got.begin() + (b + 1) * 16);
    EXPECT_EQ(row, want) << "request " << b << " (" << nblk << " blocks)";
  }
}

// A batch of many requests, several CTAs per request, ragged lengths.
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

// After a failed stream or event sync: the plugin's own error (the decode watchdog's line, if it
// fired), or "" when its synchronize passes.
std::string plugin_error_after_failure(const attnrt_plugin_v1* plug) {
  return plug->synchronize({ATTNRT_DEVICE_CUDA, 0}) == ATTNRT_OK ? "" : plug->last_error();
}

// An extra symbol of the plugin under test, beside its ABI table (nullptr if it has none).
void* plugin_symbol(const char* name) {
  void* h = dlopen(plugin_path().c_str(), RTLD_NOW | RTLD_LOCAL);  // loaded already: no init
  void* sym = h ? dlsym(h, name) : nullptr;
  if (h) dlclose(h);  // the harness keeps the plugin loaded, so `sym` stays valid
  return sym;
}

// Requests run solo so far, both decode ops together: the plugin's degraded_runs (ABI 1.2),
// whose note must say what it counts.
uint64_t solo_requests() {
  if (g_plugin->struct_size < sizeof(attnrt_plugin_v1) || !g_plugin->degraded_runs) {
    ADD_FAILURE() << "the plugin reports no degraded runs (ABI 1.2 degraded_runs)";
    return 0;
  }
  uint64_t total = 0;
  for (const int32_t op : {ATTNRT_OP_SPARSE_INDEX_DECODE, ATTNRT_OP_SPARSE_DECODE}) {
    uint64_t n = 0;
    char note[256] = "unwritten";
    EXPECT_EQ(g_plugin->degraded_runs({ATTNRT_DEVICE_CUDA, 0}, op, &n, note, sizeof note),
              ATTNRT_OK)
        << g_plugin->last_error();
    EXPECT_NE(std::string(note).find("requests run solo"), std::string::npos)
        << "op " << op << ": " << note;
    total += n;
  }
  return total;
}

// Checks a sparse_decode output of B against the reference: top-k equal as sets (near ties
// allowed), outputs and lse within tolerance. Prints `what` with the worst error.
// check_sparse_decode() runs sparse_decode on B first.
void check_sparse_decode_out(const Batch& B, const SparseParams& S, const SparseDecodeOut& got,
                             const std::string& what) {
  int ties = 0;
  check_topk(B, S, got.topk, ref_scores(B, S), &ties);
  std::vector<double> ro, rl;
  ref_attend(B, S, &got.topk, true, ro, rl);
  double worst = 0;
  expect_close(B, S, got.att, ro, rl, &worst);
  std::printf("sm90 sparse_decode %s: max abs err %.2e, near-tie rows %d\n", what.c_str(), worst,
              ties);
}
void check_sparse_decode(const Batch& B, const SparseParams& S, const Paging& P,
                         const std::string& what) {
  check_sparse_decode_out(B, S, run_sparse_decode(B, S, P), what);
}

// Sets the index keys of block c of request b to sc times the request's index query, so that
// the block scores sc * |q_idx|^2.
void scale_block_keys(Batch& B, int b, int c, float sc) {
  const size_t row = static_cast<size_t>(B.didx);
  const int64_t t1 = std::min<int64_t>((c + 1) * 128, B.kv_len[b]);
  for (int64_t t = c * 128; t < t1; ++t)
    for (size_t x = 0; x < row; ++x)
      B.ik[(B.tok_off[b] + t) * row + x] = B.enc(sc * B.dec(B.iq[b * row + x]));
}

// A sparse_decode case at the M3 per-rank shape (16 q heads, 1 KV head, 1 index head, D = 128):
// one request per kv entry, each with one query.
struct DecodeCase {
  int dtype;
  bool sink, lse;
  int init, local;
  std::vector<int32_t> kv;
};

// Builds case c's batch and paging from the two seeds, runs sparse_decode and checks it.
void check_decode_case(const DecodeCase& c, uint64_t batch_seed, uint64_t paging_seed,
                       const std::string& what) {
  const Batch B = make_batch(c.dtype, 16, 1, 1, 128, 128, std::vector<int32_t>(c.kv.size(), 1),
                             c.kv, batch_seed, true, true);
  SparseParams S = m3_params(c.init, c.local);
  S.sink = c.sink;
  S.lse = c.lse;
  check_sparse_decode(B, S, make_paging(B, 128, paging_seed), what);
}

// sparse_decode, the indexer and attend in one launch: its top-k against the reference scores,
// its output against the reference attention over the top-k it wrote. Cases cover every path of
// the kernel: a context of at most 16 blocks (all taken, no barrier), one request (64k, and 512k:
// 4096 block keys a CTA ranks against), ragged batches with several CTAs per request (a CTA
// attends one slot, or several when a request has fewer than 16 CTAs; slot holders with no blocks
// of their own), a batch past one wave of CTAs (one CTA per request attends all 16), sink and lse
// on and off, f16.
TEST(CudaSm90, SparseDecodeMatchesReference) {
  REQUIRE_HOPPER();
  auto ragged = [](int n, int max_kv, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> kv;
    for (int b = 0; b < n; ++b) kv.push_back(1 + static_cast<int>(rng() % max_kv));
    return kv;
  };
  const uint64_t solo0 = solo_requests();
  const DecodeCase cases[] = {
      {ATTNRT_BF16, false, true, 0, 1, {300}},
      {ATTNRT_BF16, true, true, 1, 2, {4000, 130, 9001, 2048}},
      {ATTNRT_F16, true, false, 0, 1, {20000, 7777, 1}},
      {ATTNRT_BF16, false, true, 1, 1, {65536}},
      {ATTNRT_BF16, true, true, 2, 4, ragged(20, 40000, 1)},
      {ATTNRT_F16, false, true, 0, 1, ragged(70, 30000, 2)},
      {ATTNRT_BF16, true, true, 1, 1, ragged(420, 6000, 3)},
      {ATTNRT_BF16, false, false, 0, 1, ragged(16, 70000, 4)},
      {ATTNRT_BF16, true, true, 1, 2, {524288}},
  };
  int it = 0;
  for (const DecodeCase& c : cases) {
    SCOPED_TRACE(it);
    check_decode_case(c, 900 + it, 31 + it,
                      "case " + std::to_string(it) + " (" + std::to_string(c.kv.size()) +
                          " requests)");
    ++it;
  }
  // Every CTA of a launch starts at once on an otherwise idle GPU: no request runs solo.
  EXPECT_EQ(solo_requests(), solo0);
}

// sparse_decode on a strided pattern of near-winners: in the first request (2048 blocks) block
// c's index keys are q_idx * s_c with s_c in [1 + g, 1.5 + g] for g = c % 128 < 16 and 0
// otherwise, so the winners lie 128 blocks apart (ranked by CTAs far from the ones attending
// them) and 240 more blocks score far above the rest; the second request has random keys.
// Top-k and output against the reference.
TEST(CudaSm90, SparseDecodeStridedNearWinners) {
  REQUIRE_HOPPER();
  Batch B = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, {1, 1}, {262144, 5000}, 77, true, true);
  std::mt19937 rng(78);
  std::uniform_real_distribution<float> half(0.f, 0.5f);
  for (int c = 0; c < 2048; ++c) {
    const int g = c % 128;
    scale_block_keys(B, 0, c, g < 16 ? 1.f + static_cast<float>(g) + half(rng) : 0.f);
  }
  check_sparse_decode(B, m3_params(), make_paging(B, 128, 41), "strided near-winners");
}

// Many launches of one sparse_decode plan at batch 64 (6 CTAs a request, each attending two or
// three ranks handed on by their rankers), queued and replayed in a CUDA graph on a non-blocking
// stream after an L2-evicting read: the shape at which a graph of this op hung on the H100 and
// the H200 (2026-12-06), intermittently. Every launch must finish (the watchdog turns a hang into
// an error after 10 s), and every launch must write the same outputs, those of the reference.
TEST(CudaSm90, SparseDecodeManyLaunchesAtBatch64) {
  REQUIRE_HOPPER();
  const int n = 64, launches = 300;
  const Batch B = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, std::vector<int32_t>(n, 1),
                             std::vector<int32_t>(n, 4096), 64, true, true);
  const SparseParams S = m3_params();
  const Paging P = make_paging(B, 128, 9);
  DeviceBatch D(B, P, S, ATTNRT_OP_SPARSE_DECODE);
  const SparseDecodeOut first = run_sparse_decode(D);  // checked against the reference below
  attnrt_problem p = problem_of(ATTNRT_OP_SPARSE_DECODE, B, S, 128);
  attnrt_layout L = layout_of(B, P);
  attnrt_plan plan = nullptr;
  ASSERT_EQ(g_plugin->plan(&p, &L, &plan), ATTNRT_OK) << g_plugin->last_error();
  const attnrt_tensors ts = D.tensors(ATTNRT_OP_SPARSE_DECODE);
  for (int i = 0; i < launches; ++i) ASSERT_EQ(g_plugin->run(plan, &ts, nullptr), ATTNRT_OK);
  ASSERT_EQ(g_plugin->synchronize({ATTNRT_DEVICE_CUDA, 0}), ATTNRT_OK) << g_plugin->last_error();
  EXPECT_EQ(D.topk_host(), first.topk) << "queued launches";
  Dev flush(256u << 20), sink(sizeof(unsigned));
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const int32_t r = g_plugin->run(plan, &ts, st);
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  ASSERT_EQ(r, ATTNRT_OK) << g_plugin->last_error();
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < launches; ++i) {
    ASSERT_EQ(l2_read_flush(flush.p, flush.bytes, static_cast<unsigned*>(sink.p), st), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
  }
  const cudaError_t e = cudaStreamSynchronize(st);
  ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e) << "; "
                            << plugin_error_after_failure(g_plugin);
  D.poison();
  ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
  EXPECT_EQ(D.topk_host(), first.topk) << "graph replays";
  const AttendOut last = D.att_host();
  EXPECT_TRUE(last.o == first.att.o) << "graph replays: out not bit-identical to the first launch";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  g_plugin->destroy_plan(plan);
  check_sparse_decode_out(B, S, first,
                          "64 x 4k, then " + std::to_string(launches) + " queued + " +
                              std::to_string(launches) + " graph launches alike");
}

// Fault injection: ATTNRT_SM90_FAULT=barrier makes a decode plan start its requests' launch
// counters one launch ahead of their arrivals, so the CTAs of each request wait at the top-16
// barrier for arrivals that never come. The watchdog must turn that into a failed launch whose
// error says where, within its 10 s, instead of a hang. Runs in a child process (the trap ends
// the CUDA context).
TEST(CudaSm90DeathTest, BrokenBarrierFailsInsteadOfHanging) {
  REQUIRE_HOPPER();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto broken_step = [] {
    setenv("ATTNRT_SM90_FAULT", "barrier", 1);
    const Batch B = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, {1}, {8192}, 5, true, true);
    const SparseParams S = m3_params();
    const Paging P = make_paging(B, 128, 3);
    DeviceBatch D(B, P, S, ATTNRT_OP_SPARSE_DECODE);
    attnrt_problem p = problem_of(ATTNRT_OP_SPARSE_DECODE, B, S, 128);
    attnrt_layout L = layout_of(B, P);
    attnrt_plan plan = nullptr;
    if (g_plugin->plan(&p, &L, &plan) != ATTNRT_OK) {
      std::fprintf(stderr, "plan failed: %s\n", g_plugin->last_error());
      std::exit(3);
    }
    const attnrt_tensors ts = D.tensors(ATTNRT_OP_SPARSE_DECODE);
    int32_t s = g_plugin->run(plan, &ts, nullptr);
    if (s == ATTNRT_OK) s = g_plugin->synchronize({ATTNRT_DEVICE_CUDA, 0});
    std::fprintf(stderr, "status %d: %s\n", s, g_plugin->last_error());
    std::exit(s == ATTNRT_INTERNAL ? 0 : 4);
  };
  EXPECT_EXIT(broken_step(), ::testing::ExitedWithCode(0),
              "cuda_sm90 watchdog: request 0 CTA [0-9]+ waited over 10 s");
}

// Sets an environment variable for the scope (plans read ATTNRT_SM90_FAULT when made).
struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~ScopedEnv() { unsetenv(name); }
};

// Solo mode (index_decode.h: the request's last CTA to start ranks and attends every block
// alone, the others leave after scoring), forced by ATTNRT_SM90_FAULT=solo: sparse_decode and the
// decode indexer against the reference on every path (at most 16 blocks, one request, a ragged
// batch with forced blocks, sink and lse, f16), and every request counted as run solo (the
// indexer alone runs a request of at most 16 blocks as shared: it waits for no peer). The test
// below reaches solo mode for real.
TEST(CudaSm90, SoloModeMatchesReference) {
  REQUIRE_HOPPER();
  const ScopedEnv fault("ATTNRT_SM90_FAULT", "solo");
  const uint64_t solo0 = solo_requests();
  uint64_t expected = 0;
  const DecodeCase cases[] = {
      {ATTNRT_BF16, false, true, 0, 1, {300}},
      {ATTNRT_BF16, true, true, 1, 2, {4000, 130, 9001, 2048}},
      {ATTNRT_BF16, true, true, 1, 1, {65536}},
      {ATTNRT_F16, false, true, 0, 1, {20000, 7777, 1, 33000}},
  };
  int it = 0;
  for (const DecodeCase& c : cases) {
    SCOPED_TRACE(it);
    check_decode_case(c, 1300 + it, 131 + it, "solo case " + std::to_string(it));
    expect_index_matches(decode_batch(c.dtype, c.kv, 1400 + it), m3_params(c.init, c.local),
                         141 + it, true, "sm90 indexer solo", it);
    // Two launches of each op (run_twice): sparse_decode runs every request solo, the indexer
    // those of more than 16 blocks.
    for (const int32_t kv : c.kv) expected += 2 + (kv > 16 * 128 ? 2 : 0);
    ++it;
  }
  EXPECT_EQ(solo_requests() - solo0, expected);
}

// Profiling builds of the plugin (-DATTNRT_PHASE_TRACE=ON) export their kernels' phase stamps
// (src/backends/cuda_common/phase_trace.cuh). read_phases() fetches and clears one table (false
// when the plugin has none); print_phases() prints, per phase, when the CTAs reached it, in us
// from the first indexer CTA's start: min / median / max over the CTAs and the CTA that was
// last, then every phase of the last CTA to attend.
using PhaseRead = int (*)(uint64_t*, int, const char**);
constexpr int kPhaseCtas = 1024, kPhaseSlots = 16;  // phase_trace.cuh's table: [CTA][slot]
struct PhaseTable {
  std::vector<uint64_t> t;  // [kPhaseCtas][kPhaseSlots]
  std::vector<std::string> names;
};
bool read_phases(const char* symbol, PhaseTable* out) {
  const auto read = reinterpret_cast<PhaseRead>(plugin_symbol(symbol));
  if (!read) return false;
  out->t.assign(static_cast<size_t>(kPhaseCtas) * kPhaseSlots, 0);
  const char* names = "";
  if (read(out->t.data(), kPhaseCtas, &names) <= 0) return false;
  out->names.clear();
  std::istringstream in(names);
  for (std::string name; std::getline(in, name, ',');) out->names.push_back(name);
  return true;
}
// Profiling builds: drops every table's stamps, so the next print_phases() sees only later
// launches.
void clear_phases() {
  PhaseTable stale;
  for (const char* t : {"attnrt_phase_sm90_index_decode", "attnrt_phase_sm90_attend_decode",
                        "attnrt_phase_sm90_sparse_decode"})
    read_phases(t, &stale);
}
// Two launches (indexer, attend) or, fused, the sparse_decode kernel alone.
void print_phases(const char* shape, bool fused) {
  PhaseTable ix, at;
  if (fused ? !read_phases("attnrt_phase_sm90_sparse_decode", &ix)
            : !read_phases("attnrt_phase_sm90_index_decode", &ix) ||
                  !read_phases("attnrt_phase_sm90_attend_decode", &at))
    return;
  uint64_t t0 = UINT64_MAX;
  for (size_t c = 0; c < ix.t.size(); c += kPhaseSlots)
    if (ix.t[c] != 0) t0 = std::min(t0, ix.t[c]);
  if (t0 == UINT64_MAX) return;
  const std::pair<const char*, PhaseTable*> tables[] = {{fused ? "fused" : "indexer", &ix},
                                                         {"attend", &at}};
  for (const auto& [tag, tab] : tables) {
    for (size_t slot = 0; slot < tab->names.size(); ++slot) {
      std::vector<double> us;
      size_t last_cta = 0;  // the CTA that reached this phase last: who holds up the tail
      uint64_t last = 0;
      for (size_t c = 0; c < kPhaseCtas; ++c) {
        const uint64_t v = tab->t[c * kPhaseSlots + slot];
        if (v >= t0 && v - t0 < 1'000'000'000) {
          us.push_back((v - t0) * 1e-3);
          if (v > last) last = v, last_cta = c;
        }
      }
      if (us.empty()) continue;
      std::sort(us.begin(), us.end());
      std::printf("PHASE %-16s %-7s %-15s ctas %4zu  min %8.2f  median %8.2f  max %8.2f us"
                  " (CTA %zu)\n",
                  shape, tag, tab->names[slot].c_str(), us.size(), us.front(), us[us.size() / 2],
                  us.back(), last_cta);
      // The last CTA to write its partial holds up the merge: its whole row says where it lost.
      if (tab->names[slot] != "attended") continue;
      std::printf("PHASE %-16s %-7s CTA %zu, the last to attend:", shape, tag, last_cta);
      for (size_t k = 0; k < tab->names.size(); ++k) {
        const uint64_t v = tab->t[last_cta * kPhaseSlots + k];
        if (v >= t0) std::printf("  %s %.2f", tab->names[k].c_str(), (v - t0) * 1e-3);
      }
      std::printf(" us\n");
    }
  }
}

// A decode step launched while another stream's kernel holds all but 4 multiprocessors: 12 of a
// 64k request's ~260 CTAs fit at a time, so they cannot all start together. The step must finish
// (solo mode) with the reference's answer, sparse_decode and the indexer alone; waiting for peers
// that cannot start would instead hang until the watchdog failed the launch after 10 s.
TEST(CudaSm90, DecodeFinishesBesideAKernelHoldingMostSms) {
  REQUIRE_HOPPER();
  const Batch B = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, {1}, {65536}, 1500, true, true);
  SparseParams S = m3_params(1, 2);
  S.sink = true;
  const Paging P = make_paging(B, 128, 151);
  DeviceBatch D(B, P, S, ATTNRT_OP_SPARSE_DECODE);
  for (const int op : {ATTNRT_OP_SPARSE_DECODE, ATTNRT_OP_SPARSE_INDEX_DECODE}) {
    SCOPED_TRACE(op);
    attnrt_problem p = problem_of(op, B, S, 128);
    attnrt_layout L = layout_of(B, P);
    attnrt_plan plan = nullptr;
    ASSERT_EQ(g_plugin->plan(&p, &L, &plan), ATTNRT_OK) << g_plugin->last_error();
    const attnrt_tensors ts = D.tensors(op);
    D.poison();
    cudaStream_t st;
    ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    // Before the occupier starts: reading the phase tables synchronizes the device.
    const uint64_t solo0 = solo_requests();
    clear_phases();
    const BesideHeldSms bs =
        run_beside_held_sms(st, 30000, [&] { return g_plugin->run(plan, &ts, st); });
    ASSERT_EQ(bs.status, ATTNRT_OK) << g_plugin->last_error();
    ASSERT_EQ(bs.stream, cudaSuccess) << "the step did not finish beside the occupier ("
                                      << cudaGetErrorString(bs.stream) << "); "
                                      << plugin_error_after_failure(g_plugin);
    EXPECT_EQ(bs.still_held, bs.held) << "the multiprocessors were not held for the whole step";
    EXPECT_EQ(solo_requests() - solo0, 1u) << "the request did not run solo";
    std::printf("sm90 op %d beside %d held multiprocessors: %.2f ms\n", op, bs.held, bs.ms);
    auto check = [&](const char* what) {
      SparseDecodeOut got;
      got.topk = D.topk_host();
      if (op == ATTNRT_OP_SPARSE_DECODE) {
        got.att = D.att_host();
        check_sparse_decode_out(B, S, got, what);
      } else {
        int ties = 0;
        check_topk(B, S, got.topk, ref_scores(B, S), &ties);
      }
    };
    check("beside an occupier");
    // Profiling builds: where the solo step's time goes.
    print_phases("beside occupier", op == ATTNRT_OP_SPARSE_DECODE);
    // The same plan on the freed GPU: shared again, its counters still in step.
    D.poison();
    const uint64_t solo1 = solo_requests();
    ASSERT_EQ(g_plugin->run(plan, &ts, st), ATTNRT_OK) << g_plugin->last_error();
    const cudaError_t e = cudaStreamSynchronize(st);
    ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e) << "; "
                              << plugin_error_after_failure(g_plugin);
    EXPECT_EQ(solo_requests(), solo1) << "a launch on the free GPU ran solo";
    check("then on the free GPU");
    cudaStreamDestroy(st);
    g_plugin->destroy_plan(plan);
  }
}

// Winners that cluster: a CTA ranks several of the 16 (it keeps its best, or every one goes to
// the CTA of its rank), or a CTA's rank is kept by its ranker. Requests cycle through three
// patterns: a run of 16 blocks, the first 16 blocks, every other block of a range. 3 requests
// give each of them 132 CTAs with 132 multiprocessors (the ranker keeps its best), 9 fewer.
TEST(CudaSm90, SparseDecodeClusteredWinners) {
  REQUIRE_HOPPER();
  for (const int n : {3, 9}) {
    const std::vector<int32_t> lens = {65536, 65236, 20000};
    std::vector<int32_t> ql(n, 1), kl(n);
    for (int b = 0; b < n; ++b) kl[b] = lens[b % 3];
    Batch B = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, ql, kl, 91 + n, true, true);
    for (int b = 0; b < n; ++b)
      for (int i = 0; i < 16; ++i) {
        if (b % 3 == 0) scale_block_keys(B, b, 100 + i, 2.f + 0.25f * i);  // a run, best last
        if (b % 3 == 1) scale_block_keys(B, b, i, 6.f - 0.25f * i);  // the first, best first
        if (b % 3 == 2) scale_block_keys(B, b, 40 + 2 * i, 2.f + 0.25f * ((5 * i) % 16));
      }
    check_sparse_decode(B, m3_params(), make_paging(B, 128, 92),
                        "clustered winners, " + std::to_string(n) + " requests");
  }
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

// The indexer and sparse attend of a decode step (two calls, or one sparse_decode) captured once
// in a CUDA graph, replayed after update_plan with new lengths (new blocks appear) and twice per
// step over poisoned outputs: every replay selects and attends afresh.
// fused: the step as one sparse_decode call.
void check_graph_replays(bool fused) {
  const SparseParams S = m3_params(1, 1);
  const std::vector<int32_t> longest = {9000, 30000, 2100};
  const Batch Bmax = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, {1, 1, 1}, longest, 31);
  const Paging Pmax = make_paging(Bmax, 128, 5);
  const std::vector<std::vector<int32_t>> steps = {
      {8000, 29000, 1900}, {8001, 29001, 1901}, {8300, 29500, 2048}, {9000, 30000, 2100}};
  Batch B;
  Paging P;
  shorter_step(Bmax, Pmax, steps[0], &B, &P);
  attnrt_layout L = layout_of(B, P);
  const attnrt_problem pi = problem_of(ATTNRT_OP_SPARSE_INDEX_DECODE, B, S, 128);
  SparseParams Sa = S;
  Sa.sink = true;
  const attnrt_problem pa = problem_of(ATTNRT_OP_SPARSE_ATTEND_DECODE, B, Sa, 128);
  const attnrt_problem pf = problem_of(ATTNRT_OP_SPARSE_DECODE, B, Sa, 128);
  attnrt_plan plan = nullptr, plan_a = nullptr;  // fused: plan alone
  ASSERT_EQ(g_plugin->plan(fused ? &pf : &pi, &L, &plan), ATTNRT_OK) << g_plugin->last_error();
  if (!fused) {
    ASSERT_EQ(g_plugin->plan(&pa, &L, &plan_a), ATTNRT_OK) << g_plugin->last_error();
  }
  // Every step's rows and pages are in the longest one's.
  DeviceBatch D(Bmax, Pmax, Sa, ATTNRT_OP_SPARSE_DECODE);
  const attnrt_tensors ti = D.tensors(ATTNRT_OP_SPARSE_INDEX_DECODE),
                       ta = D.tensors(fused ? ATTNRT_OP_SPARSE_DECODE
                                            : ATTNRT_OP_SPARSE_ATTEND_DECODE);
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const int32_t r = g_plugin->run(plan, fused ? &ta : &ti, st);
  const int32_t ra = fused ? ATTNRT_OK : g_plugin->run(plan_a, &ta, st);
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  ASSERT_EQ(r, ATTNRT_OK) << g_plugin->last_error();
  ASSERT_EQ(ra, ATTNRT_OK) << g_plugin->last_error();
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE(i);
    shorter_step(Bmax, Pmax, steps[i], &B, &P);
    L = layout_of(B, P);
    if (i > 0) {
      ASSERT_EQ(g_plugin->update_plan(plan, &L), ATTNRT_OK) << g_plugin->last_error();
      if (!fused) {
        ASSERT_EQ(g_plugin->update_plan(plan_a, &L), ATTNRT_OK) << g_plugin->last_error();
      }
    }
    for (int rep = 0; rep < 2; ++rep) {  // a second replay of the same step
      D.poison();
      ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
      const std::vector<int32_t> topk = D.topk_host();
      int ties = 0;
      check_topk(B, S, topk, ref_scores(B, S), &ties);
      const AttendOut got = D.att_host();
      std::vector<double> ro, rl;
      ref_attend(B, Sa, &topk, true, ro, rl);
      double worst = 0;
      expect_close(B, Sa, got, ro, rl, &worst);
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
  g_plugin->destroy_plan(plan_a);
}

TEST(CudaSm90, GraphReplaysWithNewLengths) {
  REQUIRE_HOPPER();
  check_graph_replays(false);
}

TEST(CudaSm90, SparseDecodeGraphReplaysWithNewLengths) {
  REQUIRE_HOPPER();
  check_graph_replays(true);
}

// What graph_step_ms captures: the indexer, the sparse attend (on the indexer's selections, made
// before the capture), or both, as one decode step of a sparse layer runs them; or a 4-byte
// memset, the floor that launching any one-node graph costs in this measurement.
// kGraphFused: the step as the one sparse_decode call.
enum GraphOps { kGraphIndex = 1, kGraphAttend = 2, kGraphStep = 3, kGraphFloor = 4, kGraphFused = 8 };

// How graph_step_ms evicts L2 before each replay. ATTNRT_GPU_BENCH_FLUSH=write (the default): a
// 256 MB memset, as the peer numbers of issue 6 were measured; it leaves L2 full of dirty lines,
// whose write-back the timed step pays as it evicts them. =read: a kernel reads 256 MB instead,
// so the step finds clean lines (closer to a model's step, whose previous kernels write little).
bool read_flush() {
  static const bool read = [] {
    const char* e = std::getenv("ATTNRT_GPU_BENCH_FLUSH");
    const std::string v = e ? e : "write";
    if (v != "read" && v != "write")
      ADD_FAILURE() << "ATTNRT_GPU_BENCH_FLUSH=" << v << " (expected read or write)";
    return v == "read";
  }();
  return read;
}

// `ops` of one decode step through `plug`, captured in a CUDA graph and replayed `reps` times,
// each after a 256 MB flush of L2 (cold cache; read_flush() says how); returns the median of the
// CUDA-event times in ms. With `warm_code` (kGraphFused only), after each flush and before the
// timed replay, sparse_decode runs untimed on that other batch (its own plan and memory): the
// kernel's instructions are then cached (L2 and the SMs' instruction caches) while the step's
// data, plan scratch and parameters stay cold, so the difference from kGraphFused alone is
// mostly what fetching the code costs the step.
double graph_step_ms(const attnrt_plugin_v1* plug, DeviceBatch& D, int reps,
                     int ops = kGraphStep, DeviceBatch* warm_code = nullptr) {
  const Batch& B = D.B;
  const SparseParams& S = D.S;
  const attnrt_problem pi = problem_of(ATTNRT_OP_SPARSE_INDEX_DECODE, B, S, 128);
  const attnrt_problem pa = problem_of(ATTNRT_OP_SPARSE_ATTEND_DECODE, B, S, 128);
  const attnrt_problem pf = problem_of(ATTNRT_OP_SPARSE_DECODE, B, S, 128);
  attnrt_layout L = layout_of(B, D.P);
  attnrt_plan plan_i = nullptr, plan_a = nullptr;
  if (ops == kGraphFused) {  // plan_i runs the whole step
    EXPECT_EQ(plug->plan(&pf, &L, &plan_i), ATTNRT_OK) << plug->last_error();
    if (!plan_i) return NAN;
  } else {
    EXPECT_EQ(plug->plan(&pi, &L, &plan_i), ATTNRT_OK) << plug->last_error();
    EXPECT_EQ(plug->plan(&pa, &L, &plan_a), ATTNRT_OK) << plug->last_error();
    if (!plan_i || !plan_a) return NAN;
  }
  attnrt_plan plan_w = nullptr;
  attnrt_tensors tw{};
  if (warm_code != nullptr) {
    const attnrt_problem pw = problem_of(ATTNRT_OP_SPARSE_DECODE, warm_code->B, warm_code->S, 128);
    attnrt_layout Lw = layout_of(warm_code->B, warm_code->P);
    EXPECT_EQ(ops, kGraphFused);
    EXPECT_EQ(plug->plan(&pw, &Lw, &plan_w), ATTNRT_OK) << plug->last_error();
    if (!plan_w) return NAN;
    tw = warm_code->tensors(ATTNRT_OP_SPARSE_DECODE);
  }
  Dev flush(256u << 20), sink(sizeof(unsigned));
  // kGraphFused: plan_i runs the one call that reads and writes both sets.
  const attnrt_tensors ti = D.tensors(ops == kGraphFused ? ATTNRT_OP_SPARSE_DECODE
                                                         : ATTNRT_OP_SPARSE_INDEX_DECODE),
                       ta = D.tensors(ATTNRT_OP_SPARSE_ATTEND_DECODE);
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  if (ops == kGraphAttend) {
    EXPECT_EQ(plug->run(plan_i, &ti, st), ATTNRT_OK) << plug->last_error();
  }
  cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
  if (ops == kGraphFloor) cudaMemsetAsync(D.topk.p, 0, 4, st);
  const int32_t r1 = ops & (kGraphIndex | kGraphFused) ? plug->run(plan_i, &ti, st) : ATTNRT_OK;
  const int32_t r2 = ops & kGraphAttend ? plug->run(plan_a, &ta, st) : ATTNRT_OK;
  EXPECT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  EXPECT_EQ(r1, ATTNRT_OK) << plug->last_error();
  EXPECT_EQ(r2, ATTNRT_OK) << plug->last_error();
  if (r1 != ATTNRT_OK || r2 != ATTNRT_OK) return NAN;  // a partial step would time too little
  EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ms;
  for (int i = 0; i < reps + 2; ++i) {
    if (read_flush())
      EXPECT_EQ(l2_read_flush(flush.p, flush.bytes, static_cast<unsigned*>(sink.p), st), cudaSuccess);
    else
      cudaMemsetAsync(flush.p, i & 0xff, flush.bytes, st);
    if (plan_w) {
      EXPECT_EQ(plug->run(plan_w, &tw, st), ATTNRT_OK) << plug->last_error();
    }
    cudaEventRecord(e0, st);
    cudaGraphLaunch(exec, st);
    cudaEventRecord(e1, st);
    if (const cudaError_t e = cudaEventSynchronize(e1); e != cudaSuccess) {
      // A failed launch (the decode watchdog's trap, say): the plugin's error says where.
      ADD_FAILURE() << "graph replay " << i << ": " << cudaGetErrorString(e) << "; "
                    << plugin_error_after_failure(plug);
      break;
    }
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    if (i >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  plug->destroy_plan(plan_i);
  plug->destroy_plan(plan_a);
  plug->destroy_plan(plan_w);
  return ms.empty() ? NAN : ms[ms.size() / 2];
}

// M3 per-rank decode (indexer, attend, sum): cuda_sm90 beside the generic cuda plugin, same data,
// same call. Profiling builds also print the phases of the step's last replay.
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
                          {"decode 4x64k", 4, 65536},   {"decode 8x64k", 8, 65536},
                          {"decode 16x64k", 16, 65536}, {"decode 64x64k", 64, 65536},
                          {"decode 64x128k", 64, 131072}};
  // ATTNRT_GPU_BENCH_SHAPES: time only the shapes whose name contains one of its comma-separated
  // parts (e.g. "1x64k,1x128k"; "decode 4x64k" for that one without 64x64k).
  // ATTNRT_GPU_BENCH_GRAPHS: time only the named graphs (comma-separated, of step, fused,
  // generic, index, attend, floor, fused_warm_code); the others print nan. Unset: every shape,
  // every graph.
  auto listed = [](const char* var, const std::string& name, bool whole) {
    const char* list = std::getenv(var);
    if (!list) return true;
    std::istringstream parts(list);
    for (std::string part; std::getline(parts, part, ',');)
      if (!part.empty() && (whole ? part == name : name.find(part) != std::string::npos))
        return true;
    return false;
  };
  auto selected = [&](const char* name) { return listed("ATTNRT_GPU_BENCH_SHAPES", name, false); };
  auto graphs_selected = [&](const char* name) {
    return listed("ATTNRT_GPU_BENCH_GRAPHS", name, true);
  };
  // fused_warm_code's other batch: one 32k request, so that its plan splits it over >= 128
  // CTAs and the kernel takes the same paths as at batch 1 x 64k.
  struct WarmBatch {
    Batch B = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, {1}, {32768}, 77, true, true);
    Paging P = make_paging(B, 128, 78);
    DeviceBatch D{B, P, m3_params(), ATTNRT_OP_SPARSE_DECODE};
  };
  std::optional<WarmBatch> warm_batch;
  if (graphs_selected("fused_warm_code")) warm_batch.emplace();
  DeviceBatch* const warm = warm_batch ? &warm_batch->D : nullptr;
  const bool recent = std::getenv("ATTNRT_GPU_BENCH_RECENT") != nullptr;
  const bool windows = std::getenv("ATTNRT_GPU_BENCH_WINDOWS") != nullptr;
  if (recent) std::printf("BENCH sm90 selections: the 16 most recent blocks of every request\n");
  if (windows) std::printf("BENCH sm90 index keys: a random window of the pattern per block\n");
  // Progress on stderr (unbuffered), seconds since the test began: the large shapes take a
  // while on the host and through the generic plugin.
  const auto t0 = std::chrono::steady_clock::now();
  auto progress = [&](const char* shape, const char* what) {
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    std::fprintf(stderr, "[BenchM3 %7.1f s] %s: %s\n", dt.count(), shape, what);
  };
  for (const Shape& s : shapes) {
    if (!selected(s.name)) continue;
    progress(s.name, "building the batch on the host");
    // Tile a random 1024-token pattern over the context (host generation would take minutes).
    Batch B = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, std::vector<int32_t>(s.n, 1),
                         std::vector<int32_t>(s.n, 1024), 1);
    B.kv_len.assign(s.n, s.kl);
    B.tok_off.assign(s.n + 1, 0);
    for (int b = 0; b < s.n; ++b) B.tok_off[b + 1] = B.tok_off[b] + s.kl;
    const size_t toks = static_cast<size_t>(B.tok_off[s.n]), row = 128;
    for (std::vector<uint16_t>* x : {&B.ik, &B.k, &B.v}) {
      std::vector<uint16_t> pat(x->begin(), x->begin() + 1024 * row);
      x->resize(toks * row);
      for (size_t i = pat.size(); i < x->size(); i += pat.size())
        std::copy(pat.begin(), pat.begin() + std::min(pat.size(), x->size() - i), x->begin() + i);
    }
    // ATTNRT_GPU_BENCH_WINDOWS=1: each block's index keys are a random 128-token window of the
    // pattern, so the blocks' scores have no period (with the plain tile, blocks alike mod 8 win
    // together, which favours some splits of the blocks over CTAs).
    if (windows) {
      std::mt19937 wrng(7);
      std::uniform_int_distribution<int> start(0, 1024 - 128);
      const std::vector<uint16_t> pat(B.ik.begin(), B.ik.begin() + 1024 * row);
      for (int b = 0; b < s.n; ++b)
        for (int t0 = 0; t0 < s.kl; t0 += 128) {
          const size_t len = static_cast<size_t>(std::min(128, s.kl - t0)) * row;
          const auto from = pat.begin() + static_cast<size_t>(start(wrng)) * row;
          const size_t at = (static_cast<size_t>(B.tok_off[b]) + t0) * row;
          std::copy(from, from + len, B.ik.begin() + at);
        }
    }
    // One index-key dim random per token, so block scores do not repeat with the tile: the
    // top-k then selects among distinct scores, as with real keys, not among 8 tied values.
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> unif(-1.f, 1.f);
    for (size_t t = 0; t < toks; ++t) B.ik[t * row] = B.enc(unif(rng));
    // ATTNRT_GPU_BENCH_RECENT=1: the 16 most recent blocks of every request outscore the rest
    // (their keys large in the request's largest index-query dim, with its sign), as when
    // attention stays local: the selected blocks then sit in one or two CTAs' ranges.
    if (recent)
      for (int b = 0; b < s.n; ++b) {
        size_t dim = 0;
        for (size_t x = 1; x < row; ++x)
          if (std::fabs(B.dec(B.iq[b * row + x])) > std::fabs(B.dec(B.iq[b * row + dim]))) dim = x;
        const float big = B.dec(B.iq[b * row + dim]) < 0 ? -8.f : 8.f;
        for (int t = std::max(0, s.kl - 16 * 128); t < s.kl; ++t)
          B.ik[(static_cast<size_t>(B.tok_off[b]) + t) * row + dim] = B.enc(big);
      }
    const SparseParams S = m3_params();
    const Paging P = make_paging(B, 128, 5);
    double t_fast = 0, t_gen = 0, a_fast = 0, a_gen = 0;
    // One device copy of the batch for every call below (at 64 x 128k the caches are 6.4 GB:
    // a copy per call took minutes).
    progress(s.name, "uploading");
    DeviceBatch D(B, P, S, ATTNRT_OP_SPARSE_DECODE);
    progress(s.name, "timing the indexers");
    const std::vector<int32_t> a = run_index(D, true, &t_fast, 50);
    const std::vector<int32_t> g = run_index(D, true, &t_gen, 50, generic);
    progress(s.name, "timing the attends");
    run_attend(ATTNRT_OP_SPARSE_ATTEND_DECODE, D, &a, &a_fast, 50);
    run_attend(ATTNRT_OP_SPARSE_ATTEND_DECODE, D, &a, &a_gen, 50, generic);
    const double bytes = static_cast<double>(toks) * row * 2;
    std::printf("BENCH sm90 %-16s indexer fast %8.4f ms (%5.2f TB/s) generic %8.4f (%.2fx)  "
                "attend fast %8.4f generic %8.4f (%.2fx)  sum fast %8.4f generic %8.4f (%.2fx)  "
                "same selections: %s\n",
                s.name, t_fast, bytes / t_fast / 1e9, t_gen, t_gen / t_fast, a_fast, a_gen,
                a_gen / a_fast, t_fast + a_fast, t_gen + a_gen, (t_gen + a_gen) / (t_fast + a_fast),
                a == g ? "yes" : "no (near-ties)");
    std::fflush(stdout);
    progress(s.name, "sparse_decode once");
    const SparseDecodeOut fo = run_sparse_decode(D);
    EXPECT_EQ(fo.topk, a) << "sparse_decode selected other blocks than the indexer";
    clear_phases();
    auto graph = [&](const char* name, const attnrt_plugin_v1* plug, int ops,
                     DeviceBatch* warm_code = nullptr) {
      if (!graphs_selected(name)) return static_cast<double>(NAN);
      progress(s.name, (std::string("graph ") + name).c_str());
      return graph_step_ms(plug, D, 20, ops, warm_code);
    };
    const double gf = graph("step", g_plugin, kGraphStep);
    print_phases(s.name, false);
    const double gx = graph("fused", g_plugin, kGraphFused);
    print_phases(s.name, true);
    const double gw = graph("fused_warm_code", g_plugin, kGraphFused, warm);
    print_phases((std::string(s.name) + " warm").c_str(), true);  // stamps older than t0 drop
    const double gg = graph("generic", generic, kGraphStep);
    const double gi = graph("index", g_plugin, kGraphIndex),
                 ga = graph("attend", g_plugin, kGraphAttend),
                 g0 = graph("floor", g_plugin, kGraphFloor);
    std::printf("BENCH sm90 %-16s one step in a CUDA graph, cold L2 by a %s (median of 20): sparse_decode "
                "%8.4f ms  two launches %8.4f ms  generic %8.4f ms (%.2fx of sparse_decode); "
                "fast indexer alone %8.4f, attend alone %8.4f; one-memset graph %8.4f; "
                "sparse_decode with its code warm in L2 %8.4f\n",
                s.name, read_flush() ? "read" : "memset", gx, gf, gg, gg / gx, gi, ga, g0, gw);
    std::fflush(stdout);
  }
}

// M3 per-rank extend (8192 new tokens at 64k context): indexer and attend of cuda_sm90 beside
// the generic cuda plugin, same data, mean of 20 queued runs (warm L2, as the generic
// plugin's BenchM3 times extend).
TEST(CudaSm90, BenchExtendM3) {
  REQUIRE_HOPPER();
  if (!std::getenv("ATTNRT_GPU_BENCH")) GTEST_SKIP() << "set ATTNRT_GPU_BENCH=1 to time";
  std::string why;
  const attnrt_plugin_v1* generic = open_plugin(plugin_file_path(ATTNRT_CUDA_GENERIC_FILE), &why);
  ASSERT_NE(generic, nullptr) << why;
  const int ql = 8192, kl = 65536;
  // Random queries; keys tile a random 1024-token pattern (host generation of 64k rows is slow).
  Batch B = make_batch(ATTNRT_BF16, 16, 1, 1, 128, 128, {ql}, {1024}, 2);
  B.kv_len = {kl};
  B.tok_off = {0, kl};
  for (std::vector<uint16_t>* x : {&B.ik, &B.k, &B.v}) {
    std::vector<uint16_t> pat(x->begin(), x->begin() + 1024 * 128);
    x->resize(static_cast<size_t>(kl) * 128);
    for (size_t i = pat.size(); i < x->size(); i += pat.size())
      std::copy(pat.begin(), pat.end(), x->begin() + i);
  }
  SparseParams S = m3_params();
  S.lse = false;
  const Paging P = make_paging(B, 128, 5);
  double i_fast = 0, i_gen = 0, a_fast = 0, a_gen = 0, a_rand = 0;
  const std::vector<int32_t> sel = run_index(B, S, P, false, &i_fast, 20);
  const std::vector<int32_t> sel_gen = run_index(B, S, P, false, &i_gen, 20, generic);
  const AttendOut of = run_attend(ATTNRT_OP_SPARSE_ATTEND_EXTEND, B, S, P, &sel, &a_fast, 20);
  const AttendOut og = run_attend(ATTNRT_OP_SPARSE_ATTEND_EXTEND, B, S, P, &sel, &a_gen, 20, generic);
  // Cross-check at full size (several row chunks): the generic kernel is checked against the
  // reference by its own tests.
  double diff = 0;
  int off = 0;
  for (size_t i = 0; i < of.o.size(); ++i) {
    const double x = B.dec(of.o[i]), y = B.dec(og.o[i]), d = std::fabs(x - y);
    diff = std::max(diff, d);
    off += !(d <= 1e-2 + 1e-2 * std::fabs(y));  // a bf16 ulp or two either side
  }
  EXPECT_EQ(off, 0) << "fast and generic extend attend disagree (max diff " << diff << ")";
  // The tiled keys make many blocks tie; random selections spread the reads over the context.
  const std::vector<int32_t> rnd = random_topk(B, S, 9);
  run_attend(ATTNRT_OP_SPARSE_ATTEND_EXTEND, B, S, P, &rnd, &a_rand, 20);
  std::printf("BENCH sm90 extend 8192 at 64k  indexer fast %8.4f ms generic %8.4f (%.2fx)  "
              "attend fast %8.4f generic %8.4f (%.2fx)  sum fast %8.4f generic %8.4f (%.2fx)  "
              "attend fast, random selections %8.4f  same selections: %s  max |fast - generic| %.1e\n",
              i_fast, i_gen, i_gen / i_fast, a_fast, a_gen, a_gen / a_fast, i_fast + a_fast,
              i_gen + a_gen, (i_gen + a_gen) / (i_fast + a_fast), a_rand,
              sel == sel_gen ? "yes" : "no (near-ties)", diff);
  std::fflush(stdout);
}

}  // namespace
