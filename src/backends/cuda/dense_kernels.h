// CUDA dense ops (dense_extend, dense_decode) of the CUDA plugin: tensor-core flash attention
// (f32 accumulation) over the paged KV cache with cp.async double-buffered K/V tiles; mma.sync
// m16n8k16 kernels for sm_80+ (dense_mma.cu) and, on sm_90, a wgmma extend kernel for head_dim
// 128 (dense_wgmma.cu).
//
// cuda_plugin.cu calls only the functions below. A dense plan starts with its attnrt_problem
// (like the sparse plan), so the plugin dispatches run/update/destroy on plan->op.
// Errors are written into (err, cap); the caller's last_error returns them.
#pragma once

#include <attnrt/plugin.h>

#include <cstddef>
#include <cstdint>

namespace attnrt_cuda_dense {

inline bool is_dense_op(int32_t op) {
  return op == ATTNRT_OP_DENSE_EXTEND || op == ATTNRT_OP_DENSE_DECODE;
}

// Loads every dense kernel on the current device (`wgmma`: the Hopper extend kernel too) and
// sets their attributes, once per device (cuda_common/kernel_attr.h); plan() needs it done.
// Returns a cudaError_t as int.
int load_kernels(bool wgmma);
// Builds a plan: extend -> query tiles (longest first), ordered in sections of KV heads that
// fit in L2 (`l2_bytes`); decode -> split count per request from the multiprocessor count and
// the lengths, metadata at fixed device addresses. `wgmma`: the device runs the Hopper extend
// kernel (compute capability 9.0; chosen once in init).
int32_t plan(const attnrt_problem* p, const attnrt_layout* layout, int sms, int64_t l2_bytes,
             bool wgmma, attnrt_plan* out, char* err, size_t cap);
// Decode: absorbs new kv_len / page ids for the same number of requests in place (same device
// addresses, same grid), so that a CUDA graph captured over run() replays with the new lengths.
// ATTNRT_UNAVAILABLE when the layout does not fit the plan (the host re-plans).
int32_t update(attnrt_plan plan, const attnrt_layout* layout, char* err, size_t cap);
// Launches the kernels on `stream`; no allocation, no synchronization.
int32_t run(attnrt_plan plan, const attnrt_tensors* t, void* stream, char* err, size_t cap);
void destroy(attnrt_plan plan);

}  // namespace attnrt_cuda_dense
