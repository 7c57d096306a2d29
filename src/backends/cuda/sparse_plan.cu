// Host side of the CUDA sparse ops: probe (limits by name), plan (device metadata, work items,
// score and split buffers, all sized from the layout), run (argument checks, launches).
// sparse_decode is served as its definition reads: a decode-indexer plan and a decode-attend
// plan, run one after the other on the same stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <new>
#include <vector>

#include "cuda_common/device_runtime.h"
#include "sparse_kernels.h"

namespace attnrt_cuda_sparse {
namespace {

using attnrt_cuda_common::upload;

int32_t say(char* err, size_t cap, int32_t status, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
int32_t say(char* err, size_t cap, int32_t status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(err, cap, fmt, ap);
  va_end(ap);
  return status;
}

#define SCK(call)                                                                          \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess)                                                                 \
      return say(err, cap, ATTNRT_INTERNAL, "%s: %s (%s)", #call, cudaGetErrorName(e_),   \
                 cudaGetErrorString(e_));                                                  \
  } while (0)

constexpr int kMaxEntries = 1024;  // R * K, the union list kept in shared memory

struct SparsePlan {
  attnrt_problem problem{};  // first member: cuda_plugin.cu dispatches on problem.op
  int n = 0;
  int64_t T = 0;
  // Decode plans keep room to grow in place (update): page ids and, for the indexer, score
  // blocks per request (its work items cover them; blocks past a request's length are skipped).
  int page_capacity = 0;
  int block_capacity = 0;
  int rows = 0;  // attend: packed tokens (extend) or requests (decode)
  int num_items = 0, rows_per_tile = 16;
  int htiles = 1, nsplit = 1, per_split = 1;
  int32_t *d_q_len = nullptr, *d_kv_len = nullptr, *d_page_indptr = nullptr, *d_page_ids = nullptr;
  int64_t *d_q_indptr = nullptr, *d_score_base = nullptr;
  int32_t *d_row_req = nullptr, *d_row_pos = nullptr;
  IndexItem* d_items = nullptr;
  float *d_scores = nullptr, *d_part_o = nullptr, *d_part_lse = nullptr;
};

// sparse_decode: the two plans it runs.
struct ComposedPlan {
  attnrt_problem problem{};  // first member, as in SparsePlan
  attnrt_plan index = nullptr, attend = nullptr;
};

attnrt_problem with_op(const attnrt_problem& p, int32_t op) {
  attnrt_problem q = p;
  q.op = op;
  return q;
}

void free_plan(SparsePlan* p) {
  if (!p) return;
  void* bufs[] = {p->d_q_len,    p->d_kv_len,   p->d_page_indptr, p->d_page_ids,
                  p->d_q_indptr, p->d_score_base, p->d_row_req,   p->d_row_pos,
                  p->d_items,    p->d_scores,   p->d_part_o,      p->d_part_lse};
  for (void* b : bufs) cudaFree(b);
  delete p;
}

int32_t plan_impl(const attnrt_problem* p, const attnrt_layout* L, int sms, SparsePlan* pl,
                  char* err, size_t cap) {
  const int n = L->num_requests;
  pl->problem = *p;
  pl->n = n;
  pl->T = L->q_indptr[n];
  SCK(cudaSetDevice(p->device.index));
  const bool decode = is_decode_op(p->op);
  const int total_pages = L->page_indptr[n];
  // Decode: room for growth, so that update() absorbs the next steps in place.
  pl->page_capacity = decode ? std::max(2 * total_pages, total_pages + 16 * n) : total_pages;
  if (upload(&pl->d_q_len, L->q_len, n, 0, err, cap) ||
      upload(&pl->d_kv_len, L->kv_len, n, 0, err, cap) ||
      upload(&pl->d_q_indptr, L->q_indptr, n + 1, 0, err, cap) ||
      upload(&pl->d_page_indptr, L->page_indptr, n + 1, 0, err, cap) ||
      upload(&pl->d_page_ids, L->page_ids, total_pages, pl->page_capacity, err, cap))
    return ATTNRT_INTERNAL;
  const int B = p->block_size;
  std::vector<int32_t> tok_req(pl->T);
  for (int b = 0; b < n; ++b)
    for (int64_t t = L->q_indptr[b]; t < L->q_indptr[b + 1]; ++t) tok_req[t] = b;

  if (is_index_op(p->op)) {
    const int H = p->num_index_heads;
    int max_blk = 1;
    for (int b = 0; b < n; ++b) max_blk = std::max(max_blk, (L->kv_len[b] + B - 1) / B);
    // Decode: every request gets the same room, enough for 16 more blocks than the longest.
    pl->block_capacity = decode ? max_blk + 16 : 0;
    std::vector<int64_t> base(n + 1, 0);
    int max_rows = 0;
    for (int b = 0; b < n; ++b) {
      const int64_t nblk = decode ? pl->block_capacity : (static_cast<int64_t>(L->kv_len[b]) + B - 1) / B;
      base[b + 1] = base[b] + static_cast<int64_t>(L->q_len[b]) * H * nblk;
      max_rows = std::max(max_rows, L->q_len[b] * H);
    }
    pl->rows_per_tile = max_rows >= 64 ? 64 : 16;
    const int RT = pl->rows_per_tile;
    // Blocks a tile of rows scores: up to its last row's position (decode: the capacity).
    auto tile_blocks = [&](int b, int r0) {
      const int last = std::min(r0 + RT, L->q_len[b] * H) - 1;
      return decode ? pl->block_capacity : (L->kv_len[b] - L->q_len[b] + last / H) / B + 1;
    };
    int64_t tiles = 0;
    for (int b = 0; b < n; ++b)
      for (int r0 = 0; r0 < L->q_len[b] * H; r0 += RT) tiles += tile_blocks(b, r0);
    const int64_t nbi = std::clamp<int64_t>(tiles / std::max(1, 4 * sms), 1, 32);
    std::vector<IndexItem> items;
    for (int b = 0; b < n; ++b) {
      const int nrows = L->q_len[b] * H;
      for (int r0 = 0; r0 < nrows; r0 += RT) {
        const int nb = tile_blocks(b, r0);
        for (int c = 0; c < nb; c += static_cast<int>(nbi))
          items.push_back({b, r0, c, std::min<int>(nb, c + static_cast<int>(nbi))});
      }
    }
    pl->num_items = static_cast<int>(items.size());
    if (upload(&pl->d_score_base, base.data(), n, 0, err, cap) ||
        upload(&pl->d_row_req, tok_req.data(), tok_req.size(), 0, err, cap) ||
        upload(&pl->d_items, items.data(), items.size(), 0, err, cap))
      return ATTNRT_INTERNAL;
    SCK(cudaMalloc(reinterpret_cast<void**>(&pl->d_scores),
                   sizeof(float) * std::max<int64_t>(base[n], 1)));
    return ATTNRT_OK;
  }

  // sparse attend
  pl->rows = decode ? n : static_cast<int>(pl->T);
  std::vector<int32_t> row_req(pl->rows), row_pos(pl->rows);
  for (int b = 0; b < n; ++b)
    for (int64_t t = L->q_indptr[b]; t < L->q_indptr[b + 1]; ++t) {
      const int r = decode ? b : static_cast<int>(t);
      row_req[r] = b;
      row_pos[r] = L->kv_len[b] - L->q_len[b] + static_cast<int32_t>(t - L->q_indptr[b]);
    }
  const int group = p->num_q_heads / p->num_kv_heads;
  pl->htiles = (group + 15) / 16;
  const int E = (p->num_index_heads / p->num_kv_heads) * p->topk;
  if (decode) {
    const int64_t ctas = static_cast<int64_t>(pl->rows) * p->num_kv_heads * pl->htiles;
    const int want = static_cast<int>(
        std::clamp<int64_t>((2 * static_cast<int64_t>(sms) + ctas - 1) / std::max<int64_t>(ctas, 1), 1, E));
    pl->per_split = (E + want - 1) / want;
    pl->nsplit = (E + pl->per_split - 1) / pl->per_split;
  } else {
    pl->per_split = E;
    pl->nsplit = 1;
  }
  if (upload(&pl->d_row_req, row_req.data(), row_req.size(), 0, err, cap) ||
      upload(&pl->d_row_pos, row_pos.data(), row_pos.size(), 0, err, cap))
    return ATTNRT_INTERNAL;
  if (pl->nsplit > 1) {
    const size_t slots = static_cast<size_t>(pl->rows) * pl->nsplit * p->num_q_heads;
    SCK(cudaMalloc(reinterpret_cast<void**>(&pl->d_part_o), sizeof(float) * slots * p->head_dim));
    SCK(cudaMalloc(reinterpret_cast<void**>(&pl->d_part_lse), sizeof(float) * slots));
  }
  return ATTNRT_OK;
}

bool rows_aligned(const attnrt_tensor& x) {
  if (reinterpret_cast<uintptr_t>(x.data) % 16 != 0) return false;
  for (int k = 0; k + 1 < x.rank; ++k)
    if (x.strides[k] % 8 != 0) return false;
  return x.rank >= 1 && x.strides[x.rank - 1] == 1;
}

}  // namespace

int32_t probe(const attnrt_problem* p, int cc_major, char* err, size_t cap) {
  if (cc_major < 8)
    return say(err, cap, ATTNRT_UNAVAILABLE, "cuda sparse kernels need sm_80 or newer");
  if (p->q_dtype != ATTNRT_BF16 && p->q_dtype != ATTNRT_F16)
    return say(err, cap, ATTNRT_UNAVAILABLE, "q dtype %d not supported by cuda sparse (bf16, f16)",
               p->q_dtype);
  if (p->kv_dtype != p->q_dtype)
    return say(err, cap, ATTNRT_UNAVAILABLE, "kv dtype %d must equal q dtype %d on cuda sparse",
               p->kv_dtype, p->q_dtype);
  if (p->page_size < 1) return say(err, cap, ATTNRT_UNAVAILABLE, "page_size %d < 1", p->page_size);
  if (p->block_size < 1) return say(err, cap, ATTNRT_UNAVAILABLE, "block_size %d < 1", p->block_size);
  if (p->topk < 1) return say(err, cap, ATTNRT_UNAVAILABLE, "topk %d < 1", p->topk);
  if (p->num_index_heads < 1)
    return say(err, cap, ATTNRT_UNAVAILABLE, "num_index_heads %d < 1", p->num_index_heads);
  if (reads_index_inputs(p->op)) {
    if (p->index_dim != 32 && p->index_dim != 64 && p->index_dim != 128)
      return say(err, cap, ATTNRT_UNAVAILABLE,
                 "index_dim %d not supported by cuda sparse (32, 64, 128)", p->index_dim);
    if (p->score_type != 0 && p->score_type != 1)
      return say(err, cap, ATTNRT_UNAVAILABLE, "score_type %d unknown", p->score_type);
    if (!reads_attention_inputs(p->op)) return ATTNRT_OK;
  }
  if (p->head_dim != 64 && p->head_dim != 128)
    return say(err, cap, ATTNRT_UNAVAILABLE, "head_dim %d not supported by cuda sparse (64, 128)",
               p->head_dim);
  if (p->num_kv_heads < 1 || p->num_q_heads % p->num_kv_heads != 0)
    return say(err, cap, ATTNRT_UNAVAILABLE, "num_q_heads %d not a multiple of num_kv_heads %d",
               p->num_q_heads, p->num_kv_heads);
  if (p->num_index_heads % p->num_kv_heads != 0)
    return say(err, cap, ATTNRT_UNAVAILABLE,
               "num_index_heads %d not a multiple of num_kv_heads %d", p->num_index_heads,
               p->num_kv_heads);
  const int E = p->num_index_heads / p->num_kv_heads * p->topk;
  if (E > kMaxEntries)
    return say(err, cap, ATTNRT_UNAVAILABLE,
               "union of %d index heads x topk %d = %d blocks per group exceeds %d on cuda sparse",
               p->num_index_heads / p->num_kv_heads, p->topk, E, kMaxEntries);
  return ATTNRT_OK;
}

int32_t plan(const attnrt_problem* p, const attnrt_layout* L, int sms, attnrt_plan* out,
             char* err, size_t cap) {
  if (p->op == ATTNRT_OP_SPARSE_DECODE) {
    ComposedPlan* c = new (std::nothrow) ComposedPlan{};
    if (!c) return say(err, cap, ATTNRT_INTERNAL, "out of host memory");
    c->problem = *p;
    const attnrt_problem ip = with_op(*p, ATTNRT_OP_SPARSE_INDEX_DECODE);
    const attnrt_problem ap = with_op(*p, ATTNRT_OP_SPARSE_ATTEND_DECODE);
    int32_t s = plan(&ip, L, sms, &c->index, err, cap);
    if (s == ATTNRT_OK) s = plan(&ap, L, sms, &c->attend, err, cap);
    if (s != ATTNRT_OK) {
      destroy(reinterpret_cast<attnrt_plan>(c));
      return s;
    }
    *out = reinterpret_cast<attnrt_plan>(c);
    return ATTNRT_OK;
  }
  try {
    SparsePlan* pl = new (std::nothrow) SparsePlan{};
    if (!pl) return say(err, cap, ATTNRT_INTERNAL, "out of host memory");
    if (int32_t s = plan_impl(p, L, sms, pl, err, cap); s != ATTNRT_OK) {
      free_plan(pl);
      return s;
    }
    *out = reinterpret_cast<attnrt_plan>(pl);
    return ATTNRT_OK;
  } catch (...) {
    return say(err, cap, ATTNRT_INTERNAL, "exception in cuda sparse plan");
  }
}

int32_t update(attnrt_plan plan, const attnrt_layout* L, char* err, size_t cap) {
  if (reinterpret_cast<const attnrt_problem*>(plan)->op == ATTNRT_OP_SPARSE_DECODE) {
    const ComposedPlan* c = reinterpret_cast<const ComposedPlan*>(plan);
    // The indexer's check covers the attend's (same requests, pages and blocks), so a refusal
    // comes before either plan changes.
    if (int32_t s = update(c->index, L, err, cap); s != ATTNRT_OK) return s;
    return update(c->attend, L, err, cap);
  }
  SparsePlan* pl = reinterpret_cast<SparsePlan*>(plan);
  const attnrt_problem& p = pl->problem;
  if (!is_decode_op(p.op))
    return say(err, cap, ATTNRT_UNAVAILABLE, "update_plan serves decode plans only");
  const int n = L->num_requests;
  if (n != pl->n)
    return say(err, cap, ATTNRT_UNAVAILABLE, "update_plan: %d requests, plan has %d", n, pl->n);
  for (int b = 0; b < n; ++b) {
    if (L->q_len[b] != 1 || L->q_indptr[b] != b)
      return say(err, cap, ATTNRT_UNAVAILABLE, "update_plan: request %d is not a decode row", b);
    if (is_index_op(p.op) && (L->kv_len[b] + p.block_size - 1) / p.block_size > pl->block_capacity)
      return say(err, cap, ATTNRT_UNAVAILABLE,
                 "update_plan: request %d has %d blocks, the plan has room for %d", b,
                 (L->kv_len[b] + p.block_size - 1) / p.block_size, pl->block_capacity);
  }
  const int total_pages = L->page_indptr[n];
  if (total_pages > pl->page_capacity)
    return say(err, cap, ATTNRT_UNAVAILABLE, "update_plan: %d pages exceed the plan's capacity %d",
               total_pages, pl->page_capacity);
  SCK(cudaSetDevice(p.device.index));
  SCK(attnrt_cuda_common::quiesce_before_rewrite());  // no launch straddles the rewrite
  SCK(cudaMemcpy(pl->d_kv_len, L->kv_len, sizeof(int32_t) * n, cudaMemcpyHostToDevice));
  SCK(cudaMemcpy(pl->d_page_indptr, L->page_indptr, sizeof(int32_t) * (n + 1),
                 cudaMemcpyHostToDevice));
  if (total_pages > 0)
    SCK(cudaMemcpy(pl->d_page_ids, L->page_ids, sizeof(int32_t) * total_pages,
                   cudaMemcpyHostToDevice));
  if (pl->d_row_pos) {  // attend: the query of request b sits at kv_len - 1
    std::vector<int32_t> pos(n);
    for (int b = 0; b < n; ++b) pos[b] = L->kv_len[b] - 1;
    SCK(cudaMemcpy(pl->d_row_pos, pos.data(), sizeof(int32_t) * n, cudaMemcpyHostToDevice));
  }
  SCK(attnrt_cuda_common::land_host_writes());
  return ATTNRT_OK;
}

// Every refusal of a run of `pl` on `t`, before anything is launched.
int32_t check_tensors(const SparsePlan& pl, const attnrt_tensors* t, char* err, size_t cap) {
  const attnrt_problem& p = pl.problem;
  if (!t->topk.data || t->topk.rank != 3)
    return say(err, cap, ATTNRT_INVALID, "topk must be present with rank 3");
  if (is_index_op(p.op)) {
    if (!t->index_q.data || t->index_q.rank != 3 || !t->index_k_cache.data ||
        t->index_k_cache.rank != 4)
      return say(err, cap, ATTNRT_INVALID, "index_q (rank 3) and index_k_cache (rank 4) required");
    if (!rows_aligned(t->index_q) || !rows_aligned(t->index_k_cache))
      return say(err, cap, ATTNRT_UNAVAILABLE,
                 "cuda sparse needs 16-byte aligned index rows (strides multiple of 8)");
    return ATTNRT_OK;
  }
  const attnrt_tensor* need[] = {&t->q, &t->out, &t->k_cache, &t->v_cache};
  for (const attnrt_tensor* x : need)
    if (!x->data) return say(err, cap, ATTNRT_INVALID, "q, out, k_cache and v_cache required");
  if (t->q.rank != 3 || t->out.rank != 3 || t->k_cache.rank != 4 || t->v_cache.rank != 4)
    return say(err, cap, ATTNRT_INVALID, "q/out rank 3, k_cache/v_cache rank 4 required");
  for (const attnrt_tensor* x : need)
    if (!rows_aligned(*x))
      return say(err, cap, ATTNRT_UNAVAILABLE,
                 "cuda sparse needs 16-byte aligned rows (strides multiple of 8, unit inner)");
  if (p.write_lse && (!t->lse.data || t->lse.strides[1] != 1))
    return say(err, cap, ATTNRT_INVALID, "lse must be present with unit innermost stride");
  if (p.has_sink && !t->sink.data) return say(err, cap, ATTNRT_INVALID, "sink missing");
  return ATTNRT_OK;
}

int32_t run(attnrt_plan plan, const attnrt_tensors* t, void* stream, char* err, size_t cap) {
  if (reinterpret_cast<const attnrt_problem*>(plan)->op == ATTNRT_OP_SPARSE_DECODE) {
    // Both halves are checked first: an attend refusal must come before the indexer writes topk.
    const ComposedPlan* c = reinterpret_cast<const ComposedPlan*>(plan);
    for (attnrt_plan half : {c->index, c->attend})
      if (int32_t s = check_tensors(*reinterpret_cast<const SparsePlan*>(half), t, err, cap);
          s != ATTNRT_OK)
        return s;
    if (int32_t s = run(c->index, t, stream, err, cap); s != ATTNRT_OK) return s;
    return run(c->attend, t, stream, err, cap);
  }
  const SparsePlan& pl = *reinterpret_cast<const SparsePlan*>(plan);
  const attnrt_problem& p = pl.problem;
  if (int32_t s = check_tensors(pl, t, err, cap); s != ATTNRT_OK) return s;
  SCK(cudaSetDevice(p.device.index));
  if (is_index_op(p.op)) {
    IndexArgs a{};
    a.q = t->index_q.data;
    a.kc = t->index_k_cache.data;
    a.q_s0 = t->index_q.strides[0];
    a.q_s1 = t->index_q.strides[1];
    a.k_s0 = t->index_k_cache.strides[0];
    a.k_s1 = t->index_k_cache.strides[1];
    a.H = p.num_index_heads;
    a.D = p.index_dim;
    a.B = p.block_size;
    a.K = p.topk;
    a.page_size = p.page_size;
    a.init_blocks = p.init_blocks;
    a.local_blocks = p.local_blocks;
    a.score_lse = p.score_type == 1;
    a.scale_log2 = p.index_scale * 1.4426950408889634f;
    a.q_len = pl.d_q_len;
    a.kv_len = pl.d_kv_len;
    a.q_indptr = pl.d_q_indptr;
    a.page_indptr = pl.d_page_indptr;
    a.page_ids = pl.d_page_ids;
    a.score_base = pl.d_score_base;
    a.row_req = pl.d_row_req;
    a.scores = pl.d_scores;
    a.topk = static_cast<int32_t*>(t->topk.data);
    a.t_s0 = t->topk.strides[0];
    a.t_s1 = t->topk.strides[1];
    a.t_s2 = t->topk.strides[2];
    a.items = pl.d_items;
    a.num_items = pl.num_items;
    a.total_tokens = pl.T;
    SCK(static_cast<cudaError_t>(launch_index(a, p.q_dtype, pl.rows_per_tile, stream)));
    return ATTNRT_OK;
  }
  AttendArgs a{};
  static_cast<attnrt_cuda_common::AttendTensors&>(a) = attnrt_cuda_common::attend_tensors(*t, p);
  a.hq = p.num_q_heads;
  a.hkv = p.num_kv_heads;
  a.group = p.num_q_heads / p.num_kv_heads;
  a.htiles = pl.htiles;
  a.D = p.head_dim;
  a.B = p.block_size;
  a.K = p.topk;
  a.R = p.num_index_heads / p.num_kv_heads;
  a.page_size = p.page_size;
  a.nsplit = pl.nsplit;
  a.per_split = pl.per_split;
  a.scale_log2 = p.sm_scale * 1.4426950408889634f;
  a.row_req = pl.d_row_req;
  a.row_pos = pl.d_row_pos;
  a.kv_len = pl.d_kv_len;
  a.page_indptr = pl.d_page_indptr;
  a.page_ids = pl.d_page_ids;
  a.part_o = pl.d_part_o;
  a.part_lse = pl.d_part_lse;
  a.rows = pl.rows;
  SCK(static_cast<cudaError_t>(launch_attend(a, p.q_dtype, stream)));
  return ATTNRT_OK;
}

void destroy(attnrt_plan plan) {
  if (plan && reinterpret_cast<const attnrt_problem*>(plan)->op == ATTNRT_OP_SPARSE_DECODE) {
    ComposedPlan* c = reinterpret_cast<ComposedPlan*>(plan);
    destroy(c->index);
    destroy(c->attend);
    delete c;
    return;
  }
  free_plan(reinterpret_cast<SparsePlan*>(plan));
}

}  // namespace attnrt_cuda_sparse
