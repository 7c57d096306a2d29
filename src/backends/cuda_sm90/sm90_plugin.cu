// attnrt Hopper fast-path plugin (libattnrt_cuda_sm90.so, backend "cuda_sm90"). Includes only
// the plugin C ABI.
//
// It serves the sparse ops of MiniMax-M3's sparse layers at the production shape (block =
// page = 128, top-16 of one index head, index_dim 128 with score max; 16 query heads on one KV
// head, head_dim 128; bf16/f16) on compute capability 9.x. Decode, one fused launch each:
// sparse_index_decode (index_decode.cu: bulk-copy page loads, block scores and the top-k in one
// kernel), sparse_attend_decode (attend_decode.cu: a cluster of CTAs per request on tensor
// cores, merging its partials in distributed shared memory) and sparse_decode, both in one
// launch (index_decode.cu: a selected block is attended by the CTA that ranked it or by the
// CTA of its rank).
// Extend: sparse_index_extend (index_extend.cu: 128-token tiles scored on tensor cores, then a
// top-k kernel) and sparse_attend_extend (attend_extend.cu: block-major, each selected block
// read once per 32 tokens). Anything else its probe refuses by name, and the generic "cuda"
// plugin (priority 200) serves it.
// Priority 300: tried before the generic plugin.
//
// Contract notes: cudart is linked statically (loads without a driver; init() then reports why);
// device properties are read once in init(); plan() allocates every device buffer the op needs
// (metadata, scores, counters) with room for decode growth, and loads every kernel of the plugin
// on its device; run() only launches; update_plan refreshes lengths and page ids in place for
// CUDA-graph replay.
#include <attnrt/plugin.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "attend_decode.h"
#include "attend_extend.h"
#include "cuda_common/device_runtime.h"
#include "cuda_common/sparse_ops.h"
#include "cuda_common/spin_wait.cuh"
#include "index_decode.h"
#include "index_extend.h"

namespace {

using attnrt_cuda_common::is_decode_op;
using attnrt_cuda_common::is_index_op;
using attnrt_cuda_common::reads_attention_inputs;
using attnrt_cuda_common::reads_index_inputs;
using attnrt_cuda_common::upload;
using attnrt_cuda_sm90::kBlock;
using attnrt_cuda_sm90::kDim;
using attnrt_cuda_sm90::kHeadDim;
using attnrt_cuda_sm90::kHeads;
using attnrt_cuda_sm90::kMaxBlocks;
using attnrt_cuda_sm90::kTopK;

thread_local char g_error[1024] = "";

int32_t fail(int32_t status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
int32_t fail(int32_t status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(g_error, sizeof g_error, fmt, ap);
  va_end(ap);
  return status;
}

// The decode indexer's wait record (index_decode.h), in mapped host memory shared by every plan
// of the process: it stays readable after a trap has ended the CUDA context.
attnrt_cuda_sm90::WaitRecord* g_wait_record = nullptr;  // host address; null: none
attnrt_cuda_sm90::WaitRecord* g_wait_record_dev = nullptr;

// Allocates the wait record once per process (left null if that fails: the watchdog then traps
// without a record).
void allocate_wait_record() {
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = nullptr;
    void* d = nullptr;
    if (cudaHostAlloc(&h, sizeof(attnrt_cuda_sm90::WaitRecord),
                      cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it
      return;
    }
    std::memset(h, 0, sizeof(attnrt_cuda_sm90::WaitRecord));
    if (cudaHostGetDevicePointer(&d, h, 0) != cudaSuccess) {
      cudaGetLastError();
      cudaFreeHost(h);
      return;
    }
    g_wait_record = static_cast<attnrt_cuda_sm90::WaitRecord*>(h);
    g_wait_record_dev = static_cast<attnrt_cuda_sm90::WaitRecord*>(d);
  });
}

// A failing status gets the watchdog's finding appended to the message once a decode indexer
// gave up a wait (the launch then trapped, and every later CUDA call fails).
int32_t with_wait_note(int32_t status) {
  const volatile attnrt_cuda_sm90::WaitRecord* r = g_wait_record;
  if (status == ATTNRT_OK || r == nullptr || r->ready != 1u) return status;
  static const char* const kWhat[] = {"its peers at the top-16 barrier",
                                      "the published block of a rank",
                                      "its peers' partials"};
  const std::string msg = g_error;
  const int rank = r->rank;
  const uint64_t word =
      rank >= 0 && rank < kTopK ? r->sync[attnrt_cuda_sm90::kRankWords + rank] : 0;
  std::snprintf(g_error, sizeof g_error,
                "%s; cuda_sm90 watchdog: request %d CTA %d waited over %llu s for %s (target "
                "%llu; arrivals %llu, done %llu, launches %llu, mode word %llu; rank %d, its "
                "word: tag %llu, block %d): a bug in the decode indexer's barrier, please report "
                "this line",
                msg.c_str(), r->request, r->cta,
                static_cast<unsigned long long>(attnrt_cuda_common::kSpinWatchdogNs / 1000000000),
                kWhat[r->wait < 0 || r->wait > 2 ? 0 : r->wait],
                static_cast<unsigned long long>(r->target),
                static_cast<unsigned long long>(r->sync[0]),
                static_cast<unsigned long long>(r->sync[1]),
                static_cast<unsigned long long>(r->sync[2]),
                static_cast<unsigned long long>(r->sync[attnrt_cuda_sm90::kModeWord]), rank,
                static_cast<unsigned long long>(word >> 32), static_cast<int>(word & 0xffffffffu));
  return status;
}

#define CK(call)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess)                                                                \
      return with_wait_note(fail(ATTNRT_INTERNAL, "%s: %s (%s)", #call,                   \
                                 cudaGetErrorName(e_), cudaGetErrorString(e_)));          \
  } while (0)

attnrt_cuda_common::DeviceRuntime g_rt("cuda_sm90");

int32_t check_device(attnrt_device d) { return g_rt.check(d, g_error, sizeof g_error); }

// A plan: device copies of the layout (decode: with room to grow), the decode indexer's
// per-request barrier counters and score matrix or the decode attend's CTAs per request, and
// for extend the per-token request/position tables, work items and split partials.
struct Sm90Plan {
  attnrt_problem problem{};
  int n = 0;
  int64_t tokens = 0;
  int page_capacity = 0, block_capacity = 0;
  int blocks_per_cta = 2, ctas_per_request = 1;  // decode indexer
  bool force_solo = false;  // decode indexer: fault injection (ATTNRT_SM90_FAULT=solo)
  int attend_parts = 16;                         // decode attend: CTAs per request
  int num_items = 0;                             // extend indexer
  int32_t *d_kv_len = nullptr, *d_page_indptr = nullptr, *d_page_ids = nullptr;
  int32_t* d_counters = nullptr;  // extend
  uint64_t* d_sync = nullptr;     // decode indexer: [n][kSyncWords]
  float* d_part_o32 = nullptr;    // sparse_decode: [n][16 slots][16 heads][128], lse in d_part_lse
  float* d_scores = nullptr;                              // indexer
  float* d_part_lse = nullptr;                            // extend attend
  int32_t *d_q_len = nullptr, *d_row_req = nullptr, *d_row_pos = nullptr;  // extend
  int64_t *d_q_indptr = nullptr, *d_score_base = nullptr;
  attnrt_cuda_sm90::IndexExtendItem* d_items = nullptr;
  int total_blocks = 0;  // extend attend: block lists, work items, per-slot partials
  int32_t *d_blk_base = nullptr, *d_blk_req = nullptr, *d_entry_cap = nullptr;
  int64_t* d_entry_base = nullptr;
  int32_t* d_entries = nullptr;
  attnrt_cuda_sm90::AttendExtendItem* d_attend_items = nullptr;
  void* d_part_o16 = nullptr;
};

void free_plan(Sm90Plan* p) {
  if (!p) return;
  void* bufs[] = {p->d_kv_len,     p->d_page_indptr, p->d_page_ids,      p->d_counters,
                  p->d_scores,     p->d_part_lse,    p->d_q_len,         p->d_row_req,
                  p->d_row_pos,    p->d_q_indptr,    p->d_score_base,    p->d_items,
                  p->d_blk_base,   p->d_blk_req,     p->d_entry_cap,     p->d_entry_base,
                  p->d_entries,    p->d_attend_items, p->d_part_o16,    p->d_sync,
                  p->d_part_o32};
  for (void* b : bufs) cudaFree(b);
  delete p;
}

// ---------------------------------------------------------------------------------------------

int32_t p_init() { return g_rt.init(g_error, sizeof g_error); }

int32_t p_device_count(int32_t kind, int32_t* count) { return g_rt.device_count(kind, count); }

// Every unmet requirement of the fast path, by name, separated by "; ".
int32_t p_probe(const attnrt_problem* p) {
  if (int32_t s = check_device(p->device); s != ATTNRT_OK) return s;
  const attnrt_cuda_common::DeviceInfo& dev = g_rt.info(p->device.index);
  std::string why;
  char buf[160];
  auto need = [&](bool ok, const char* fmt, auto... args) {
    if (ok) return;
    std::snprintf(buf, sizeof buf, fmt, args...);
    if (!why.empty()) why += "; ";
    why += buf;
  };
  if (!attnrt_cuda_common::is_sparse_op(p->op))  // plugin.h's wording for such ops
    return fail(ATTNRT_UNAVAILABLE,
                "op not served: cuda_sm90 serves the sparse ops (index, attend and sparse_decode), "
                "not op %d",
                p->op);
  need(dev.major == 9, "compute capability %d.%d (needs 9.x: Hopper bulk copies)", dev.major,
       dev.minor);
  need(p->q_dtype == ATTNRT_BF16 || p->q_dtype == ATTNRT_F16, "q dtype %d (needs bf16 or f16)",
       p->q_dtype);
  need(p->kv_dtype == p->q_dtype, "kv dtype %d (needs the q dtype %d)", p->kv_dtype, p->q_dtype);
  need(p->page_size == kBlock, "page_size %d (needs %d)", p->page_size, kBlock);
  need(p->block_size == kBlock, "block_size %d (needs %d)", p->block_size, kBlock);
  need(p->num_index_heads == 1, "num_index_heads %d (needs 1)", p->num_index_heads);
  need(p->topk == kTopK, "topk %d (needs %d)", p->topk, kTopK);
  if (reads_index_inputs(p->op)) {
    need(p->index_dim == kDim, "index_dim %d (needs %d)", p->index_dim, kDim);
    need(p->score_type == 0, "score_type %d (needs 0, max)", p->score_type);
  }
  if (reads_attention_inputs(p->op)) {
    need(p->num_kv_heads == 1, "num_kv_heads %d (needs 1)", p->num_kv_heads);
    need(p->num_q_heads == kHeads, "num_q_heads %d (needs %d)", p->num_q_heads, kHeads);
    need(p->head_dim == kHeadDim, "head_dim %d (needs %d)", p->head_dim, kHeadDim);
  }
  if (!why.empty()) return fail(ATTNRT_UNAVAILABLE, "%s", why.c_str());
  return ATTNRT_OK;
}

// Checks a layout against the plan's room; OK when it fits.
int32_t check_layout(const attnrt_layout* L, int block_capacity, int page_capacity) {
  const int n = L->num_requests;
  for (int b = 0; b < n; ++b) {
    if (L->q_len[b] != 1 || L->q_indptr[b] != b)
      return fail(ATTNRT_UNAVAILABLE, "request %d is not a decode row (q_len %d)", b, L->q_len[b]);
    const int blocks = (L->kv_len[b] + kBlock - 1) / kBlock;
    if (blocks > block_capacity)
      return fail(ATTNRT_UNAVAILABLE, "request %d has %d blocks, room for %d", b, blocks,
                  block_capacity);
  }
  if (L->page_indptr[n] > page_capacity)
    return fail(ATTNRT_UNAVAILABLE, "%d pages exceed the plan's capacity %d", L->page_indptr[n],
                page_capacity);
  return ATTNRT_OK;
}

// Extend: per-token tables; the indexer's score matrices and work items (128-token tiles x
// ranges of 16 blocks, only blocks some token of the tile can see).
int32_t plan_extend(const attnrt_problem* p, const attnrt_layout* L, Sm90Plan* pl) {
  using attnrt_cuda_sm90::IndexExtendItem;
  using attnrt_cuda_sm90::kIndexItemBlocks;
  using attnrt_cuda_sm90::kIndexTileRows;
  const int n = L->num_requests;
  const int64_t T = L->q_indptr[n];
  pl->tokens = T;
  std::vector<int32_t> row_req(T), row_pos(T);
  std::vector<int64_t> score_base(n, 0);
  std::vector<IndexExtendItem> items;
  int64_t scores = 0;
  // Attend: request b's blocks are global blocks blk_base[b] ..; each has a list of capacity
  // min(q_len, chunk) (a token selects a block at most once).
  std::vector<int32_t> blk_base(n), blk_req, entry_cap(n);
  std::vector<int64_t> entry_base(n);
  int64_t entries = 0;
  for (int b = 0; b < n; ++b) {
    const int ql = L->q_len[b], kv = L->kv_len[b];
    if (ql > kv)
      return fail(ATTNRT_INVALID, "request %d: q_len %d exceeds kv_len %d", b, ql, kv);
    const int nblk = (kv + kBlock - 1) / kBlock;
    for (int t = 0; t < ql; ++t) {
      row_req[L->q_indptr[b] + t] = b;
      row_pos[L->q_indptr[b] + t] = kv - ql + t;
    }
    score_base[b] = scores;
    scores += static_cast<int64_t>(ql) * nblk;
    blk_base[b] = static_cast<int32_t>(blk_req.size());
    blk_req.insert(blk_req.end(), nblk, b);
    entry_cap[b] = std::min(ql, attnrt_cuda_sm90::kExtendChunkRows);
    entry_base[b] = entries;
    entries += static_cast<int64_t>(nblk) * entry_cap[b];
    for (int t0 = 0; t0 < ql; t0 += kIndexTileRows) {
      const int last = kv - ql + std::min(t0 + kIndexTileRows, ql) - 1;
      const int vis = last / kBlock + 1;
      for (int c0 = 0; c0 < vis; c0 += kIndexItemBlocks)
        items.push_back({b, t0, c0, std::min(c0 + kIndexItemBlocks, vis)});
    }
  }
  pl->num_items = static_cast<int>(items.size());
  const int total_pages = L->page_indptr[n];
  CK(cudaSetDevice(p->device.index));
  char* e = g_error;
  const size_t ec = sizeof g_error;
  if (upload(&pl->d_page_indptr, L->page_indptr, n + 1, 0, e, ec) ||
      upload(&pl->d_page_ids, L->page_ids, total_pages, 0, e, ec) ||
      upload(&pl->d_row_req, row_req.data(), T, 0, e, ec))
    return ATTNRT_INTERNAL;
  if (is_index_op(p->op)) {
    std::vector<int64_t> q_indptr(L->q_indptr, L->q_indptr + n + 1);
    if (upload(&pl->d_q_len, L->q_len, n, 0, e, ec) ||
        upload(&pl->d_kv_len, L->kv_len, n, 0, e, ec) ||
        upload(&pl->d_q_indptr, q_indptr.data(), n + 1, 0, e, ec) ||
        upload(&pl->d_score_base, score_base.data(), n, 0, e, ec) ||
        upload(&pl->d_items, items.data(), items.size(), 0, e, ec))
      return ATTNRT_INTERNAL;
    CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_scores),
                  sizeof(float) * std::max<int64_t>(1, scores)));
  } else {
    pl->total_blocks = static_cast<int>(blk_req.size());
    const int64_t chunk = std::min<int64_t>(T, attnrt_cuda_sm90::kExtendChunkRows);
    const int64_t max_items = attnrt_cuda_sm90::attend_extend_max_items(chunk, pl->total_blocks);
    if (upload(&pl->d_row_pos, row_pos.data(), T, 0, e, ec) ||
        upload(&pl->d_kv_len, L->kv_len, n, 0, e, ec) ||
        upload(&pl->d_blk_base, blk_base.data(), n, 0, e, ec) ||
        upload(&pl->d_blk_req, blk_req.data(), blk_req.size(), 0, e, ec) ||
        upload(&pl->d_entry_cap, entry_cap.data(), n, 0, e, ec) ||
        upload(&pl->d_entry_base, entry_base.data(), n, 0, e, ec))
      return ATTNRT_INTERNAL;
    CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_counters),
                  sizeof(int32_t) * (pl->total_blocks + 1)));
    CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_entries),
                  sizeof(int32_t) * std::max<int64_t>(1, entries)));
    CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_attend_items),
                  sizeof(attnrt_cuda_sm90::AttendExtendItem) * std::max<int64_t>(1, max_items)));
    const size_t slots = static_cast<size_t>(std::max<int64_t>(1, chunk)) * kTopK * kHeads;
    CK(cudaMalloc(&pl->d_part_o16, 2 * slots * kHeadDim));  // the 16-bit q dtype
    CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_part_lse), sizeof(float) * slots));
  }
  return ATTNRT_OK;
}

int32_t plan_impl(const attnrt_problem* p, const attnrt_layout* L, Sm90Plan* pl) {
  const int n = L->num_requests;
  pl->problem = *p;
  pl->n = n;
  if (!is_decode_op(p->op)) return plan_extend(p, L, pl);
  int max_blk = 1;
  for (int b = 0; b < n; ++b) max_blk = std::max(max_blk, (L->kv_len[b] + kBlock - 1) / kBlock);
  // Room for 16 more blocks than the longest request, so update_plan absorbs later steps.
  pl->block_capacity = max_blk + 16;
  if (pl->block_capacity > kMaxBlocks)
    return fail(ATTNRT_UNAVAILABLE, "a context of %d blocks exceeds the fast path's %d",
                max_blk, kMaxBlocks - 16);
  const int total_pages = L->page_indptr[n];
  pl->page_capacity = std::max(2 * total_pages, total_pages + 16 * n);
  if (int32_t s = check_layout(L, pl->block_capacity, pl->page_capacity); s != ATTNRT_OK) return s;
  // Work split: as many blocks per CTA as makes one wave of resident CTAs (3 per SM by shared
  // memory) cover the batch, and at least 2 (both stages in flight). A request's CTAs then start
  // together and share its work; were some of them kept from starting (another kernel holding
  // the SMs), the launch runs solo instead (index_decode.h), slower but correct.
  CK(cudaSetDevice(p->device.index));
  int slots = 0;
  const bool fused = p->op == ATTNRT_OP_SPARSE_DECODE;
  CK(static_cast<cudaError_t>(attnrt_cuda_sm90::index_decode_resident_ctas(
      g_rt.info(p->device.index).sms, fused, &slots)));
  const int per_request = std::max(1, slots / std::max(n, 1));
  pl->blocks_per_cta = std::max((pl->block_capacity + per_request - 1) / per_request, 2);
  pl->ctas_per_request = (pl->block_capacity + pl->blocks_per_cta - 1) / pl->blocks_per_cta;
  if (upload(&pl->d_kv_len, L->kv_len, n, 0, g_error, sizeof g_error) ||
      upload(&pl->d_page_indptr, L->page_indptr, n + 1, 0, g_error, sizeof g_error) ||
      upload(&pl->d_page_ids, L->page_ids, total_pages, pl->page_capacity, g_error,
             sizeof g_error))
    return ATTNRT_INTERNAL;
  if (reads_index_inputs(p->op)) {
    const size_t words = sizeof(uint64_t) * attnrt_cuda_sm90::kSyncWords * std::max(n, 1);
    CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_sync), words));
    CK(cudaMemset(pl->d_sync, 0, words));
    // Fault injection. "barrier", for the watchdog's test: every request's launch count one
    // launch ahead of its arrivals, so the CTAs of a launch wait at the top-16 barrier for
    // arrivals that never come. "solo": the launches run solo (index_decode.h) as when some of
    // a request's CTAs cannot start.
    const char* fault = std::getenv("ATTNRT_SM90_FAULT");
    if (fault && std::strcmp(fault, "barrier") == 0) {
      std::vector<uint64_t> w(words / sizeof(uint64_t), 0);
      for (int b = 0; b < n; ++b)
        w[static_cast<size_t>(b) * attnrt_cuda_sm90::kSyncWords + 2] =
            static_cast<uint64_t>(pl->ctas_per_request);
      CK(cudaMemcpy(pl->d_sync, w.data(), words, cudaMemcpyHostToDevice));
    }
    pl->force_solo = fault && std::strcmp(fault, "solo") == 0;
    CK(attnrt_cuda_common::land_host_writes());  // zero before any stream's first launch
    allocate_wait_record();  // here, not in run(): run() allocates nothing (graph capture)
    CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_scores),
                  sizeof(float) * std::max<size_t>(1, static_cast<size_t>(n) * pl->block_capacity)));
  }
  if (fused) {  // a partial per selection slot
    const size_t slots = static_cast<size_t>(std::max(n, 1)) * kTopK * kHeads;
    CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_part_o32), sizeof(float) * slots * kHeadDim));
    CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_part_lse), sizeof(float) * slots));
  } else if (!reads_index_inputs(p->op)) {
    CK(static_cast<cudaError_t>(attnrt_cuda_sm90::attend_decode_parts(
        n, g_rt.info(p->device.index).sms, &pl->attend_parts)));
  }
  return ATTNRT_OK;
}

// Loads every kernel of the plugin on the device (the first plan there; later ones read an
// atomic per kernel list), so that no run() loads code (cuda_common/kernel_attr.h).
int32_t load_kernels(int device) {
  using namespace attnrt_cuda_sm90;
  CK(cudaSetDevice(device));
  CK(static_cast<cudaError_t>(index_decode_load_kernels()));
  CK(static_cast<cudaError_t>(attend_decode_load_kernels()));
  CK(static_cast<cudaError_t>(index_extend_load_kernels()));
  CK(static_cast<cudaError_t>(attend_extend_load_kernels()));
  return ATTNRT_OK;
}

int32_t p_plan(const attnrt_problem* p, const attnrt_layout* L, attnrt_plan* out) {
  try {
    if (int32_t s = p_probe(p); s != ATTNRT_OK) return s;
    if (int32_t s = load_kernels(p->device.index); s != ATTNRT_OK) return s;
    Sm90Plan* pl = new (std::nothrow) Sm90Plan{};
    if (!pl) return fail(ATTNRT_INTERNAL, "out of host memory");
    if (int32_t s = plan_impl(p, L, pl); s != ATTNRT_OK) {
      free_plan(pl);
      return s;
    }
    *out = reinterpret_cast<attnrt_plan>(pl);
    return ATTNRT_OK;
  } catch (...) {
    return fail(ATTNRT_INTERNAL, "exception in cuda_sm90 plan");
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A K/V-like cache whose pages are each one contiguous run of 128 rows of `dim` elements.
bool pages_contiguous(const attnrt_tensor& x, int dim) {
  return x.rank == 4 && x.data && x.strides[3] == 1 && x.strides[2] == dim &&
         x.strides[1] == dim && x.strides[0] % 8 == 0 && aligned16(x.data);
}
// Rows of a rank-3 [tokens, heads, dim] tensor: unit inner stride, 16-byte aligned rows.
bool rows_aligned(const attnrt_tensor& x) {
  return x.rank == 3 && x.data && x.strides[2] == 1 && x.strides[1] % 8 == 0 &&
         x.strides[0] % 8 == 0 && aligned16(x.data);
}

// The indexer's tensors, checked, into `base`.
int32_t index_args(const Sm90Plan& pl, const attnrt_tensors* t,
                   attnrt_cuda_sm90::IndexArgsBase* out) {
  const attnrt_problem& p = pl.problem;
  const attnrt_tensor &iq = t->index_q, &ik = t->index_k_cache, &tk = t->topk;
  if (!iq.data || iq.rank != 3 || !ik.data || ik.rank != 4 || !tk.data || tk.rank != 3)
    return fail(ATTNRT_INVALID, "index_q (rank 3), index_k_cache (rank 4), topk (rank 3) required");
  // A page must be one contiguous 32 KB run (one bulk copy), rows 16-byte aligned.
  if (!pages_contiguous(ik, kDim))
    return fail(ATTNRT_UNAVAILABLE,
                "cuda_sm90 needs each index_k_cache page contiguous and 16-byte aligned "
                "(strides [k, 128, 128, 1], k a multiple of 8); got [%lld, %lld, %lld, %lld]",
                static_cast<long long>(ik.strides[0]), static_cast<long long>(ik.strides[1]),
                static_cast<long long>(ik.strides[2]), static_cast<long long>(ik.strides[3]));
  if (!rows_aligned(iq)) return fail(ATTNRT_UNAVAILABLE, "cuda_sm90 needs 16-byte aligned index_q rows");
  attnrt_cuda_sm90::IndexArgsBase& base = *out;
  base.q = iq.data;
  base.kc = ik.data;
  base.q_s0 = iq.strides[0];
  base.k_s0 = ik.strides[0];
  base.kv_len = pl.d_kv_len;
  base.page_indptr = pl.d_page_indptr;
  base.page_ids = pl.d_page_ids;
  base.scores = pl.d_scores;
  base.topk = static_cast<int32_t*>(tk.data);
  base.t_s1 = tk.strides[1];
  base.t_s2 = tk.strides[2];
  base.init_blocks = p.init_blocks;
  base.local_blocks = p.local_blocks;
  base.scale = p.index_scale;
  return ATTNRT_OK;
}

// The decode indexer's plan fields.
void index_decode_args(const Sm90Plan& pl, attnrt_cuda_sm90::IndexDecodeArgs* a) {
  a->sync = pl.d_sync;
  a->wait_record = g_wait_record_dev;  // allocated by plan_impl
  a->n = pl.n;
  a->block_capacity = pl.block_capacity;
  a->blocks_per_cta = pl.blocks_per_cta;
  a->ctas_per_request = pl.ctas_per_request;
  a->force_solo = pl.force_solo ? 1 : 0;
}

int32_t run_index(const Sm90Plan& pl, const attnrt_tensors* t, void* stream) {
  const attnrt_problem& p = pl.problem;
  attnrt_cuda_sm90::IndexArgsBase base{};
  if (int32_t s = index_args(pl, t, &base); s != ATTNRT_OK) return s;
  CK(cudaSetDevice(p.device.index));
  if (p.op == ATTNRT_OP_SPARSE_INDEX_EXTEND) {
    attnrt_cuda_sm90::IndexExtendArgs a{};
    static_cast<attnrt_cuda_sm90::IndexArgsBase&>(a) = base;
    a.q_len = pl.d_q_len;
    a.q_indptr = pl.d_q_indptr;
    a.score_base = pl.d_score_base;
    a.row_req = pl.d_row_req;
    a.items = pl.d_items;
    a.num_items = pl.num_items;
    a.total_tokens = pl.tokens;
    CK(static_cast<cudaError_t>(attnrt_cuda_sm90::launch_index_extend(a, p.q_dtype, stream)));
    return ATTNRT_OK;
  }
  attnrt_cuda_sm90::IndexDecodeArgs a{};
  static_cast<attnrt_cuda_sm90::IndexArgsBase&>(a) = base;
  index_decode_args(pl, &a);
  CK(static_cast<cudaError_t>(attnrt_cuda_sm90::launch_index_decode(a, p.q_dtype, stream)));
  return ATTNRT_OK;
}

// The attention's tensors: present and laid out as the kernels read them.
int32_t check_attend_tensors(const attnrt_problem& p, const attnrt_tensors* t) {
  if (!t->q.data || !t->out.data || !t->k_cache.data || !t->v_cache.data || !t->topk.data ||
      t->topk.rank != 3)
    return fail(ATTNRT_INVALID, "q, out, k_cache, v_cache and topk (rank 3) required");
  if (!rows_aligned(t->q) || !rows_aligned(t->out))
    return fail(ATTNRT_UNAVAILABLE, "cuda_sm90 needs q and out rank 3 with 16-byte aligned rows");
  if (!pages_contiguous(t->k_cache, kHeadDim) || !pages_contiguous(t->v_cache, kHeadDim))
    return fail(ATTNRT_UNAVAILABLE,
                "cuda_sm90 needs each k_cache/v_cache page contiguous and 16-byte aligned "
                "(strides [k, 128, 128, 1], k a multiple of 8)");
  if (p.write_lse && (!t->lse.data || t->lse.strides[1] != 1))
    return fail(ATTNRT_INVALID, "lse must be present with unit innermost stride");
  if (p.has_sink && !t->sink.data) return fail(ATTNRT_INVALID, "sink missing");
  return ATTNRT_OK;
}

int32_t run_attend(const Sm90Plan& pl, const attnrt_tensors* t, void* stream) {
  const attnrt_problem& p = pl.problem;
  if (int32_t s = check_attend_tensors(p, t); s != ATTNRT_OK) return s;
  CK(cudaSetDevice(p.device.index));
  if (p.op == ATTNRT_OP_SPARSE_ATTEND_EXTEND) {
    attnrt_cuda_sm90::AttendExtendArgs a{};
    static_cast<attnrt_cuda_common::AttendTensors&>(a) = attnrt_cuda_common::attend_tensors(*t, p);
    a.row_req = pl.d_row_req;
    a.row_pos = pl.d_row_pos;
    a.kv_len = pl.d_kv_len;
    a.page_indptr = pl.d_page_indptr;
    a.page_ids = pl.d_page_ids;
    a.blk_base = pl.d_blk_base;
    a.blk_req = pl.d_blk_req;
    a.entry_base = pl.d_entry_base;
    a.entry_cap = pl.d_entry_cap;
    a.counts = pl.d_counters;
    a.entries = pl.d_entries;
    a.items = pl.d_attend_items;
    a.part_o = pl.d_part_o16;
    a.part_lse = pl.d_part_lse;
    a.total_blocks = pl.total_blocks;
    a.rows = pl.tokens;
    a.scale_log2 = p.sm_scale * 1.4426950408889634f;
    CK(static_cast<cudaError_t>(attnrt_cuda_sm90::launch_attend_extend(a, p.q_dtype, stream)));
    return ATTNRT_OK;
  }
  attnrt_cuda_sm90::AttendDecodeArgs a{};
  static_cast<attnrt_cuda_common::AttendTensors&>(a) = attnrt_cuda_common::attend_tensors(*t, p);
  a.kv_len = pl.d_kv_len;
  a.page_indptr = pl.d_page_indptr;
  a.page_ids = pl.d_page_ids;
  a.n = pl.n;
  a.parts = pl.attend_parts;
  a.scale_log2 = p.sm_scale * 1.4426950408889634f;
  CK(static_cast<cudaError_t>(attnrt_cuda_sm90::launch_attend_decode(a, p.q_dtype, stream)));
  return ATTNRT_OK;
}

// sparse_decode: the indexer and the attend in one launch.
int32_t run_fused(const Sm90Plan& pl, const attnrt_tensors* t, void* stream) {
  const attnrt_problem& p = pl.problem;
  attnrt_cuda_sm90::SparseDecodeArgs a{};
  if (int32_t s = index_args(pl, t, &a); s != ATTNRT_OK) return s;
  if (int32_t s = check_attend_tensors(p, t); s != ATTNRT_OK) return s;
  index_decode_args(pl, &a);
  a.att = attnrt_cuda_common::attend_tensors(*t, p);
  a.part_o = pl.d_part_o32;
  a.part_lse = pl.d_part_lse;
  a.scale_log2 = p.sm_scale * 1.4426950408889634f;
  CK(cudaSetDevice(p.device.index));
  CK(static_cast<cudaError_t>(attnrt_cuda_sm90::launch_sparse_decode(a, p.q_dtype, stream)));
  return ATTNRT_OK;
}

int32_t p_run(attnrt_plan plan, const attnrt_tensors* t, void* stream) {
  try {
    if (!plan) return fail(ATTNRT_INVALID, "null plan");
    const Sm90Plan& pl = *reinterpret_cast<const Sm90Plan*>(plan);
    if (pl.problem.op == ATTNRT_OP_SPARSE_DECODE) return run_fused(pl, t, stream);
    return is_index_op(pl.problem.op) ? run_index(pl, t, stream) : run_attend(pl, t, stream);
  } catch (...) {
    return fail(ATTNRT_INTERNAL, "exception in cuda_sm90 run");
  }
}

void p_destroy_plan(attnrt_plan plan) { free_plan(reinterpret_cast<Sm90Plan*>(plan)); }

int32_t p_update_plan(attnrt_plan plan, const attnrt_layout* L) {
  try {
    if (!plan) return fail(ATTNRT_INVALID, "null plan");
    Sm90Plan* pl = reinterpret_cast<Sm90Plan*>(plan);
    if (!is_decode_op(pl->problem.op))
      return fail(ATTNRT_UNAVAILABLE, "update_plan serves decode plans only");
    const int n = L->num_requests;
    if (n != pl->n) return fail(ATTNRT_UNAVAILABLE, "update_plan: %d requests, plan has %d", n, pl->n);
    if (int32_t s = check_layout(L, pl->block_capacity, pl->page_capacity); s != ATTNRT_OK)
      return s;
    CK(cudaSetDevice(pl->problem.device.index));
    // Every CTA of a request must read the same kv_len and pages, or their ranks disagree and a
    // holder waits for a rank nobody publishes: no launch may straddle the rewrite.
    CK(attnrt_cuda_common::quiesce_before_rewrite());
    CK(cudaMemcpy(pl->d_kv_len, L->kv_len, sizeof(int32_t) * n, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(pl->d_page_indptr, L->page_indptr, sizeof(int32_t) * (n + 1),
                  cudaMemcpyHostToDevice));
    if (L->page_indptr[n] > 0)
      CK(cudaMemcpy(pl->d_page_ids, L->page_ids, sizeof(int32_t) * L->page_indptr[n],
                    cudaMemcpyHostToDevice));
    CK(attnrt_cuda_common::land_host_writes());
    return ATTNRT_OK;
  } catch (...) {
    return fail(ATTNRT_INTERNAL, "exception in cuda_sm90 update_plan");
  }
}

const char* p_last_error() { return g_error; }

int32_t p_preferred_page_size(attnrt_device d, int32_t* ps) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  // Page = block = 128 is what the fast path takes; elsewhere it has no preference.
  *ps = g_rt.info(d.index).major == 9 ? kBlock : 0;
  return ATTNRT_OK;
}

int32_t p_mem_alloc(attnrt_device d, size_t bytes, void** out) {
  return g_rt.alloc(d, bytes, out, g_error, sizeof g_error);
}
int32_t p_mem_free(attnrt_device d, void* ptr) { return g_rt.free(d, ptr, g_error, sizeof g_error); }
int32_t p_copy_to_device(attnrt_device d, void* dst, const void* src, size_t bytes) {
  return g_rt.to_device(d, dst, src, bytes, g_error, sizeof g_error);
}
int32_t p_copy_to_host(attnrt_device d, void* dst, const void* src, size_t bytes) {
  return with_wait_note(g_rt.to_host(d, dst, src, bytes, g_error, sizeof g_error));
}
int32_t p_synchronize(attnrt_device d) {
  return with_wait_note(g_rt.synchronize(d, g_error, sizeof g_error));
}
int32_t p_describe_device(attnrt_device d, char* buf, size_t cap) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  const attnrt_cuda_common::DeviceInfo& i = g_rt.info(d.index);
  std::snprintf(buf, cap, "%s, sm_%d%d, %d SMs, %s", i.name, i.major, i.minor, i.sms,
                i.major == 9 ? "sparse indexer and attend, extend and decode; fused sparse decode"
                             : "not Hopper: fast path off");
  return ATTNRT_OK;
}

// Solo launches (index_decode.h): correct, but one CTA ranks (and attends) the request alone.
int32_t p_degraded_runs(attnrt_device d, int32_t op, uint64_t* count, char* note, size_t cap) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  *count = 0;
  if (cap > 0) note[0] = '\0';
  if (op != ATTNRT_OP_SPARSE_INDEX_DECODE && op != ATTNRT_OP_SPARSE_DECODE) return ATTNRT_OK;
  CK(cudaSetDevice(d.index));
  CK(static_cast<cudaError_t>(
      attnrt_cuda_sm90::index_decode_solo_requests(op == ATTNRT_OP_SPARSE_DECODE, count)));
  std::snprintf(note, cap,
                "requests run solo: another kernel held multiprocessors that some of their CTAs "
                "needed, so one CTA %s each alone",
                op == ATTNRT_OP_SPARSE_DECODE ? "ranked and attended" : "ranked");
  return ATTNRT_OK;
}

const attnrt_plugin_v1 kTable = {
    ATTNRT_PLUGIN_ABI_VERSION,
    sizeof(attnrt_plugin_v1),
    "cuda_sm90",
    300,
    p_init,
    p_device_count,
    p_probe,
    p_plan,
    p_run,
    p_destroy_plan,
    p_last_error,
    p_update_plan,
    p_preferred_page_size,
    p_mem_alloc,
    p_mem_free,
    p_copy_to_device,
    p_copy_to_host,
    p_synchronize,
    p_describe_device,
    p_degraded_runs,
};

}  // namespace

extern "C" {
ATTNRT_PLUGIN_EXPORT extern const uint32_t attnrt_plugin_abi_version;
const uint32_t attnrt_plugin_abi_version = ATTNRT_PLUGIN_ABI_VERSION;
ATTNRT_PLUGIN_EXPORT const attnrt_plugin_v1* attnrt_plugin_get(void) { return &kTable; }
}
