// A test plugin for fault injection. One source, built once per fault (FAULT_* below), each as
// its own shared library in its own folder. The healthy variant computes dense attention on
// f32, f16 and bf16 host tensors correctly (simple loops in double), so a plugin that passes its
// canary and is chosen over the cpu backend is observable, and `attnrt run` (bf16 by default)
// really tries every variant. Includes only the plugin ABI, as real plugins do, so the 16-bit
// conversions are its own.
//
// NO_RUNTIME's init reports its runtime absent, as a GPU plugin does on a machine without one.
// ABI_MINOR0 is the healthy plugin built for ABI 1.0, before sparse_decode (op 6) existed; its
// probe would claim op 6, so a host that asked it anyway would show it.
// Its table also ends where a 1.0 or 1.1 table does (struct_size), and the field past that end
// aborts the process if called: a host that read it would not survive the test.
// DEGRADES (ABI 1.2) counts every dense_decode run as degraded and fails to answer for
// dense_extend. SHORT_TABLE claims ABI 1.2 with a 1.1-sized table, which the host must refuse.
// NULL_GET's entry point returns NULL; MISSING_VERSION exports no version; VERSION_MISMATCH's
// table claims ABI 1.1 while its export says 1.2; BAD_NAME's name is not [a-z0-9_]+. The host
// must refuse each before calling anything else in it.
// FAKE_GPU and ALLOC_FAILS serve a pretend accelerator, cuda:0, whose "device memory" is host
// memory: FAKE_GPU allocates it with malloc; ALLOC_FAILS fails every allocation, so its canary
// cannot even be set up.
#include <attnrt/plugin.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#ifndef PLUGIN_NAME
#error "PLUGIN_NAME must be defined"
#endif
#ifndef PLUGIN_PRIORITY
#define PLUGIN_PRIORITY 300
#endif
#if defined(FAULT_FAKE_GPU) || defined(FAULT_ALLOC_FAILS)
#define SERVES_KIND ATTNRT_DEVICE_CUDA
#else
#define SERVES_KIND ATTNRT_DEVICE_CPU
#endif

#if defined(FAULT_WRONG_ABI)
#define PLUGIN_ABI_VERSION (2u << 16)
#elif defined(FAULT_ABI_MINOR0)
#define PLUGIN_ABI_VERSION (ATTNRT_PLUGIN_ABI_MAJOR << 16)
#else
#define PLUGIN_ABI_VERSION ATTNRT_PLUGIN_ABI_VERSION
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

// f16 / bf16 <-> f32, round to nearest, ties to even; NaN stays NaN, overflow becomes inf.
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float bf16_to_f32(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }
uint16_t f32_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float f16_to_f32(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in f32
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return float_of(sign | 0x7f800000u | (mant << 13));
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}
uint16_t f32_to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // 65520 and up round to inf
  if (a < 0x38800000u) {  // below 2^-14: an f16 subnormal, a multiple of 2^-24
    const float scaled = float_of(a) * 16777216.0f;  // exact (power of two)
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  // Rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits; a carry rolls into
  // the exponent, which is the correct result.
  const uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

[[maybe_unused]] double load(const attnrt_tensor& t, int64_t i) {
  switch (t.dtype) {
    case ATTNRT_F16: return f16_to_f32(static_cast<const uint16_t*>(t.data)[i]);
    case ATTNRT_BF16: return bf16_to_f32(static_cast<const uint16_t*>(t.data)[i]);
    default: return static_cast<const float*>(t.data)[i];
  }
}
[[maybe_unused]] void store(const attnrt_tensor& t, int64_t i, double v) {
  const float f = static_cast<float>(v);
  switch (t.dtype) {
    case ATTNRT_F16: static_cast<uint16_t*>(t.data)[i] = f32_to_f16(f); return;
    case ATTNRT_BF16: static_cast<uint16_t*>(t.data)[i] = f32_to_bf16(f); return;
    default: static_cast<float*>(t.data)[i] = f; return;
  }
}
bool is_float(int32_t dtype) { return dtype == ATTNRT_F32 || dtype == ATTNRT_F16 || dtype == ATTNRT_BF16; }

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

#if defined(FAULT_DEGRADES)
int g_decode_runs = 0;  // every one counted as degraded

int32_t degraded_runs(attnrt_device, int32_t op, uint64_t* count, char* note, size_t cap) {
  if (op == ATTNRT_OP_DENSE_EXTEND) return fail(ATTNRT_INTERNAL, "injected degraded_runs failure");
  *count = op == ATTNRT_OP_DENSE_DECODE ? static_cast<uint64_t>(g_decode_runs) : 0;
  std::snprintf(note, cap, "%s", op == ATTNRT_OP_DENSE_DECODE ? "injected: every decode run" : "");
  return ATTNRT_OK;
}
#elif defined(FAULT_ABI_MINOR0)
int32_t degraded_runs(attnrt_device, int32_t, uint64_t*, char*, size_t) {
  std::fprintf(stderr, "fault_abi_minor0: the host read a field past a 1.0 table's struct_size\n");
  std::abort();
}
#endif

int32_t init() {
#if defined(FAULT_MISSING_DEP)
  return attnrt_testdep_value() == 42 ? ATTNRT_OK : fail(ATTNRT_INTERNAL, "dep");
#elif defined(FAULT_NO_RUNTIME)
  // What a plugin does on a machine without its driver or hardware.
  return fail(ATTNRT_UNAVAILABLE, "no test runtime on this machine (injected)");
#else
  return ATTNRT_OK;
#endif
}

int32_t device_count(int32_t kind, int32_t* count) {
  *count = kind == SERVES_KIND ? 1 : 0;
  return ATTNRT_OK;
}

int32_t probe(const attnrt_problem* p) {
  if (p->device.kind != SERVES_KIND || p->device.index != 0)
    return fail(ATTNRT_UNAVAILABLE, "serves one device only");
#if defined(FAULT_ABI_MINOR0)
  if (p->op == 6) return ATTNRT_OK;  // an op number ABI 1.0 does not have
#endif
  if (p->op != ATTNRT_OP_DENSE_EXTEND && p->op != ATTNRT_OP_DENSE_DECODE)
    return fail(ATTNRT_UNAVAILABLE, "only dense ops");
  if (!is_float(p->q_dtype) || !is_float(p->kv_dtype))
    return fail(ATTNRT_UNAVAILABLE, "only f32, f16 and bf16");
  if (p->head_dim > 512) return fail(ATTNRT_UNAVAILABLE, "head_dim > 512");
  return ATTNRT_OK;
}

#if defined(FAULT_FAKE_GPU) || defined(FAULT_ALLOC_FAILS)
int32_t mem_alloc(attnrt_device, size_t bytes, void** out) {
#if defined(FAULT_ALLOC_FAILS)
  (void)bytes;
  *out = nullptr;
  return fail(ATTNRT_INTERNAL, "injected allocation failure");
#else
  *out = std::malloc(bytes ? bytes : 1);
  return *out ? ATTNRT_OK : fail(ATTNRT_INTERNAL, "out of memory");
#endif
}
int32_t mem_free(attnrt_device, void* p) {
  std::free(p);
  return ATTNRT_OK;
}
int32_t copy(attnrt_device, void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return ATTNRT_OK;
}
#endif

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

// Refreshes a decode plan in place (new lengths and pages for the same requests), as a GPU
// backend does for graph replay.
[[maybe_unused]] int32_t update_plan(attnrt_plan h, const attnrt_layout* l) {
  Plan* pl = reinterpret_cast<Plan*>(h);
  if (l->num_requests != pl->n) return fail(ATTNRT_UNAVAILABLE, "another request count");
  int32_t* kv = copy_array(l->kv_len, l->num_requests);
  int32_t* indptr = copy_array(l->page_indptr, l->num_requests + 1);
  int32_t* ids = copy_array(l->page_ids, l->page_indptr[l->num_requests]);
  if (!kv || !indptr || !ids) {
    delete[] kv;
    delete[] indptr;
    delete[] ids;
    return fail(ATTNRT_INTERNAL, "out of memory");
  }
  delete[] pl->kv_len;
  delete[] pl->page_indptr;
  delete[] pl->page_ids;
  pl->kv_len = kv;
  pl->page_indptr = indptr;
  pl->page_ids = ids;
  return ATTNRT_OK;
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
  const attnrt_tensor &q = t->q, &k = t->k_cache, &v = t->v_cache, &o = t->out;
  float* lse = static_cast<float*>(t->lse.data);
  const float* sink = static_cast<const float*>(t->sink.data);
  double qv[512], acc[512];
#if defined(FAULT_DEGRADES)
  if (p.op == ATTNRT_OP_DENSE_DECODE) ++g_decode_runs;
#endif
  for (int b = 0; b < pl->n; ++b) {
    for (int i = 0; i < pl->q_len[b]; ++i) {
      const int64_t row = pl->q_indptr[b] + i;
      const int pos = pl->kv_len[b] - pl->q_len[b] + i;
      for (int h = 0; h < p.num_q_heads; ++h) {
        const int g = h / G;
        for (int d = 0; d < D; ++d) qv[d] = load(q, row * q.strides[0] + h * q.strides[1] + d);
        // Element offset of key j of this request in a [pages, page_size, heads, dim] pool.
        auto kv_off = [&](const attnrt_tensor& c, int j) {
          const int64_t page = pl->page_ids[pl->page_indptr[b] + j / pl->page_size];
          return page * c.strides[0] + (j % pl->page_size) * c.strides[1] + g * c.strides[2];
        };
        auto score = [&](int j) {
          const int64_t off = kv_off(k, j);
          double s = 0;
          for (int d = 0; d < D; ++d) s += qv[d] * load(k, off + d);
          return s * p.sm_scale;
        };
        double m = -INFINITY;
        for (int j = 0; j <= pos; ++j) {
          const double s = score(j);
          if (s > m) m = s;
        }
        if (sink && sink[h] > m) m = sink[h];
        double sum = sink ? std::exp(sink[h] - m) : 0.0;
        for (int d = 0; d < D; ++d) acc[d] = 0;
        for (int j = 0; j <= pos; ++j) {
          const double w = std::exp(score(j) - m);
          const int64_t off = kv_off(v, j);
          sum += w;
          for (int d = 0; d < D; ++d) acc[d] += w * load(v, off + d);
        }
        for (int d = 0; d < D; ++d) {
          double x = acc[d] / sum;
#if defined(FAULT_WRONG_NUMBERS)
          x = x * 1.5 + 0.1;
#endif
          store(o, row * o.strides[0] + h * o.strides[1] + d, x);
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
#if defined(FAULT_VERSION_MISMATCH)
    /* .abi_version = */ (ATTNRT_PLUGIN_ABI_MAJOR << 16) | 1u,
#else
    /* .abi_version = */ PLUGIN_ABI_VERSION,
#endif
#if defined(FAULT_ABI_MINOR0) || defined(FAULT_SHORT_TABLE)
    /* .struct_size = */ ATTNRT_PLUGIN_V1_1_SIZE,
#else
    /* .struct_size = */ sizeof(attnrt_plugin_v1),
#endif
    /* .name = */ PLUGIN_NAME,
    /* .priority = */ PLUGIN_PRIORITY,
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
#if defined(FAULT_HEALTHY)
    /* .update_plan = */ update_plan,
#else
    /* .update_plan = */ nullptr,
#endif
    /* .preferred_page_size = */ nullptr,
#if defined(FAULT_FAKE_GPU) || defined(FAULT_ALLOC_FAILS)
    /* .mem_alloc = */ mem_alloc,
    /* .mem_free = */ mem_free,
    /* .copy_to_device = */ copy,
    /* .copy_to_host = */ copy,
#else
    /* .mem_alloc = */ nullptr,
    /* .mem_free = */ nullptr,
    /* .copy_to_device = */ nullptr,
    /* .copy_to_host = */ nullptr,
#endif
    /* .synchronize = */ nullptr,
    /* .describe_device = */ nullptr,
#if defined(FAULT_DEGRADES) || defined(FAULT_ABI_MINOR0)
    /* .degraded_runs = */ degraded_runs,
#else
    /* .degraded_runs = */ nullptr,
#endif
};

}  // namespace

extern "C" {
#if !defined(FAULT_MISSING_VERSION)
ATTNRT_PLUGIN_EXPORT extern const uint32_t attnrt_plugin_abi_version = PLUGIN_ABI_VERSION;
#endif
#if defined(FAULT_NULL_GET)
ATTNRT_PLUGIN_EXPORT const attnrt_plugin_v1* attnrt_plugin_get(void) { return nullptr; }
#elif !defined(FAULT_MISSING_ENTRY)
ATTNRT_PLUGIN_EXPORT const attnrt_plugin_v1* attnrt_plugin_get(void) { return &kTable; }
#endif
}
