// attnrt CUDA backend plugin (libattnrt_cuda.so). Includes only the plugin C ABI.
//
// Contract notes:
//   * cudart is linked statically, so the library loads on machines without CUDA; init() returns
//     ATTNRT_UNAVAILABLE with the runtime's reason when no driver or no device is present.
//   * Device properties are read once in init(); probe/plan/run never query the capability.
//   * plan() copies all metadata to plan-owned device buffers and allocates the split-KV partials;
//     it loads every kernel of the plugin on its device (the first plan there). run() only
//     launches kernels on the caller's stream (no allocation, no synchronization, no code load).
//   * Dense kernels: tensor-core mma.sync flash attention with cp.async K/V tiles for sm_80+
//     (dense_mma.cu; extend: 128-row query tiles; decode: GQA group as the mma rows, split-KV
//     with an lse merge); on compute capability 9.0 dense_extend at head_dim 128 runs the wgmma
//     kernel (dense_wgmma.cu) instead. update_plan refreshes decode metadata in place for graph
//     replay.
#include <attnrt/plugin.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "cuda_common/device_runtime.h"
#include "dense_kernels.h"   // dense ops (dense_mma.cu)
#include "sparse_kernels.h"  // sparse ops (sparse_*.cu)

namespace {

thread_local char g_error[512] = "";

int32_t fail(int32_t status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
int32_t fail(int32_t status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(g_error, sizeof g_error, fmt, ap);
  va_end(ap);
  return status;
}

attnrt_cuda_common::DeviceRuntime g_rt("cuda");

// The wgmma extend kernel is built for sm_90a, so it runs on compute capability 9.0 only.
// ATTNRT_CUDA_WGMMA=0 keeps the mma.sync kernels there too (comparisons, tests); read in init.
bool g_wgmma_allowed = true;
bool uses_wgmma(const attnrt_cuda_common::DeviceInfo& d) {
  return g_wgmma_allowed && d.major == 9 && d.minor == 0;
}

int32_t check_device(attnrt_device d) { return g_rt.check(d, g_error, sizeof g_error); }

// ---------------------------------------------------------------------------------------------
// ABI entry points (every one catches everything)

int32_t p_init() {
  const char* w = std::getenv("ATTNRT_CUDA_WGMMA");
  g_wgmma_allowed = !(w != nullptr && std::strcmp(w, "0") == 0);
  return g_rt.init(g_error, sizeof g_error);
}

int32_t p_device_count(int32_t kind, int32_t* count) { return g_rt.device_count(kind, count); }

int32_t p_probe(const attnrt_problem* p) {
  if (int32_t s = check_device(p->device); s != ATTNRT_OK) return s;
  const attnrt_cuda_common::DeviceInfo& dev = g_rt.info(p->device.index);
  // The kernels are built as sm_80 and sm_90 code only (no PTX to compile for a newer major).
  if (dev.major < 8 || dev.major > 9)
    return fail(ATTNRT_UNAVAILABLE, "compute capability %d.%d (built for 8.x and 9.x)",
                dev.major, dev.minor);
  if (attnrt_cuda_sparse::is_sparse_op(p->op))
    return attnrt_cuda_sparse::probe(p, dev.major, g_error, sizeof g_error);
  if (p->op != ATTNRT_OP_DENSE_EXTEND && p->op != ATTNRT_OP_DENSE_DECODE)
    return fail(ATTNRT_UNAVAILABLE, "op %d not implemented on cuda (dense_extend, dense_decode only)",
                p->op);
  if (p->q_dtype != ATTNRT_BF16 && p->q_dtype != ATTNRT_F16)
    return fail(ATTNRT_UNAVAILABLE, "q dtype %d not supported on cuda (bf16, f16)", p->q_dtype);
  if (p->kv_dtype != p->q_dtype)
    return fail(ATTNRT_UNAVAILABLE, "kv dtype %d must equal q dtype %d on cuda", p->kv_dtype,
                p->q_dtype);
  if (p->head_dim != 64 && p->head_dim != 128 && p->head_dim != 256)
    return fail(ATTNRT_UNAVAILABLE, "head_dim %d not supported (64, 128, 256)", p->head_dim);
  if (p->num_kv_heads <= 0 || p->num_q_heads % p->num_kv_heads != 0)
    return fail(ATTNRT_UNAVAILABLE, "num_q_heads %d not a multiple of num_kv_heads %d",
                p->num_q_heads, p->num_kv_heads);
  if (p->page_size < 1) return fail(ATTNRT_UNAVAILABLE, "page_size %d < 1", p->page_size);
  return ATTNRT_OK;
}

// Loads every kernel of the plugin on the device (the first plan there; later ones read an
// atomic per kernel list), so that no run() loads code (cuda_common/kernel_attr.h).
int32_t load_kernels(int device, bool wgmma) {
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = static_cast<cudaError_t>(attnrt_cuda_dense::load_kernels(wgmma));
  if (e == cudaSuccess) e = static_cast<cudaError_t>(attnrt_cuda_sparse::index_load_kernels());
  if (e == cudaSuccess) e = static_cast<cudaError_t>(attnrt_cuda_sparse::attend_load_kernels());
  if (e == cudaSuccess) return ATTNRT_OK;
  return fail(ATTNRT_INTERNAL, "loading the kernels on cuda:%d: %s (%s)", device,
              cudaGetErrorName(e), cudaGetErrorString(e));
}

int32_t p_plan(const attnrt_problem* p, const attnrt_layout* L, attnrt_plan* out) {
  try {
    if (int32_t s = p_probe(p); s != ATTNRT_OK) return s;
    const attnrt_cuda_common::DeviceInfo& dev = g_rt.info(p->device.index);
    // The dense plan picks its extend kernel by `wgmma`, whose attributes the load has set.
    const bool wgmma = uses_wgmma(dev);
    if (int32_t s = load_kernels(p->device.index, wgmma); s != ATTNRT_OK) return s;
    if (attnrt_cuda_sparse::is_sparse_op(p->op))
      return attnrt_cuda_sparse::plan(p, L, dev.sms, out, g_error, sizeof g_error);
    return attnrt_cuda_dense::plan(p, L, dev.sms, dev.l2_bytes, wgmma, out, g_error,
                                   sizeof g_error);
  } catch (...) {
    return fail(ATTNRT_INTERNAL, "exception in cuda plan");
  }
}

int32_t p_run(attnrt_plan plan, const attnrt_tensors* t, void* stream) {
  try {
    if (!plan) return fail(ATTNRT_INVALID, "null plan");
    // Sparse and dense plans both start with their attnrt_problem.
    if (attnrt_cuda_sparse::is_sparse_op(reinterpret_cast<const attnrt_problem*>(plan)->op))
      return attnrt_cuda_sparse::run(plan, t, stream, g_error, sizeof g_error);
    const attnrt_problem& prob = *reinterpret_cast<const attnrt_problem*>(plan);
    const attnrt_tensor* inner[] = {&t->q, &t->out};
    for (const attnrt_tensor* x : inner)
      if (x->rank != 3 || x->strides[2] != 1)
        return fail(ATTNRT_INVALID, "q/out must be rank 3 with unit innermost stride");
    if (t->k_cache.rank != 4 || t->k_cache.strides[3] != 1 || t->v_cache.rank != 4 ||
        t->v_cache.strides[3] != 1)
      return fail(ATTNRT_INVALID, "k_cache/v_cache must be rank 4 with unit innermost stride");
    if (prob.write_lse && (!t->lse.data || t->lse.strides[1] != 1))
      return fail(ATTNRT_INVALID, "lse must be present with unit innermost stride");
    if (prob.has_sink && !t->sink.data) return fail(ATTNRT_INVALID, "sink missing");
    // Vector loads need each row 16-byte aligned: pointers and row strides multiples of 8 elements.
    const attnrt_tensor* rows[] = {&t->q, &t->out, &t->k_cache, &t->v_cache};
    for (const attnrt_tensor* x : rows) {
      bool ok = reinterpret_cast<uintptr_t>(x->data) % 16 == 0;
      for (int k = 0; k + 1 < x->rank; ++k) ok = ok && x->strides[k] % 8 == 0;
      if (!ok) return fail(ATTNRT_UNAVAILABLE, "cuda needs 16-byte aligned rows (strides multiple of 8)");
    }
    return attnrt_cuda_dense::run(plan, t, stream, g_error, sizeof g_error);
  } catch (...) {
    return fail(ATTNRT_INTERNAL, "exception in cuda run");
  }
}

void p_destroy_plan(attnrt_plan plan) {
  if (plan && attnrt_cuda_sparse::is_sparse_op(reinterpret_cast<const attnrt_problem*>(plan)->op))
    return attnrt_cuda_sparse::destroy(plan);
  attnrt_cuda_dense::destroy(plan);
}

int32_t p_update_plan(attnrt_plan plan, const attnrt_layout* layout) {
  try {
    if (!plan) return fail(ATTNRT_INVALID, "null plan");
    if (attnrt_cuda_sparse::is_sparse_op(reinterpret_cast<const attnrt_problem*>(plan)->op))
      return attnrt_cuda_sparse::update(plan, layout, g_error, sizeof g_error);
    return attnrt_cuda_dense::update(plan, layout, g_error, sizeof g_error);
  } catch (...) {
    return fail(ATTNRT_INTERNAL, "exception in cuda update_plan");
  }
}

const char* p_last_error() { return g_error; }

int32_t p_preferred_page_size(attnrt_device d, int32_t* ps) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  *ps = 64;
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
  return g_rt.to_host(d, dst, src, bytes, g_error, sizeof g_error);
}
int32_t p_synchronize(attnrt_device d) { return g_rt.synchronize(d, g_error, sizeof g_error); }
int32_t p_describe_device(attnrt_device d, char* buf, size_t cap) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  const attnrt_cuda_common::DeviceInfo& i = g_rt.info(d.index);
  std::snprintf(buf, cap, "%s, sm_%d%d, %d SMs, %s", i.name, i.major, i.minor, i.sms,
                uses_wgmma(i) ? "wgmma extend + mma.sync kernels" : "mma.sync kernels");
  return ATTNRT_OK;
}

const attnrt_plugin_v1 kTable = {
    ATTNRT_PLUGIN_ABI_VERSION,
    sizeof(attnrt_plugin_v1),
    "cuda",
    200,
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
    nullptr,  // degraded_runs: every run goes the way its plan chose
};

}  // namespace

extern "C" {
ATTNRT_PLUGIN_EXPORT extern const uint32_t attnrt_plugin_abi_version;
const uint32_t attnrt_plugin_abi_version = ATTNRT_PLUGIN_ABI_VERSION;
ATTNRT_PLUGIN_EXPORT const attnrt_plugin_v1* attnrt_plugin_get(void) { return &kTable; }
}
