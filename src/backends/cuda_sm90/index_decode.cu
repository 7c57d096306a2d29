// Fused decode indexer for the cuda_sm90 plugin (see index_decode.h).
//
// One launch does the whole op. Grid: ctas_per_request CTAs per request, each scoring a range of
// blocks_per_cta blocks (the plan sizes them so the grid is one wave of resident CTAs). A block
// is one page, 32 KB contiguous, so a single Hopper bulk copy (cp.async.bulk, completion counted
// by an mbarrier) brings it into shared memory; two stages keep the next page in flight while the
// 4 warps score the current one (8 threads per key row, 16 dims each, shuffle-reduced; the
// block's max over keys j < kv_len). Top-16: the request's CTAs meet at a barrier, each ranks its
// own blocks against all of the request's scores (ties to the lowest ids, forced init/local
// blocks, NaN -> -1e30) and writes those of rank < 16 to their slot; the last CTA to finish puts
// the 16 slots in ascending id order. Padding is -1. The request's counters only grow, so the
// next launch, or a captured graph's replay, needs no reset.
//
// CTAs wait for their peers only once the launch's mode word says every peer has started
// (index_decode.h): the launch is not cooperative, so that it neither pays the cooperative
// launch's cost (~1 us at batch 1) nor hangs when another kernel holds the SMs that some of its
// CTAs need; then it runs solo, the request's last CTA to start doing the ranking and attention
// alone. Every wait for peers is watched (cuda_common/spin_wait.cuh): one still waiting after
// 10 s records where in the host-visible WaitRecord and traps, so a broken barrier fails the
// launch instead of hanging the device.
//
// Fused with the attend (launch_sparse_decode, op sparse_decode; decode_block_attend.cuh): each
// top-16 block is attended by one CTA of its request. CTA p attends ranks p, p + P, ... (P CTAs a
// request), learning their blocks from the request's word of each rank, which the ranking CTA
// writes tagged with the launch; with 128 or more CTAs a request, a CTA instead keeps the best
// block it ranked and attends it at once (its word says "taken"), so the usual case, winners
// apart, has no round trip between ranking and attending. So no CTA attends more than
// ceil(16 / P) blocks, or two, however the winners cluster. A CTA writes one partial (normalised
// o, log2 lse) to the slot of its first rank; the slot holders then wait for the request's other
// CTAs and split the merge of the 16 heads between them; rank 0's holder sorts topk. This
// removes, against the two launches, the attend's wait for the whole indexer grid to drain, its
// second read of the selections and page ids, and a merge by one CTA.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <climits>
#include <cstdint>

#include <attnrt/plugin.h>

#include "cuda_common/block_topk.cuh"
#include "cuda_common/grid_dependency.cuh"
#include "cuda_common/kernel_attr.h"
#include "cuda_common/mbarrier.cuh"
#include "cuda_common/mma_sm80.cuh"
#include "cuda_common/phase_trace.cuh"
#include "cuda_common/spin_wait.cuh"
#include "decode_block_attend.cuh"
#include "index_decode.h"

namespace attnrt_cuda_sm90 {

// Profiling builds only (cuda_common/phase_trace.cuh): where each CTA is when.
ATTNRT_PHASE_TABLE(sm90_index_decode,
                   "start,copies issued,first page,scored,barrier passed,ranked,sorted")
ATTNRT_PHASE_TABLE(sm90_sparse_decode,
                   "start,copies issued,first page,scored,barrier passed,ranked,kv landed,"
                   "computed,attended,all attended,merge loads back,merged")

namespace {

constexpr int kThreads = 128;
static_assert(kThreads == kAttendThreads, "the fused attend runs on the indexer's threads");
constexpr int kStages = 2;
constexpr int kPageBytes = kBlock * kDim * 2;
static_assert(kStages * kPageBytes >= kMaxBlocks * 4, "a request's block keys reuse the stages");
static_assert(kStages * kPageBytes == 2 * kTileBytes, "the fused attend's K and V reuse the stages");
static_assert(kPartialScratchBytes <= kStages * kPageBytes, "cta_partial's scratch too");
// Fused: from this many CTAs a request, a CTA attends the best block it ranked itself. The CTA of
// a rank handed on then owns a selected block of its own with odds of about 16 / P, and attends
// both one after another; with fewer CTAs that costs more than every holder's round trip through
// its rank's word (H100, bench/RESULTS_CUDA.md: keeping won at P = 264 and 347, lost at 88 and
// below).
constexpr int kKeepBestCtas = 128;
constexpr int smem_bytes(bool fused) { return kStages * kPageBytes + (fused ? kQBytes : 0); }
using attnrt_cuda_common::raise_smem_limit;
using attnrt_cuda_common::set_attribute_once;
using attnrt_cuda_common::smem_u32;
using attnrt_cuda_common::bar_expect_tx;
using attnrt_cuda_common::bar_init;
using attnrt_cuda_common::bar_init_fence;
using attnrt_cuda_common::bar_wait;
using attnrt_cuda_common::bulk_load;
using attnrt_cuda_common::grid_launch_dependents;
using attnrt_cuda_common::Mma;

// The request's counters (index_decode.h): 64-bit, so they only ever grow.
__device__ __forceinline__ void red_release_add(uint64_t* p, uint64_t v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t atom_add(uint64_t* p, uint64_t v) {
  return atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}
__device__ __forceinline__ void red_max(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t atom_cas(uint64_t* p, uint64_t expected, uint64_t v) {
  return atomicCAS(reinterpret_cast<unsigned long long*>(p),
                   static_cast<unsigned long long>(expected), static_cast<unsigned long long>(v));
}
__device__ __forceinline__ uint64_t ld_relaxed(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// This launch's mode (index_decode.h), by thread 0 of a CTA once it has arrived: `seen` is the
// mode word as read while it scored (the last to start then finds its own declaration, or a
// peer's earlier claim). A stale word is polled together with the arrivals: once every CTA has
// arrived, the last to start has declared (before its arrival), so the next read decides. If the
// launch is still undecided after kLeaveAfterNs, the first CTA to claim it makes it solo.
__device__ __forceinline__ uint64_t launch_mode(uint64_t* word, const uint64_t* arrivals,
                                                uint64_t seen, uint64_t tag) {
  if ((seen >> 2) >= tag) return seen & 3u;
  const uint64_t t0 = attnrt_cuda_common::globaltimer_ns();
  for (;;) {
    const uint64_t now = ld_relaxed(word), arrived = ld_acquire(arrivals);  // both in flight
    if ((now >> 2) >= tag) return now & 3u;
    if (arrived >= tag) continue;
    if (attnrt_cuda_common::globaltimer_ns() - t0 >= kLeaveAfterNs) {
      // Only this launch's CTAs write this tag, and the launches before it have ended: a failed
      // claim returns this launch's mode.
      const uint64_t was = atom_cas(word, now, tag << 2 | kModeSolo);
      return was == now ? kModeSolo : (was & 3u);
    }
    __nanosleep(64);
  }
}

// One CTA of the launch writes the wait record (index_decode.h).
__device__ unsigned g_wait_record_claimed;

// Requests that ran solo, over every launch (index_decode_solo_requests()): [0] the indexer
// alone, [1] fused.
__device__ unsigned long long g_solo_requests[2];

// A wait for the request's peers outlasted the watchdog (a bug: peers that have all started
// arrive within milliseconds). The first CTA to get here records where (which wait, the target,
// the request's counters and words) in host memory; every such CTA then traps, so the launch
// fails with an error instead of spinning forever.
__device__ __noinline__ void give_up_wait(WaitRecord* rec, int32_t wait, int b, int part, int rank,
                                          uint64_t target, const uint64_t* sync) {
  if (rec != nullptr && atomicCAS(&g_wait_record_claimed, 0u, 1u) == 0u) {
    volatile WaitRecord* v = rec;
    v->wait = wait;
    v->request = b;
    v->cta = part;
    v->rank = rank;
    v->target = target;
    for (int i = 0; i < kSyncWords; ++i) v->sync[i] = ld_acquire(sync + i);
    __threadfence_system();
    v->ready = 1u;
    __threadfence_system();
  } else if (rec != nullptr) {  // the trap would end the launch before the record is written
    const uint64_t t0 = attnrt_cuda_common::globaltimer_ns();
    while (static_cast<volatile WaitRecord*>(rec)->ready == 0u &&
           attnrt_cuda_common::globaltimer_ns() - t0 < 1000000)
      __nanosleep(1000);
  }
  __trap();
}

// Dot product of 8 16-bit values with 8 floats.
template <typename T>
__device__ __forceinline__ float dot8(uint4 v, const float* q) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = Mma<T>::unpack(w[i]);
    acc = fmaf(f.x, q[2 * i], acc);
    acc = fmaf(f.y, q[2 * i + 1], acc);
  }
  return acc;
}

// Fused: which selected blocks CTA `part` of the request attends (P = stride: ctas_per_request,
// or 1 when one CTA attends them all):
// - own_first (>= 0 with P >= kKeepBestCtas): the best block it ranked, loaded at once;
// - the ranks part, part + P, ... that their rankers did not keep: its own, the rank itself when
//   every block is taken, else the block published in the request's word of that rank (once its
//   tag is this launch's; "taken" words are skipped).
// It runs one online softmax over them, one block at a time through the stages (the later ones
// prefetched into L2 as soon as they are known), and writes its partial to the slot of its first
// rank; its other slots get lse = -inf (no mass; their o is never read). Every thread calls it,
// with q's copy into sQ issued. Returns how many ranks the CTA attends (s_sel_rank), maybe 0.
template <typename T>
__device__ __forceinline__ int attend_selected(const SparseDecodeArgs& a, int b, int part,
                                               int stride, int keff, bool all_taken,
                                               int own_first, int kv,
                                               const int32_t* pages, const uint64_t* published,
                                               uint32_t tag, unsigned char* stages, const T* sQ,
                                               const int* s_mine, int* s_help, int* s_sel_block,
                                               int* s_sel_rank, int& s_nsel,
                                               PartialShared& s_part) {
  using namespace attnrt_cuda_common;
  const int tid = threadIdx.x;
  T* sK = reinterpret_cast<T*>(stages);
  T* sV = sK + kBlock * kHeadDim;
  const T* kc = static_cast<const T*>(a.att.kc);
  const T* vc = static_cast<const T*>(a.att.vc);
  auto load = [&](int c) {
    load_block_kv(sK, sV, kc, vc, static_cast<int64_t>(pages[c]), a.att.k_s0, a.att.k_s1,
                  a.att.v_s0, a.att.v_s1, min(kBlock, kv - c * kBlock));
  };
  if (own_first >= 0) load(s_mine[own_first]);  // before any wait for a published word
  const int nhelp = part < keff ? (keff - part + stride - 1) / stride : 0;
  if (tid < nhelp) {
    const int r = part + tid * stride;
    int c = all_taken ? r : s_mine[r];
    if (r == own_first) {
      c = -1;  // listed first
    } else if (c < 0) {
      uint64_t w;
      attnrt_cuda_common::SpinWatch watch;
      while (static_cast<uint32_t>((w = ld_acquire(published + r)) >> 32) != tag) {
        __nanosleep(20);
        if (watch.expired())
          give_up_wait(a.wait_record, kWaitRankWord, b, part, r, tag, published - kRankWords);
      }
      c = static_cast<int>(static_cast<uint32_t>(w));  // -1: its ranker attends it
    }
    s_help[tid] = c;
  }
  __syncthreads();
  if (tid == 0) {
    int n = 0;
    if (own_first >= 0) {
      s_sel_rank[n] = own_first;
      s_sel_block[n++] = s_mine[own_first];
    }
    for (int i = 0; i < nhelp; ++i)
      if (s_help[i] >= 0) {
        s_sel_rank[n] = part + i * stride;
        s_sel_block[n++] = s_help[i];
      }
    s_nsel = n;
  }
  __syncthreads();
  const int nsel = s_nsel;
  if (nsel == 0) {
    cp_wait<0>();  // q's copy
    return 0;
  }
  if (own_first < 0) load(s_sel_block[0]);
  static_assert(kThreads == kBlock, "a thread prefetches one key row of each later block");
  for (int i = 1; i < nsel; ++i) {
    const int c = s_sel_block[i];
    if (c * kBlock + tid < kv) {
      const int64_t page = pages[c];
      bulk_prefetch_l2(kc + page * a.att.k_s0 + tid * a.att.k_s1, kHeadDim * sizeof(T));
      bulk_prefetch_l2(vc + page * a.att.v_s0 + tid * a.att.v_s1, kHeadDim * sizeof(T));
    }
  }
  DecodeWarpState st;
  st.reset();
  for (int i = 0; i < nsel; ++i) {
    cp_wait<0>();  // block i (and q)
    __syncthreads();
    if (i == 0) ATTNRT_PHASE(sm90_sparse_decode, 6);
    const int j0 = s_sel_block[i] * kBlock;
    attend_block(st, sQ, sK, sV, j0, min(j0 + kBlock, kv), a.scale_log2);
    __syncthreads();  // K and V read: the next block's copy, or cta_partial's scratch, overlays them
    if (i + 1 < nsel) load(s_sel_block[i + 1]);
  }
  ATTNRT_PHASE(sm90_sparse_decode, 7);
  const int64_t slots = static_cast<int64_t>(b) * kTopK;
  const int64_t first = (slots + s_sel_rank[0]) * kHeads;
  cta_partial(st, reinterpret_cast<float*>(stages), s_part, a.part_o + first * kHeadDim,
              a.part_lse + first);
  for (int i = tid; i < (nsel - 1) * kHeads; i += kThreads)
    a.part_lse[(slots + s_sel_rank[1 + i / kHeads]) * kHeads + i % kHeads] = -INFINITY;
  return nsel;
}

// Fused, a CTA that holds slots, once every CTA of the request has written its partial: heads h
// with h % keff among the ranks of its slots (head = rank when keff is 16), so that the request's
// slot holders split the 16 heads. Thread tid takes dim tid of a head: out and lse from the keff
// slots' partials weighed by their lse, the sink folded in. kPass heads a pass, every slot's lse
// and o loaded together: one round of L2 loads a pass. One head a pass measured 0.5-1.1 us
// faster a step than two (H100, 1 x 64k to 64 x 64k): at batch 1 a holder merges one head, and
// two a pass loaded it twice.
template <typename T>
__device__ __forceinline__ void merge_heads(const SparseDecodeArgs& a, int b, int keff,
                                            const int* ranks, int nranks, int* s_heads,
                                            int& s_nheads) {
  using attnrt_cuda_common::fold_sink;
  using attnrt_cuda_common::natural_lse;
  const int tid = threadIdx.x;
  static_assert(kThreads == kHeadDim, "a thread per dim");
  if (tid < 32) {
    bool mine = false;
    if (tid < kHeads)
      for (int i = 0; i < nranks; ++i) mine = mine || ranks[i] == tid % keff;
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (mine) s_heads[__popc(ballot & ((1u << tid) - 1u))] = tid;
    if (tid == 0) s_nheads = __popc(ballot);
  }
  __syncthreads();
  const int nh = s_nheads;
  const int64_t base = static_cast<int64_t>(b) * kTopK * kHeads;  // slot 0, head 0
  constexpr int kPass = 1;
  for (int i0 = 0; i0 < nh; i0 += kPass) {
    int h[kPass];
    float w[kPass][kTopK], v[kPass][kTopK];
#pragma unroll
    for (int u = 0; u < kPass; ++u) {
      h[u] = s_heads[min(i0 + u, nh - 1)];  // past nh: the last head again, not stored
#pragma unroll
      for (int r = 0; r < kTopK; ++r) {
        const int64_t slot = base + r * kHeads + h[u];
        w[u][r] = r < keff ? __ldcg(a.part_lse + slot) : -INFINITY;
        v[u][r] = r < keff ? __ldcg(a.part_o + slot * kHeadDim + tid) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kPass; ++u) {
      if (i0 + u >= nh) break;
      float M = -INFINITY;
#pragma unroll
      for (int r = 0; r < kTopK; ++r) M = fmaxf(M, w[u][r]);
      float L = 0.f, acc = 0.f;
#pragma unroll
      for (int r = 0; r < kTopK; ++r) {
        // A slot with no mass (lse -inf) adds nothing: its o is not a partial.
        const float e = w[u][r] == -INFINITY ? 0.f : exp2f(w[u][r] - M);
        L += e;
        acc = e == 0.f ? acc : fmaf(e, v[u][r], acc);
      }
      float cf = 1.f;
      if (a.att.sink != nullptr) cf = fold_sink(M, L, a.att.sink[h[u]]);
      const float o = L > 0.f ? acc * cf / L : 0.f;
#ifdef ATTNRT_PHASE_TRACE
      if (i0 == 0 && u == 0) {
        asm volatile("" ::"f"(o));  // the stamp after every load o needs has returned
        ATTNRT_PHASE(sm90_sparse_decode, 10);
      }
#endif
      T* dst = static_cast<T*>(a.att.out) + static_cast<int64_t>(b) * a.att.o_s0 + h[u] * a.att.o_s1;
      dst[tid] = Mma<T>::from_float(o);
      if (tid == 0 && a.att.lse != nullptr)
        a.att.lse[static_cast<int64_t>(b) * a.att.lse_s0 + h[u]] = natural_lse(M, L);
    }
  }
}

// A request's topk, slot k holding the block of rank k (k < keff), put in ascending id order by
// one warp: slot_id() loads lane's id (INT_MAX past keff), put_in_id_order() writes it where it
// belongs, at how many selected ids are smaller.
__device__ __forceinline__ int slot_id(const int32_t* out, int64_t t_s2, int keff, int lane) {
  return lane < keff ? __ldcg(out + lane * t_s2) : INT_MAX;
}
__device__ __forceinline__ void put_in_id_order(int32_t* out, int64_t t_s2, int keff, int lane,
                                                int id) {
  int at = 0;
#pragma unroll
  for (int k = 0; k < kTopK; ++k) at += __shfl_sync(0xffffffffu, id, k) < id;
  __syncwarp();
  if (lane < keff) out[at * t_s2] = id;
}

// Phase stamps of whichever kernel this is (profiling builds only).
#define INDEX_PHASE(k)                                          \
  do {                                                          \
    if constexpr (kFused) ATTNRT_PHASE(sm90_sparse_decode, k);  \
    else ATTNRT_PHASE(sm90_index_decode, k);                    \
  } while (0)

template <typename T, bool kFused>
__global__ void __launch_bounds__(kThreads, kFused ? 3 : 1) index_decode_kernel(SparseDecodeArgs a) {
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ __align__(8) uint64_t bars[kStages];
  __shared__ float red[2][kThreads / 32];
  __shared__ int s_last;
  // Fused: the blocks this CTA ranked, by rank (-1: another CTA's); the blocks of the ranks it
  // may take for their rankers; the ranks it attends and their blocks.
  __shared__ int s_mine[kTopK], s_help[kTopK], s_sel_block[kTopK], s_sel_rank[kTopK], s_nsel;
  __shared__ uint32_t s_tag;  // fused: this launch's tag of the published ranks
  __shared__ bool s_last_to_start;  // fused: the CTA that would attend alone in solo mode
  __shared__ int s_heads[kHeads], s_nheads;  // fused: the heads this CTA merges
  __shared__ PartialShared s_part;
  __shared__ int s_gate;  // kShared, kAlone (solo, this CTA does the work) or kLeave
  enum { kShared, kAlone, kLeave };

  INDEX_PHASE(0);
  if constexpr (!kFused)
    grid_launch_dependents();  // the attend's CTAs may start (and load q) while this one runs
  const int b = blockIdx.x / a.ctas_per_request;
  const int part = blockIdx.x % a.ctas_per_request;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kv = a.kv_len[b];
  const int nblk = (kv + kBlock - 1) / kBlock;
  const int c0 = part * a.blocks_per_cta;
  const int c1 = min(c0 + a.blocks_per_cta, nblk);
  const int32_t* pages = a.page_ids + a.page_indptr[b];
  // The request's counters [arrivals, CTAs done, launches] only grow: every CTA adds 1 to each
  // in every launch, and a plan's launches run one after another, so the count this launch
  // reaches (thread 0 holds it) follows from the launches before it; no reset at the end.
  uint64_t* sync = a.sync + kSyncWords * b;
  uint64_t target = 0;
  // Thread 0: whether this CTA is the request's last to start; the mode word as read while
  // scoring (index_decode.h).
  bool last_to_start = false;
  uint64_t mode_seen = 0;
  const T* kc = static_cast<const T*>(a.kc);
  T* sQ = reinterpret_cast<T*>(stages + kStages * kPageBytes);  // fused: the attention's q
  if constexpr (kFused) {
    if (tid < kTopK) s_mine[tid] = -1;
  }

  // Thread 0 issues the copies; it reads each page id one block ahead of its copy, so it never
  // waits on one.
  auto issue = [&](int s, int64_t page) {
    bar_expect_tx(&bars[s], kPageBytes);
    bulk_load(stages + s * kPageBytes, kc + page * a.k_s0, kPageBytes, &bars[s]);
  };
  int64_t next_page = 0;  // thread 0: the page of the next block to issue
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) bar_init(&bars[s], 1);
    bar_init_fence();
    int64_t first[kStages];
    for (int s = 0; s < kStages; ++s) first[s] = c0 + s < c1 ? pages[c0 + s] : 0;
    if (c0 + kStages < c1) next_page = pages[c0 + kStages];
    for (int s = 0; s < kStages && c0 + s < c1; ++s) issue(s, first[s]);
    INDEX_PHASE(1);  // after the page ids' loads: how long the cold reads before the stream took
    // The launch count: its round trip goes after the copies. The last CTA to start declares
    // the launch shared, without waiting for the answer: whether a peer made it solo first is
    // read with the first page, like every CTA's (its own write is then seen).
    const uint64_t ctas = static_cast<uint64_t>(a.ctas_per_request);
    const uint64_t started = atom_add(&sync[2], 1);
    target = (started / ctas + 1) * ctas;
    last_to_start = ctas > 1 && started + 1 == target;
    if constexpr (kFused) {
      s_tag = static_cast<uint32_t>(target);
      s_last_to_start = last_to_start;
    }
    if (last_to_start)
      red_max(&sync[kModeWord], target << 2 | (a.force_solo ? kModeSolo : kModeShared));
  }
  __syncthreads();
  // Fused: after the first index pages (the critical path), CTAs that may attend load q (the last
  // to start attends every block in solo mode).
  if (kFused && (c0 < c1 || part < min(kTopK, nblk) || s_last_to_start))
    load_q(sQ, static_cast<const T*>(a.att.q) + static_cast<int64_t>(b) * a.att.q_s0, a.att.q_s1);

  // This thread's 16 query dims: [8*sub, 8*sub+8) and [64+8*sub, 64+8*sub+8).
  const int sub = tid & 7;
  float q[16];
  {
    const uint4* qrow = reinterpret_cast<const uint4*>(static_cast<const T*>(a.q) +
                                                       static_cast<int64_t>(b) * a.q_s0);
    const uint4 lo = qrow[sub], hi = qrow[8 + sub];
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = Mma<T>::unpack(w[i]);
      q[2 * i] = f.x;
      q[2 * i + 1] = f.y;
    }
  }

  for (int c = c0; c < c1; ++c) {
    const int i = c - c0, s = i % kStages;
    bar_wait(&bars[s], (i / kStages) & 1);
    if (i == 0) INDEX_PHASE(2);
    if (i == 0 && tid == 0 && a.ctas_per_request > 1)
      mode_seen = ld_relaxed(&sync[kModeWord]);  // used after the scoring: no wait here
    const unsigned char* page = stages + s * kPageBytes;
    float m = -INFINITY;
#pragma unroll 4
    for (int it = 0; it < kBlock / 16; ++it) {
      const int tok = it * 16 + (tid >> 3);
      const uint4* row = reinterpret_cast<const uint4*>(page + tok * kDim * 2);
      float d = dot8<T>(row[sub], q) + dot8<T>(row[8 + sub], q + 8);
      d += __shfl_xor_sync(0xffffffffu, d, 1);
      d += __shfl_xor_sync(0xffffffffu, d, 2);
      d += __shfl_xor_sync(0xffffffffu, d, 4);
      if (c * kBlock + tok < kv) m = fmaxf(m, d);
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
    if (lane == 0) red[i & 1][warp] = m;
    __syncthreads();  // stage s fully read, red[i & 1] complete
    if (tid == 0) {
      if (c + kStages < c1) {
        issue(s, next_page);
        if (c + kStages + 1 < c1) next_page = pages[c + kStages + 1];
      }
      float bm = red[i & 1][0];
#pragma unroll
      for (int w = 1; w < kThreads / 32; ++w) bm = fmaxf(bm, red[i & 1][w]);
      a.scores[static_cast<int64_t>(b) * a.block_capacity + c] = bm * a.scale;
    }
  }

  INDEX_PHASE(3);
  // Arrived (thread 0 wrote this CTA's block scores), in every mode: a solo launch's last CTA
  // waits for the same arrivals. Then the gate: shared mode, or solo (this CTA alone goes on, or
  // it leaves). Arriving first keeps a CTA that polls the mode word off the barrier's critical
  // path. The indexer alone waits for no peer when every block is taken: it passes as shared.
  if (tid == 0) {
    red_release_add(&sync[0], 1);
    int g = kShared;
    if (a.ctas_per_request > 1 && (kFused || nblk > kTopK)) {
      const uint64_t mode =
          launch_mode(&sync[kModeWord], &sync[0], c0 < c1 ? mode_seen : 0, target);
      if (mode == kModeSolo) g = last_to_start ? kAlone : kLeave;
      if (g == kAlone) atomicAdd(&g_solo_requests[kFused ? 1 : 0], 1ull);
    }
    s_gate = g;
  }
  __syncthreads();
  if (s_gate == kLeave) {  // arrived, counted done
    if constexpr (kFused) attnrt_cuda_common::cp_wait<0>();  // q's copy, if issued
    if (tid == 0) red_release_add(&sync[1], 1);
    return;
  }
  const bool solo = s_gate == kAlone;
  // Solo: this CTA ranks (and attends) every block of the request.
  const int rank_c0 = solo ? 0 : c0;

  // Selection. Every block is taken when there are at most 16: no CTA waits for another.
  const int nvis = nblk;  // decode: the query sits at kv_len - 1
  const int rank_c1 = solo ? nvis : c1;
  const int keff = min(kTopK, nvis);
  int32_t* out = a.topk + static_cast<int64_t>(b) * a.t_s1;
  if (part == 0 || solo)
    for (int k = keff + tid; k < kTopK; k += kThreads) out[k * a.t_s2] = -1;
  if (nvis <= kTopK) {
    for (int c = rank_c0 + tid; c < rank_c1; c += kThreads) {
      out[c * a.t_s2] = c;
      if constexpr (kFused) s_mine[c] = c;  // rank = id
    }
    if constexpr (!kFused) {
      if (tid == 0) red_release_add(&sync[1], 1);
      return;
    }
  } else {
    // Otherwise the request's CTAs meet at a barrier (all have started: the gate), each ranks
    // its own blocks against all of the request's block scores and writes every block
    // of rank < 16 to slot `rank`; the last CTA to finish that puts the 16 slots in id order.
    // The serial part is a few memory round trips, not a select over every block in one CTA.
    if (tid == 0) {
      // Arrived with release semantics (this CTA's scores go first); poll with acquire (the
      // peers' scores come after) until every CTA of the request has arrived: one memory round
      // trip after the last arrival, no generation to flip. Polled gently: up to a few hundred
      // threads of the grid spin while others still stream.
      attnrt_cuda_common::SpinWatch watch;
      while (ld_acquire(&sync[0]) < target) {
        __nanosleep(20);
        if (watch.expired()) give_up_wait(a.wait_record, kWaitArrivals, b, part, -1, target, sync);
      }
    }
    __syncthreads();
    INDEX_PHASE(4);
    uint32_t* keys = reinterpret_cast<uint32_t*>(stages);  // every bulk copy has completed
    const float* src = a.scores + static_cast<int64_t>(b) * a.block_capacity;
    const int init_b = a.init_blocks, local_from = nvis - a.local_blocks;
    const int padded = (nvis + 255) & ~255;  // key 0 is below every real key: padding never ranks
    for (int c = tid; c < padded; c += kThreads)
      keys[c] = c < nvis
                    ? attnrt_cuda_common::block_score_key(__ldcg(src + c), c, init_b, local_from)
                    : 0u;
    __syncthreads();
    // rank(c) = how many blocks precede c in the order (key descending, then id ascending); one
    // warp per block, 256 rivals a step (8 a lane: the step is a latency chain, so wide), stopping
    // once 16 precede it.
    for (int c = rank_c0 + warp; c < rank_c1; c += kThreads / 32) {
      const uint32_t kc = keys[c];
      int rank = 0;
      for (int r0 = 0; r0 < nvis && rank < keff; r0 += 256) {
        const int r = r0 + 4 * lane;
        const uint4 k4[2] = {*reinterpret_cast<const uint4*>(keys + r),
                             *reinterpret_cast<const uint4*>(keys + r + 128)};
        int before = 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int rh = r + 128 * h;
          before += (k4[h].x > kc || (k4[h].x == kc && rh < c)) +
                    (k4[h].y > kc || (k4[h].y == kc && rh + 1 < c)) +
                    (k4[h].z > kc || (k4[h].z == kc && rh + 2 < c)) +
                    (k4[h].w > kc || (k4[h].w == kc && rh + 3 < c));
        }
        rank += static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(before)));
      }
      if (rank < keff && lane == 0) {
        out[rank * a.t_s2] = c;
        if constexpr (kFused) {
          s_mine[rank] = c;
        } else {
          __threadfence();  // before this CTA counts itself done
        }
      }
    }
  }  // nvis > kTopK
  __syncthreads();
  INDEX_PHASE(5);
  if constexpr (kFused) {
    // With kKeepBestCtas or more CTAs a request, a CTA keeps the best block it ranked
    // (own_first); every other block it ranked goes to the CTA of its rank (rank % P), through
    // the request's word of that rank, tagged with the launch ("taken", -1, for own_first).
    // Every warp finds own_first.
    const bool all_taken = nvis <= kTopK;
    const bool self_first = !solo && a.ctas_per_request >= kKeepBestCtas && !all_taken;
    const unsigned owned = __ballot_sync(0xffffffffu, lane < kTopK && s_mine[lane] >= 0);
    const int own_first = self_first && owned != 0u ? __ffs(owned) - 1 : -1;
    if (!solo && !all_taken && warp == 0 && lane < kTopK && s_mine[lane] >= 0) {
      const uint32_t c = lane == own_first ? 0xffffffffu : static_cast<uint32_t>(s_mine[lane]);
      st_relaxed(&sync[kRankWords + lane], (static_cast<uint64_t>(s_tag) << 32) | c);
    }
    if (!solo && part >= keff && own_first < 0) {  // attends nothing; its ranks are published
      attnrt_cuda_common::cp_wait<0>();  // q's copy, if issued
      if (tid == 0) red_release_add(&sync[1], 1);
      return;
    }
    const int nsel = attend_selected<T>(a, b, solo ? 0 : part, solo ? 1 : a.ctas_per_request,
                                        keff, all_taken, own_first, kv, pages,
                                        sync + kRankWords, s_tag, stages, sQ, s_mine, s_help,
                                        s_sel_block, s_sel_rank, s_nsel, s_part);
    INDEX_PHASE(8);
    // Count this CTA done once its slots' lse and partial are written: the barrier orders every
    // thread's stores before thread 0's release (the pattern of a split-K semaphore); the slot
    // holders' acquire makes them visible to them.
    __syncthreads();
    if (tid == 0) red_release_add(&sync[1], 1);
    if (nsel == 0) return;  // its rank's ranker attends it
    // A slot holder waits for every CTA of the request (all started: the gate), then merges its
    // share of the heads: the merge is spread over up to 16 CTAs instead of 16 heads' loads in
    // one. Solo, this CTA holds every partial.
    if (tid == 0 && s_gate != kAlone) {  // s_gate, not solo: one register less in the attend
      attnrt_cuda_common::SpinWatch watch;
      while (ld_acquire(&sync[1]) < target) {
        __nanosleep(20);
        if (watch.expired()) give_up_wait(a.wait_record, kWaitDone, b, part, -1, target, sync);
      }
    }
    __syncthreads();
    INDEX_PHASE(9);
    // Rank 0's holder puts topk in id order; its ids load along with the merge's loads.
    const bool sorter = s_sel_rank[0] == 0 && warp == 0;
    const int id = sorter ? slot_id(out, a.t_s2, keff, lane) : INT_MAX;
    merge_heads<T>(a, b, keff, s_sel_rank, nsel, s_heads, s_nheads);
    if (sorter) put_in_id_order(out, a.t_s2, keff, lane, id);
    INDEX_PHASE(11);
  } else {
    if (tid == 0) {
      __threadfence();
      s_last = atom_add(&sync[1], 1) + 1 == target || solo;
    }
    __syncthreads();
    if (!s_last || warp != 0) return;
    __threadfence();
    put_in_id_order(out, a.t_s2, keff, lane, slot_id(out, a.t_s2, keff, lane));
    INDEX_PHASE(6);
  }
}

// All of shared memory as such (no L1 carve-out; the kernel reads through bulk copies): the SMs
// are then configured so that the attend, launched as a programmatic dependent, fits beside the
// indexer's CTAs and loads its queries while the scoring runs; fused, so that the resident count
// index_decode_resident_ctas() reports holds.
template <typename T, bool kFused>
cudaError_t set_attributes() {
  constexpr auto kernel = index_decode_kernel<T, kFused>;
  if (cudaError_t e = raise_smem_limit<kernel>(smem_bytes(kFused)); e != cudaSuccess) return e;
  return set_attribute_once<kernel, cudaFuncAttributePreferredSharedMemoryCarveout>(
      cudaSharedmemCarveoutMaxShared);
}

template <typename T, bool kFused>
cudaError_t launch_t(const SparseDecodeArgs& a, cudaStream_t st) {
  constexpr auto kernel = index_decode_kernel<T, kFused>;
  const int smem = smem_bytes(kFused);
  if (cudaError_t e = set_attributes<T, kFused>(); e != cudaSuccess) return e;
  const int64_t grid = static_cast<int64_t>(a.n) * a.ctas_per_request;
  if (grid <= 0) return cudaSuccess;
  // Not cooperative: a request's CTAs wait for each other only once all have started (the
  // gate), so they need no guarantee to be resident together.
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = st;
  return cudaLaunchKernelEx(&cfg, kernel, a);
}

template <bool kFused>
int resident_ctas(int sms, int* ctas) {
  constexpr auto kernel = index_decode_kernel<__nv_bfloat16, kFused>;  // f16: same resources
  const int smem = smem_bytes(kFused);
  if (cudaError_t e = set_attributes<__nv_bfloat16, kFused>(); e != cudaSuccess) return e;
  int per_sm = 0;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
      e != cudaSuccess)
    return e;
  *ctas = per_sm * sms;
  return cudaSuccess;
}

}  // namespace

int index_decode_solo_requests(bool fused, uint64_t* count) {
  unsigned long long n = 0;
  const size_t at = fused ? sizeof n : 0;
  const cudaError_t e = cudaMemcpyFromSymbol(&n, g_solo_requests, sizeof n, at);
  *count = n;
  return e;
}

int index_decode_load_kernels() {
  using attnrt_cuda_common::load_kernels;
  using B = __nv_bfloat16;
  cudaError_t e = load_kernels<index_decode_kernel<B, false>, index_decode_kernel<B, true>,
                               index_decode_kernel<__half, false>, index_decode_kernel<__half, true>>();
  if (e == cudaSuccess) e = set_attributes<B, false>();
  if (e == cudaSuccess) e = set_attributes<B, true>();
  if (e == cudaSuccess) e = set_attributes<__half, false>();
  if (e == cudaSuccess) e = set_attributes<__half, true>();
  return e;
}

int index_decode_resident_ctas(int sms, bool fused, int* ctas) {
  return fused ? resident_ctas<true>(sms, ctas) : resident_ctas<false>(sms, ctas);
}

int launch_index_decode(const IndexDecodeArgs& a, int dtype, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  SparseDecodeArgs f{};
  static_cast<IndexDecodeArgs&>(f) = a;
  return dtype == ATTNRT_BF16 ? launch_t<__nv_bfloat16, false>(f, st)
                              : launch_t<__half, false>(f, st);
}

int launch_sparse_decode(const SparseDecodeArgs& a, int dtype, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dtype == ATTNRT_BF16 ? launch_t<__nv_bfloat16, true>(a, st)
                              : launch_t<__half, true>(a, st);
}

}  // namespace attnrt_cuda_sm90
