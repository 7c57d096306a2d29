// attnrt CUDA backend plugin (libattnrt_cuda.so). Includes only the plugin C ABI.
//
// Contract notes:
//   * cudart is linked statically, so the library loads on machines without CUDA; init() returns
//     ATTNRT_UNAVAILABLE with the runtime's reason when no driver or no device is present.
//   * Device properties are read once in init(); probe/plan/run never query the capability.
//   * plan() copies all metadata to plan-owned device buffers and allocates the split-KV partials;
//     run() only launches kernels on the caller's stream (no allocation, no synchronization).
//   * Kernel family: a SIMT flash-style kernel (one warp per query row and head, f32 online
//     softmax). Correct for sm_80+; tensor-core paths are future work (see RESULTS_CUDA.md).
#include <attnrt/plugin.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

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

int32_t cuda_fail(cudaError_t e, const char* what) {
  return fail(ATTNRT_INTERNAL, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

#define CK(call)                                             \
  do {                                                       \
    cudaError_t e_ = (call);                                 \
    if (e_ != cudaSuccess) return cuda_fail(e_, #call);      \
  } while (0)

struct DeviceInfo {
  int major = 0, minor = 0, sms = 0;
  char name[256] = "";
};

bool g_init_done = false;
int32_t g_init_status = ATTNRT_UNAVAILABLE;
char g_init_error[512] = "";
std::vector<DeviceInfo> g_devices;

constexpr int kWarp = 32;

// ---------------------------------------------------------------------------------------------
// Kernels

template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Loads NV contiguous elements (lane's slice) with one vector load (NV*2 bytes) into floats.
template <typename T, int NV>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&f)[NV]) {
  static_assert(NV == 2 || NV == 4 || NV == 8, "NV");
  using V = typename std::conditional<NV == 2, uint32_t,
            typename std::conditional<NV == 4, uint2, uint4>::type>::type;
  V v = *reinterpret_cast<const V*>(p);
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < NV; ++i) f[i] = to_f(e[i]);
}

struct Geometry {
  int hq, hkv, group, page_size;
  float scale_log2;  // sm_scale * log2(e)
  int64_t q_s0, q_s1, o_s0, o_s1, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, lse_s0;
};

// Online-softmax attention of one query row (vector qf, lane owns dims lane + 32*i) over keys
// [kb, ke) of request b (keys <= limit visible). Returns running max m (log2 domain), sum l, acc.
template <typename T, int NV>
__device__ void attend_range(const Geometry& g, const T* __restrict__ kc, const T* __restrict__ vc,
                             const int32_t* __restrict__ pages, int kvh, int kb, int ke,
                             const float (&qf)[NV], float& m, float& l, float (&acc)[NV]) {
  const int lane = threadIdx.x & 31;
  m = -INFINITY;
  l = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) acc[i] = 0.f;
  // Four keys per step: four independent dot products and shuffle reductions in flight hide
  // the reduction latency (the single-key loop below finishes the tail).
  int j = kb;
  for (; j + 4 <= ke; j += 4) {
    float s[4];
    const T* vp[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int jj = j + u;
      const int64_t page = pages[jj / g.page_size];
      const int row = jj % g.page_size;
      const T* kp = kc + page * g.k_s0 + row * g.k_s1 + kvh * g.k_s2;
      vp[u] = vc + page * g.v_s0 + row * g.v_s1 + kvh * g.v_s2;
      float kf[NV];
      load_vec<T, NV>(kp + lane * NV, kf);
      s[u] = 0.f;
#pragma unroll
      for (int i = 0; i < NV; ++i) s[u] += qf[i] * kf[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
      for (int u = 0; u < 4; ++u) s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
    }
    float mn = m;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      s[u] *= g.scale_log2;
      mn = fmaxf(mn, s[u]);
    }
    const float corr = exp2f(m - mn);
    float p[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) p[u] = exp2f(s[u] - mn);
    l = l * corr + ((p[0] + p[1]) + (p[2] + p[3]));
    float vf[4][NV];
#pragma unroll
    for (int u = 0; u < 4; ++u) load_vec<T, NV>(vp[u] + lane * NV, vf[u]);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      float a = acc[i] * corr;
#pragma unroll
      for (int u = 0; u < 4; ++u) a += p[u] * vf[u][i];
      acc[i] = a;
    }
    m = mn;
  }
  for (; j < ke; ++j) {
    const int64_t page = pages[j / g.page_size];
    const int row = j % g.page_size;
    const T* kp = kc + page * g.k_s0 + row * g.k_s1 + kvh * g.k_s2;
    const T* vp = vc + page * g.v_s0 + row * g.v_s1 + kvh * g.v_s2;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) s += qf[i] * to_f(kp[lane * NV + i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    s *= g.scale_log2;
    const float mn = fmaxf(m, s);
    const float corr = exp2f(m - mn);  // m == -inf -> 0
    const float p = exp2f(s - mn);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < NV; ++i) acc[i] = acc[i] * corr + p * to_f(vp[lane * NV + i]);
    m = mn;
  }
}

// Finalizes one row: folds in the sink logit (natural log, raw), writes out and lse.
template <typename T, int NV>
__device__ void finalize(const Geometry& g, float m2, float l, const float (&acc)[NV],
                         const float* __restrict__ sink, int h, T* __restrict__ orow,
                         float* __restrict__ lse_out) {
  const int lane = threadIdx.x & 31;
  constexpr float kLog2e = 1.4426950408889634f;
  if (sink != nullptr) {
    const float s2 = sink[h] * kLog2e;
    const float mn = fmaxf(m2, s2);
    l = l * exp2f(m2 - mn) + exp2f(s2 - mn);
    // acc is relative to m2; rescale to mn.
    const float c = exp2f(m2 - mn);
#pragma unroll
    for (int i = 0; i < NV; ++i) const_cast<float&>(acc[i]) *= c;
    m2 = mn;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) orow[lane * NV + i] = from_f<T>(acc[i] * inv);
  if (lse_out != nullptr && lane == 0)
    *lse_out = l > 0.f ? (m2 + log2f(l)) * 0.6931471805599453f : -INFINITY;
}

// Extend: one warp per (packed token t, q head h). Causal over the request's cache.
template <typename T, int NV>
__global__ void extend_kernel(Geometry g, const T* __restrict__ q, const T* __restrict__ kc,
                              const T* __restrict__ vc, T* __restrict__ out,
                              float* __restrict__ lse, const float* __restrict__ sink,
                              const int32_t* __restrict__ row_req, const int32_t* __restrict__ row_pos,
                              const int32_t* __restrict__ page_indptr,
                              const int32_t* __restrict__ page_ids, int total_rows) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  if (warp >= total_rows * g.hq) return;
  const int t = warp / g.hq, h = warp % g.hq;
  const int lane = threadIdx.x & 31;
  const int b = row_req[t];
  const int pos = row_pos[t];
  float qf[NV], acc[NV], m, l;
  const T* qrow = q + t * g.q_s0 + h * g.q_s1;
#pragma unroll
  for (int i = 0; i < NV; ++i) qf[i] = to_f(qrow[lane * NV + i]);
  attend_range<T, NV>(g, kc, vc, page_ids + page_indptr[b], h / g.group, 0, pos + 1, qf, m, l, acc);
  finalize<T, NV>(g, m, l, acc, sink, h, out + t * g.o_s0 + h * g.o_s1,
                  lse ? lse + t * g.lse_s0 + h : nullptr);
}

// Decode split: one warp per (work item, q head); writes partial (lse2, unnormalized acc / l).
template <typename T, int NV>
__global__ void decode_split_kernel(Geometry g, const T* __restrict__ q, const T* __restrict__ kc,
                                    const T* __restrict__ vc, const int4* __restrict__ items,
                                    const int32_t* __restrict__ page_indptr,
                                    const int32_t* __restrict__ page_ids, int num_items,
                                    float* __restrict__ part_o, float* __restrict__ part_lse) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  if (warp >= num_items * g.hq) return;
  const int it = warp / g.hq, h = warp % g.hq;
  const int lane = threadIdx.x & 31;
  const int4 item = items[it];  // x: request, y: kv begin, z: kv end
  const int b = item.x;
  float qf[NV], acc[NV], m, l;
  const T* qrow = q + b * g.q_s0 + h * g.q_s1;
#pragma unroll
  for (int i = 0; i < NV; ++i) qf[i] = to_f(qrow[lane * NV + i]);
  attend_range<T, NV>(g, kc, vc, page_ids + page_indptr[b], h / g.group, item.y, item.z, qf, m, l,
                      acc);
  const float inv = l > 0.f ? 1.f / l : 0.f;
  float* po = part_o + (static_cast<int64_t>(it) * g.hq + h) * (NV * kWarp);
#pragma unroll
  for (int i = 0; i < NV; ++i) po[lane * NV + i] = acc[i] * inv;  // empty split: o = 0
  if (lane == 0) part_lse[it * g.hq + h] = l > 0.f ? m + log2f(l) : -INFINITY;
}

// Merge: one warp per (request, q head) over its items; empty splits (lse=-inf) weigh 0.
template <typename T, int NV>
__global__ void decode_merge_kernel(Geometry g, const int32_t* __restrict__ item_indptr,
                                    const float* __restrict__ part_o,
                                    const float* __restrict__ part_lse, const float* __restrict__ sink,
                                    T* __restrict__ out, float* __restrict__ lse, int n) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  if (warp >= n * g.hq) return;
  const int b = warp / g.hq, h = warp % g.hq;
  const int lane = threadIdx.x & 31;
  const int i0 = item_indptr[b], i1 = item_indptr[b + 1];
  float m = -INFINITY;
  for (int i = i0; i < i1; ++i) m = fmaxf(m, part_lse[i * g.hq + h]);
  float acc[NV], l = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) acc[k] = 0.f;
  if (m != -INFINITY) {
    for (int i = i0; i < i1; ++i) {
      const float w = exp2f(part_lse[i * g.hq + h] - m);
      l += w;
      const float* po = part_o + (static_cast<int64_t>(i) * g.hq + h) * (NV * kWarp);
#pragma unroll
      for (int k = 0; k < NV; ++k) acc[k] += w * po[lane * NV + k];
    }
  }
  finalize<T, NV>(g, m, l, acc, sink, h, out + b * g.o_s0 + h * g.o_s1,
                  lse ? lse + b * g.lse_s0 + h : nullptr);
}

// ---------------------------------------------------------------------------------------------
// Plans

struct Plan {
  attnrt_problem problem{};
  int n = 0;
  int total_rows = 0;  // extend: packed tokens; decode: requests
  int num_items = 0;   // decode work items
  // Device buffers owned by the plan.
  int32_t* d_page_indptr = nullptr;
  int32_t* d_page_ids = nullptr;
  int32_t* d_row_req = nullptr;
  int32_t* d_row_pos = nullptr;
  int4* d_items = nullptr;
  int32_t* d_item_indptr = nullptr;
  float* d_part_o = nullptr;
  float* d_part_lse = nullptr;
};

void free_plan(Plan* p) {
  if (!p) return;
  cudaFree(p->d_page_indptr);
  cudaFree(p->d_page_ids);
  cudaFree(p->d_row_req);
  cudaFree(p->d_row_pos);
  cudaFree(p->d_items);
  cudaFree(p->d_item_indptr);
  cudaFree(p->d_part_o);
  cudaFree(p->d_part_lse);
  delete p;
}

template <typename T>
int32_t upload(T** dst, const T* src, size_t count) {
  const size_t bytes = sizeof(T) * std::max<size_t>(count, 1);
  CK(cudaMalloc(reinterpret_cast<void**>(dst), bytes));
  if (count > 0) CK(cudaMemcpy(*dst, src, sizeof(T) * count, cudaMemcpyHostToDevice));
  return ATTNRT_OK;
}

int32_t check_device(attnrt_device d) {
  if (d.kind != ATTNRT_DEVICE_CUDA) return fail(ATTNRT_UNAVAILABLE, "cuda backend serves cuda devices only");
  if (g_init_status != ATTNRT_OK) return fail(ATTNRT_UNAVAILABLE, "%s", g_init_error);
  if (d.index < 0 || d.index >= static_cast<int>(g_devices.size()))
    return fail(ATTNRT_UNAVAILABLE, "cuda:%d does not exist (%zu CUDA devices)", d.index,
                g_devices.size());
  return ATTNRT_OK;
}

// ---------------------------------------------------------------------------------------------
// ABI entry points (every one catches everything)

int32_t p_init() {
  if (g_init_done) {
    if (g_init_status != ATTNRT_OK) std::snprintf(g_error, sizeof g_error, "%s", g_init_error);
    return g_init_status;
  }
  g_init_done = true;
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice || e != cudaSuccess || count == 0) {
    if (e == cudaErrorNoDevice || (e == cudaSuccess && count == 0))
      std::snprintf(g_init_error, sizeof g_init_error, "no CUDA device");
    else
      std::snprintf(g_init_error, sizeof g_init_error, "no CUDA driver: %s (%s)",
                    cudaGetErrorName(e), cudaGetErrorString(e));
    g_init_status = ATTNRT_UNAVAILABLE;
    std::snprintf(g_error, sizeof g_error, "%s", g_init_error);
    return g_init_status;
  }
  g_devices.resize(count);
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    e = cudaGetDeviceProperties(&prop, i);
    if (e != cudaSuccess) {
      std::snprintf(g_init_error, sizeof g_init_error, "cudaGetDeviceProperties(%d): %s", i,
                    cudaGetErrorString(e));
      g_init_status = ATTNRT_UNAVAILABLE;
      std::snprintf(g_error, sizeof g_error, "%s", g_init_error);
      return g_init_status;
    }
    g_devices[i].major = prop.major;
    g_devices[i].minor = prop.minor;
    g_devices[i].sms = prop.multiProcessorCount;
    std::snprintf(g_devices[i].name, sizeof g_devices[i].name, "%s", prop.name);
  }
  g_init_status = ATTNRT_OK;
  return ATTNRT_OK;
}

int32_t p_device_count(int32_t kind, int32_t* count) {
  *count = (kind == ATTNRT_DEVICE_CUDA && g_init_status == ATTNRT_OK)
               ? static_cast<int32_t>(g_devices.size())
               : 0;
  return ATTNRT_OK;
}

int32_t p_probe(const attnrt_problem* p) {
  if (int32_t s = check_device(p->device); s != ATTNRT_OK) return s;
  const DeviceInfo& dev = g_devices[p->device.index];
  if (dev.major < 8)
    return fail(ATTNRT_UNAVAILABLE, "compute capability %d.%d < 8.0 (needs sm_80 or newer)",
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

int32_t plan_impl(const attnrt_problem* p, const attnrt_layout* L, Plan* pl) {
  pl->problem = *p;
  pl->n = L->num_requests;
  const int n = L->num_requests;
  CK(cudaSetDevice(p->device.index));
  if (upload(&pl->d_page_indptr, L->page_indptr, n + 1) != ATTNRT_OK) return ATTNRT_INTERNAL;
  if (upload(&pl->d_page_ids, L->page_ids, static_cast<size_t>(L->page_indptr[n])) != ATTNRT_OK)
    return ATTNRT_INTERNAL;
  if (p->op == ATTNRT_OP_DENSE_EXTEND) {
    const int64_t T = L->q_indptr[n];
    std::vector<int32_t> req(T), pos(T);
    for (int b = 0; b < n; ++b)
      for (int64_t t = L->q_indptr[b]; t < L->q_indptr[b + 1]; ++t) {
        req[t] = b;
        pos[t] = L->kv_len[b] - L->q_len[b] + static_cast<int32_t>(t - L->q_indptr[b]);
      }
    pl->total_rows = static_cast<int>(T);
    if (upload(&pl->d_row_req, req.data(), T) != ATTNRT_OK) return ATTNRT_INTERNAL;
    if (upload(&pl->d_row_pos, pos.data(), T) != ATTNRT_OK) return ATTNRT_INTERNAL;
    return ATTNRT_OK;
  }
  // Decode: split long contexts when there are few requests, so that about 4 warps per SM
  // partition of work exist per head; splits are at least 256 keys.
  const int sms = g_devices[p->device.index].sms;
  const int64_t target_items = std::max<int64_t>(1, (int64_t)sms * 32 / std::max(1, p->num_q_heads));
  int64_t total_kv = 0;
  for (int b = 0; b < n; ++b) total_kv += L->kv_len[b];
  const int64_t chunk_goal = std::max<int64_t>(256, (total_kv + target_items - 1) / target_items);
  std::vector<int4> items;
  std::vector<int32_t> indptr(n + 1, 0);
  for (int b = 0; b < n; ++b) {
    const int kv = L->kv_len[b];
    const int splits = std::max<int>(1, static_cast<int>((kv + chunk_goal - 1) / chunk_goal));
    const int per = (kv + splits - 1) / splits;
    for (int s = 0; s < splits; ++s) {
      const int kb = std::min(kv, s * per), ke = std::min(kv, (s + 1) * per);
      items.push_back(make_int4(b, kb, ke, 0));  // may be empty: merge handles lse=-inf
    }
    indptr[b + 1] = static_cast<int32_t>(items.size());
  }
  pl->total_rows = n;
  pl->num_items = static_cast<int>(items.size());
  if (upload(&pl->d_items, items.data(), items.size()) != ATTNRT_OK) return ATTNRT_INTERNAL;
  if (upload(&pl->d_item_indptr, indptr.data(), indptr.size()) != ATTNRT_OK) return ATTNRT_INTERNAL;
  const size_t rows = static_cast<size_t>(pl->num_items) * p->num_q_heads;
  CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_part_o), sizeof(float) * rows * p->head_dim + 4));
  CK(cudaMalloc(reinterpret_cast<void**>(&pl->d_part_lse), sizeof(float) * rows + 4));
  return ATTNRT_OK;
}

int32_t p_plan(const attnrt_problem* p, const attnrt_layout* L, attnrt_plan* out) {
  try {
    if (int32_t s = p_probe(p); s != ATTNRT_OK) return s;
    if (attnrt_cuda_sparse::is_sparse_op(p->op))
      return attnrt_cuda_sparse::plan(p, L, g_devices[p->device.index].sms, out, g_error,
                                      sizeof g_error);
    Plan* pl = new (std::nothrow) Plan{};
    if (!pl) return fail(ATTNRT_INTERNAL, "out of host memory");
    if (int32_t s = plan_impl(p, L, pl); s != ATTNRT_OK) {
      free_plan(pl);
      return s;
    }
    *out = reinterpret_cast<attnrt_plan>(pl);
    return ATTNRT_OK;
  } catch (...) {
    return fail(ATTNRT_INTERNAL, "exception in cuda plan");
  }
}

template <typename T, int NV>
int32_t launch(const Plan& pl, const attnrt_tensors* t, cudaStream_t st) {
  const attnrt_problem& p = pl.problem;
  Geometry g{};
  g.hq = p.num_q_heads;
  g.hkv = p.num_kv_heads;
  g.group = p.num_q_heads / p.num_kv_heads;
  g.page_size = p.page_size;
  g.scale_log2 = p.sm_scale * 1.4426950408889634f;
  g.q_s0 = t->q.strides[0]; g.q_s1 = t->q.strides[1];
  g.o_s0 = t->out.strides[0]; g.o_s1 = t->out.strides[1];
  g.k_s0 = t->k_cache.strides[0]; g.k_s1 = t->k_cache.strides[1]; g.k_s2 = t->k_cache.strides[2];
  g.v_s0 = t->v_cache.strides[0]; g.v_s1 = t->v_cache.strides[1]; g.v_s2 = t->v_cache.strides[2];
  float* lse = p.write_lse ? static_cast<float*>(t->lse.data) : nullptr;
  g.lse_s0 = lse ? t->lse.strides[0] : 0;
  const float* sink = p.has_sink ? static_cast<const float*>(t->sink.data) : nullptr;
  const T* q = static_cast<const T*>(t->q.data);
  const T* kc = static_cast<const T*>(t->k_cache.data);
  const T* vc = static_cast<const T*>(t->v_cache.data);
  T* out = static_cast<T*>(t->out.data);
  constexpr int kThreads = 128, kWarps = kThreads / kWarp;
  if (p.op == ATTNRT_OP_DENSE_EXTEND) {
    const int64_t warps = static_cast<int64_t>(pl.total_rows) * g.hq;
    if (warps == 0) return ATTNRT_OK;
    extend_kernel<T, NV><<<static_cast<unsigned>((warps + kWarps - 1) / kWarps), kThreads, 0, st>>>(
        g, q, kc, vc, out, lse, sink, pl.d_row_req, pl.d_row_pos, pl.d_page_indptr, pl.d_page_ids,
        pl.total_rows);
    CK(cudaGetLastError());
    return ATTNRT_OK;
  }
  if (pl.n == 0) return ATTNRT_OK;
  const int64_t w1 = static_cast<int64_t>(pl.num_items) * g.hq;
  decode_split_kernel<T, NV><<<static_cast<unsigned>((w1 + kWarps - 1) / kWarps), kThreads, 0, st>>>(
      g, q, kc, vc, pl.d_items, pl.d_page_indptr, pl.d_page_ids, pl.num_items, pl.d_part_o,
      pl.d_part_lse);
  CK(cudaGetLastError());
  const int64_t w2 = static_cast<int64_t>(pl.n) * g.hq;
  decode_merge_kernel<T, NV><<<static_cast<unsigned>((w2 + kWarps - 1) / kWarps), kThreads, 0, st>>>(
      g, pl.d_item_indptr, pl.d_part_o, pl.d_part_lse, sink, out, lse, pl.n);
  CK(cudaGetLastError());
  return ATTNRT_OK;
}

template <typename T>
int32_t launch_d(const Plan& pl, const attnrt_tensors* t, cudaStream_t st) {
  switch (pl.problem.head_dim) {
    case 64: return launch<T, 2>(pl, t, st);
    case 128: return launch<T, 4>(pl, t, st);
    case 256: return launch<T, 8>(pl, t, st);
    default: return fail(ATTNRT_INVALID, "head_dim %d not supported", pl.problem.head_dim);
  }
}

int32_t p_run(attnrt_plan plan, const attnrt_tensors* t, void* stream) {
  try {
    if (!plan) return fail(ATTNRT_INVALID, "null plan");
    // Sparse and dense plans both start with their attnrt_problem.
    if (attnrt_cuda_sparse::is_sparse_op(reinterpret_cast<const attnrt_problem*>(plan)->op))
      return attnrt_cuda_sparse::run(plan, t, stream, g_error, sizeof g_error);
    const Plan& pl = *reinterpret_cast<const Plan*>(plan);
    const attnrt_tensor* inner[] = {&t->q, &t->out};
    for (const attnrt_tensor* x : inner)
      if (x->rank != 3 || x->strides[2] != 1)
        return fail(ATTNRT_INVALID, "q/out must be rank 3 with unit innermost stride");
    if (t->k_cache.rank != 4 || t->k_cache.strides[3] != 1 || t->v_cache.rank != 4 ||
        t->v_cache.strides[3] != 1)
      return fail(ATTNRT_INVALID, "k_cache/v_cache must be rank 4 with unit innermost stride");
    if (pl.problem.write_lse && (!t->lse.data || t->lse.strides[1] != 1))
      return fail(ATTNRT_INVALID, "lse must be present with unit innermost stride");
    if (pl.problem.has_sink && !t->sink.data) return fail(ATTNRT_INVALID, "sink missing");
    // Vector loads need each row 16-byte aligned: pointers and row strides multiples of 8 elements.
    const attnrt_tensor* rows[] = {&t->q, &t->out, &t->k_cache, &t->v_cache};
    for (const attnrt_tensor* x : rows) {
      bool ok = reinterpret_cast<uintptr_t>(x->data) % 16 == 0;
      for (int k = 0; k + 1 < x->rank; ++k) ok = ok && x->strides[k] % 8 == 0;
      if (!ok) return fail(ATTNRT_UNAVAILABLE, "cuda needs 16-byte aligned rows (strides multiple of 8)");
    }
    CK(cudaSetDevice(pl.problem.device.index));
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (pl.problem.q_dtype == ATTNRT_BF16) return launch_d<__nv_bfloat16>(pl, t, st);
    return launch_d<__half>(pl, t, st);
  } catch (...) {
    return fail(ATTNRT_INTERNAL, "exception in cuda run");
  }
}

void p_destroy_plan(attnrt_plan plan) {
  if (plan && attnrt_cuda_sparse::is_sparse_op(reinterpret_cast<const attnrt_problem*>(plan)->op))
    return attnrt_cuda_sparse::destroy(plan);
  free_plan(reinterpret_cast<Plan*>(plan));
}

const char* p_last_error() { return g_error; }

int32_t p_preferred_page_size(attnrt_device d, int32_t* ps) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  *ps = 64;
  return ATTNRT_OK;
}

int32_t p_mem_alloc(attnrt_device d, size_t bytes, void** out) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  CK(cudaSetDevice(d.index));
  CK(cudaMalloc(out, std::max<size_t>(bytes, 1)));
  return ATTNRT_OK;
}
int32_t p_mem_free(attnrt_device d, void* ptr) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  CK(cudaSetDevice(d.index));
  CK(cudaFree(ptr));
  return ATTNRT_OK;
}
int32_t p_copy_to_device(attnrt_device d, void* dst, const void* src, size_t bytes) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  CK(cudaSetDevice(d.index));
  CK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  return ATTNRT_OK;
}
int32_t p_copy_to_host(attnrt_device d, void* dst, const void* src, size_t bytes) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  CK(cudaSetDevice(d.index));
  CK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return ATTNRT_OK;
}
int32_t p_synchronize(attnrt_device d) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  CK(cudaSetDevice(d.index));
  CK(cudaDeviceSynchronize());
  return ATTNRT_OK;
}
int32_t p_describe_device(attnrt_device d, char* buf, size_t cap) {
  if (int32_t s = check_device(d); s != ATTNRT_OK) return s;
  const DeviceInfo& i = g_devices[d.index];
  std::snprintf(buf, cap, "%s, sm_%d%d, %d SMs, SIMT kernels", i.name, i.major, i.minor, i.sms);
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
    nullptr,  // update_plan: not yet
    p_preferred_page_size,
    p_mem_alloc,
    p_mem_free,
    p_copy_to_device,
    p_copy_to_host,
    p_synchronize,
    p_describe_device,
};

}  // namespace

extern "C" {
ATTNRT_PLUGIN_EXPORT extern const uint32_t attnrt_plugin_abi_version;
const uint32_t attnrt_plugin_abi_version = ATTNRT_PLUGIN_ABI_VERSION;
ATTNRT_PLUGIN_EXPORT const attnrt_plugin_v1* attnrt_plugin_get(void) { return &kTable; }
}
