// Fused MiniMax indexer for decode on Hopper (sm_90): the one kernel of the cuda_sm90 plugin.
// Production shape only: one index head, index_dim 128, block = page = 128 tokens, top-16,
// score max (sm90_plugin.cu's probe enforces it).
#pragma once

#include <cstdint>

#include "cuda_common/attend_tensors.h"

namespace attnrt_cuda_sm90 {

constexpr int kBlock = 128;     // tokens per block = per page
constexpr int kDim = 128;       // index_dim
constexpr int kTopK = 16;
constexpr int kMaxBlocks = 16384;  // per request (2M tokens): its block keys fit in smem

// What the decode and extend indexers both read and write (filled in one place by the plugin).
struct IndexArgsBase {
  const void* q;           // index_q [T, 1, 128]
  const void* kc;          // index_k_cache [pages, 128, 1, 128], each page contiguous
  int64_t q_s0, k_s0;      // element strides of a q row and of a page
  const int32_t* kv_len;   // [n]
  const int32_t* page_indptr;
  const int32_t* page_ids;
  float* scores;           // the plan's block scores
  int32_t* topk;           // [1, T, 16] with strides t_s1, t_s2
  int64_t t_s1, t_s2;
  int init_blocks, local_blocks;
  float scale;             // index_scale
};

// A request's words: counters [arrivals, CTAs done, launches], the launch's mode word, then
// (sparse_decode) the block of each rank < 16, published as (launch tag << 32) | block id
// (0xffffffff: its ranker keeps it).
//
// The request's CTAs need not be resident together (the launch is not cooperative). The mode
// word, (launch tag << 2) | mode, says how this launch runs: kModeShared once the request's last
// CTA to start has said so (every peer has then started, so peers may wait for each other: each
// waits only for work that started peers do without waiting); kModeSolo if a CTA found the
// launch undecided for kLeaveAfterNs after its arrival (peers may be unable to start: the GPU is
// shared) and claimed it first. Every CTA counts itself arrived once its block scores are
// written, whatever the mode. In solo mode every CTA then leaves except the last to start, which
// ranks and attends the request alone; it waits only for the arrivals of peers that have all
// started.
constexpr int kModeWord = 3;
constexpr uint64_t kModeShared = 1, kModeSolo = 2;
constexpr uint64_t kLeaveAfterNs = 50 * 1000;  // 50 us: every peer of a request starts in ~1 us
constexpr int kRankWords = 4;
constexpr int kSyncWords = kRankWords + kTopK;

// Where a wait for a request's peers gave up (cuda_common/spin_wait.cuh's watchdog): written
// once, by the first CTA whose wait expired, into host memory that the host reads after the
// launch failed.
struct WaitRecord {
  uint32_t ready;  // 1 once the fields below are written
  int32_t wait;    // kWaitArrivals, kWaitRankWord or kWaitDone
  int32_t request, cta, rank;  // rank: the published word waited for (kWaitRankWord)
  uint64_t target;             // the count (or word tag) waited for
  uint64_t sync[kSyncWords];   // the request's counters and words when it gave up
};
enum : int32_t { kWaitArrivals = 0, kWaitRankWord = 1, kWaitDone = 2 };

// Decode: T = n, scores [n, block_capacity].
struct IndexDecodeArgs : IndexArgsBase {
  uint64_t* sync;          // [n][kSyncWords] counters, zero before the plan's first launch
  WaitRecord* wait_record; // device address of host memory; null: give up without a record
  int n, block_capacity, blocks_per_cta, ctas_per_request;
  int force_solo;          // fault injection: the last CTA to start declares solo mode
};

// The whole sparse decode step (op sparse_decode): the indexer above, then the attention of the
// 16 query heads (attend_decode.h's shape) over the selected blocks, in the same launch. Each
// top-16 block is attended by one CTA of its request: the CTA that ranked it if it is that CTA's
// best (with 128 or more CTAs a request), else the CTA of its rank (rank % P), told through the
// request's word of that rank. A CTA writes one partial (normalised o, log2 lse) to the slot of
// its first rank, lse = -inf to its others; these slot holders merge the slots by lse into out
// and lse, a share of the heads each, and rank 0's holder sorts topk.
struct SparseDecodeArgs : IndexDecodeArgs {
  attnrt_cuda_common::AttendTensors att;  // q, caches, out, lse, sink of the attention
  float* part_o;    // [n][16 slots][16 heads][128]; a slot of lse -inf holds no o
  float* part_lse;  // [n][16 slots][16 heads], log2
  float scale_log2;  // sm_scale * log2(e)
};

// Launch on `stream`; return a cudaError_t as int. dtype: ATTNRT_BF16 or ATTNRT_F16.
int launch_index_decode(const IndexDecodeArgs& a, int dtype, void* stream);
int launch_sparse_decode(const SparseDecodeArgs& a, int dtype, void* stream);
// Loads both kernels (indexer alone, fused) of both dtypes on the current device and sets their
// attributes, once per device (cuda_common/kernel_attr.h). Returns a cudaError_t as int.
int index_decode_load_kernels();
// How many CTAs of the indexer (fused: with the attend) the device holds at once (`sms`
// multiprocessors): the plan sizes the grid to one such wave, in which a request's CTAs start
// together and share its work. Returns a cudaError_t as int.
int index_decode_resident_ctas(int sms, bool fused, int* ctas);
// Requests whose launch of the indexer (fused: sparse_decode) ran solo on the current device
// since the plugin was loaded; waits for the device's default stream. A free GPU runs none solo;
// a count that grows says another kernel kept the decode's CTAs from starting together.
// Returns a cudaError_t as int.
int index_decode_solo_requests(bool fused, uint64_t* count);

}  // namespace attnrt_cuda_sm90
