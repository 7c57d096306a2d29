// A test plugin for fault injection. One source, built once per fault (FAULT_* below), each as
// its own shared library in its own folder. The healthy variant computes dense attention on
// f32 host tensors correctly (simple loops), so a plugin that passes its canary and is chosen
// over the cpu backend is observable. Includes only the plugin ABI, as real plugins do.
#include <attnrt/plugin.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>

#ifndef PLUGIN_NAME
#error "PLUGIN_NAME must be defined"
#endif

#if defined(FAULT_MISSING_DEP)
extern "C" int attnrt_testdep_value(void);  // from a library that is not on the search path
#endif

namespace {

thread_local char g_error[256] = "";

int32_t fail(int32_t status, const char* msg) {
  std::snprintf(g_error, sizeof g_error, "%s", msg);
  return status;
}

struct Plan {
  attnrt_problem problem;
  int32_t n;
  int32_t page_size;
  int32_t* q_len;
  int32_t* kv_len;
  int64_t* q_indptr;
  int32_t* page_indptr;
  int32_t* page_ids;
};

int32_t init() {
#if defined(FAULT_MISSING_DEP)
  return attnrt_testdep_value() == 42 ? ATTNRT_OK : fail(ATTNRT_INTERNAL, "dep");
#else
  return ATTNRT_OK;
#endif
}

int32_t device_count(int32_t kind, int32_t* count) {
  *count = kind == ATTNRT_DEVICE_CPU ? 1 : 0;
  return ATTNRT_OK;
}

int32_t probe(const attnrt_problem* p) {
  if (p->device.kind != ATTNRT_DEVICE_CPU) return fail(ATTNRT_UNAVAILABLE, "host only");
  if (p->op != ATTNRT_OP_DENSE_EXTEND && p->op != ATTNRT_OP_DENSE_DECODE)
    return fail(ATTNRT_UNAVAILABLE, "only dense ops");
  if (p->q_dtype != ATTNRT_F32 || p->kv_dtype != ATTNRT_F32)
    return fail(ATTNRT_UNAVAILABLE, "only f32");
  return ATTNRT_OK;
}

template <typename T>
T* copy_array(const T* src, int64_t n) {
  T* d = new (std::nothrow) T[n > 0 ? n : 1];
  if (d && n > 0) std::memcpy(d, src, sizeof(T) * n);
  return d;
}

[[maybe_unused]] int32_t plan(const attnrt_problem* p, const attnrt_layout* l, attnrt_plan* out) {
#if defined(FAULT_PLAN_FAILS)
  (void)p; (void)l; (void)out;
  return fail(ATTNRT_UNAVAILABLE, "injected plan failure");
#else
  Plan* pl = new (std::nothrow) Plan{};
  if (!pl) return fail(ATTNRT_INTERNAL, "out of memory");
  pl->problem = *p;
  pl->n = l->num_requests;
  pl->page_size = l->page_size;
  pl->q_len = copy_array(l->q_len, l->num_requests);
  pl->kv_len = copy_array(l->kv_len, l->num_requests);
  pl->q_indptr = copy_array(l->q_indptr, l->num_requests + 1);
  pl->page_indptr = copy_array(l->page_indptr, l->num_requests + 1);
  pl->page_ids = copy_array(l->page_ids, l->page_indptr[l->num_requests]);
  *out = reinterpret_cast<attnrt_plan>(pl);
  return ATTNRT_OK;
#endif
}

void destroy_plan(attnrt_plan h) {
  Plan* p = reinterpret_cast<Plan*>(h);
  if (!p) return;
  delete[] p->q_len;
  delete[] p->kv_len;
  delete[] p->q_indptr;
  delete[] p->page_indptr;
  delete[] p->page_ids;
  delete p;
}

int32_t run(attnrt_plan h, const attnrt_tensors* t, void*) {
  Plan* pl = reinterpret_cast<Plan*>(h);
#if defined(FAULT_RUN_FAILS)
  (void)pl; (void)t;
  return fail(ATTNRT_UNAVAILABLE, "injected run failure");
#else
  const attnrt_problem& p = pl->problem;
  const int G = p.num_q_heads / p.num_kv_heads, D = p.head_dim;
  const float* q = static_cast<const float*>(t->q.data);
  const float* k = static_cast<const float*>(t->k_cache.data);
  const float* v = static_cast<const float*>(t->v_cache.data);
  float* o = static_cast<float*>(t->out.data);
  float* lse = static_cast<float*>(t->lse.data);
  const float* sink = static_cast<const float*>(t->sink.data);
  for (int b = 0; b < pl->n; ++b) {
    for (int i = 0; i < pl->q_len[b]; ++i) {
      int64_t row = pl->q_indptr[b] + i;
      int pos = pl->kv_len[b] - pl->q_len[b] + i;
      for (int h = 0; h < p.num_q_heads; ++h) {
        int g = h / G;
        const float* qv = q + row * t->q.strides[0] + h * t->q.strides[1];
        double m = -INFINITY;
        for (int j = 0; j <= pos; ++j) {
          int page = pl->page_ids[pl->page_indptr[b] + j / pl->page_size];
          const float* kv = k + page * t->k_cache.strides[0] + (j % pl->page_size) * t->k_cache.strides[1] + g * t->k_cache.strides[2];
          double s = 0;
          for (int d = 0; d < D; ++d) s += static_cast<double>(qv[d]) * kv[d];
          m = s * p.sm_scale > m ? s * p.sm_scale : m;
        }
        if (sink && sink[h] > m) m = sink[h];
        double sum = sink ? std::exp(sink[h] - m) : 0.0;
        double acc[512] = {0};
        for (int j = 0; j <= pos; ++j) {
          int page = pl->page_ids[pl->page_indptr[b] + j / pl->page_size];
          int64_t off = page * t->k_cache.strides[0] + (j % pl->page_size) * t->k_cache.strides[1] + g * t->k_cache.strides[2];
          double s = 0;
          for (int d = 0; d < D; ++d) s += static_cast<double>(qv[d]) * k[off + d];
          double w = std::exp(s * p.sm_scale - m);
          sum += w;
          for (int d = 0; d < D; ++d) acc[d] += w * v[off + d];
        }
        float* ov = o + row * t->out.strides[0] + h * t->out.strides[1];
        for (int d = 0; d < D; ++d) {
          double x = acc[d] / sum;
#if defined(FAULT_WRONG_NUMBERS)
          x = x * 1.5 + 0.1;
#endif
          ov[d] = static_cast<float>(x);
        }
        if (lse) lse[row * t->lse.strides[0] + h] = static_cast<float>(m + std::log(sum));
      }
    }
  }
  return ATTNRT_OK;
#endif
}

const char* last_error() { return g_error; }

const attnrt_plugin_v1 kTable = {
#if defined(FAULT_WRONG_ABI)
    /* .abi_version = */ (2u << 16),
#else
    /* .abi_version = */ ATTNRT_PLUGIN_ABI_VERSION,
#endif
    /* .struct_size = */ sizeof(attnrt_plugin_v1),
    /* .name = */ PLUGIN_NAME,
    /* .priority = */ 300,
    /* .init = */ init,
    /* .device_count = */ device_count,
    /* .probe = */ probe,
#if defined(FAULT_NULL_PLAN)
    /* .plan = */ nullptr,
#else
    /* .plan = */ plan,
#endif
    /* .run = */ run,
    /* .destroy_plan = */ destroy_plan,
    /* .last_error = */ last_error,
    /* .update_plan = */ nullptr,
    /* .preferred_page_size = */ nullptr,
    /* .mem_alloc = */ nullptr,
    /* .mem_free = */ nullptr,
    /* .copy_to_device = */ nullptr,
    /* .copy_to_host = */ nullptr,
    /* .synchronize = */ nullptr,
    /* .describe_device = */ nullptr,
};

}  // namespace

extern "C" {
#if defined(FAULT_WRONG_ABI)
ATTNRT_PLUGIN_EXPORT extern const uint32_t attnrt_plugin_abi_version = (2u << 16);
#else
ATTNRT_PLUGIN_EXPORT extern const uint32_t attnrt_plugin_abi_version = ATTNRT_PLUGIN_ABI_VERSION;
#endif
#if !defined(FAULT_MISSING_ENTRY)
ATTNRT_PLUGIN_EXPORT const attnrt_plugin_v1* attnrt_plugin_get(void) { return &kTable; }
#endif
}
