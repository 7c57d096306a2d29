/* attnrt plugin C ABI: the only header a backend plugin includes.
 *
 * A plugin is a shared library that exports two symbols:
 *
 *   const uint32_t attnrt_plugin_abi_version;             data; read before any plugin code runs
 *   const attnrt_plugin_v1* attnrt_plugin_get(void);      returns the plugin's static table
 *
 * The host dlopens the library (RTLD_NOW | RTLD_LOCAL), reads attnrt_plugin_abi_version, and
 * rejects the plugin unless its major version (high 16 bits) equals ATTNRT_PLUGIN_ABI_MAJOR. Only
 * then it calls attnrt_plugin_get() and checks the table: abi_version equal to the exported
 * constant, struct_size large enough, every required pointer non-null, a non-empty name unique
 * among loaded backends. Any failure makes the plugin unavailable with the reason; nothing
 * crashes. Minor versions are additive: a field added in minor m is read only when the plugin's
 * minor version is >= m, and an op added in minor m is passed only to plugins whose minor
 * version is >= m.
 *
 * Minor versions:
 *   1.0  the table below; ops 0-5.
 *   1.1  op 6, ATTNRT_OP_SPARSE_DECODE (sparse_index_decode then sparse_attend_decode on the
 *        selections it writes to tensors->topk, in one call). The host never passes op 6 to a
 *        plugin whose minor version is 0: for such a plugin it reports the op as not served
 *        ("op not served: plugin ABI 1.0 predates sparse_decode (1.1)") and the plugin still
 *        serves its other ops. A 1.1 plugin that does not serve op 6 says so in probe.
 *   1.2  degraded_runs, an optional field at the end of the table. The table of a 1.0 or 1.1
 *        plugin ends before it (its struct_size); the host reads the field only from a plugin
 *        whose minor version is >= 2, and then needs struct_size to cover it.
 *
 * Nothing of C++ crosses this boundary: no exceptions (a plugin must catch everything), no
 * std types. Every function returns an attnrt_status. On any non-OK status the plugin makes
 * last_error() return a message for the calling thread, valid until that thread's next call.
 *
 * Semantics of problems, layouts and tensors are those of attnrt/problem.h.
 */
#ifndef ATTNRT_PLUGIN_H_
#define ATTNRT_PLUGIN_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ATTNRT_PLUGIN_ABI_MAJOR 1u
#define ATTNRT_PLUGIN_ABI_MINOR 2u
#define ATTNRT_PLUGIN_ABI_VERSION ((ATTNRT_PLUGIN_ABI_MAJOR << 16) | ATTNRT_PLUGIN_ABI_MINOR)

#if defined(_WIN32)
#define ATTNRT_PLUGIN_EXPORT __declspec(dllexport)
#else
#define ATTNRT_PLUGIN_EXPORT __attribute__((visibility("default")))
#endif

typedef enum attnrt_status {
  ATTNRT_OK = 0,
  ATTNRT_UNAVAILABLE = 1, /* this plugin cannot serve the request; the host may use another */
  ATTNRT_INVALID = 2,     /* the input violates the contract (the host validated it: a bug) */
  ATTNRT_INTERNAL = 3     /* the plugin failed unexpectedly */
} attnrt_status;

/* Values equal to attnrt::DType, attnrt::DeviceKind, attnrt::Op, attnrt::ScoreType. */
typedef enum attnrt_dtype { ATTNRT_F32 = 0, ATTNRT_F16 = 1, ATTNRT_BF16 = 2, ATTNRT_I32 = 3 } attnrt_dtype;
typedef enum attnrt_device_kind { ATTNRT_DEVICE_CPU = 0, ATTNRT_DEVICE_CUDA = 1 } attnrt_device_kind;
typedef enum attnrt_op {
  ATTNRT_OP_DENSE_EXTEND = 0,
  ATTNRT_OP_DENSE_DECODE = 1,
  ATTNRT_OP_SPARSE_INDEX_EXTEND = 2,
  ATTNRT_OP_SPARSE_INDEX_DECODE = 3,
  ATTNRT_OP_SPARSE_ATTEND_EXTEND = 4,
  ATTNRT_OP_SPARSE_ATTEND_DECODE = 5,
  ATTNRT_OP_SPARSE_DECODE = 6 /* ABI 1.1 */
} attnrt_op;

typedef struct attnrt_device {
  int32_t kind; /* attnrt_device_kind */
  int32_t index;
} attnrt_device;

/* Mirrors attnrt::Problem field for field. scales are already resolved (never 0). */
typedef struct attnrt_problem {
  int32_t op; /* attnrt_op */
  attnrt_device device;
  int32_t q_dtype, kv_dtype; /* attnrt_dtype */
  int32_t page_size;
  int32_t num_q_heads, num_kv_heads, head_dim;
  float sm_scale;
  int32_t has_sink, write_lse;
  int32_t num_index_heads, index_dim, block_size, topk, init_blocks, local_blocks;
  int32_t score_type; /* 0 max, 1 lse */
  float index_scale;
} attnrt_problem;

/* Host arrays, valid only during the call that receives them (plan copies what it keeps). */
typedef struct attnrt_layout {
  int32_t num_requests;
  int32_t page_size;
  const int32_t* q_len;       /* [num_requests] */
  const int32_t* kv_len;      /* [num_requests] */
  const int64_t* q_indptr;    /* [num_requests + 1] */
  const int32_t* page_indptr; /* [num_requests + 1] */
  const int32_t* page_ids;    /* [page_indptr[num_requests]] */
  uint64_t fingerprint;       /* attnrt::BatchLayout::fingerprint() */
} attnrt_layout;

typedef struct attnrt_tensor {
  void* data; /* NULL when the tensor is absent */
  int32_t dtype;
  attnrt_device device;
  int32_t rank;
  int64_t shape[4];
  int64_t strides[4]; /* in elements */
} attnrt_tensor;

typedef struct attnrt_tensors {
  attnrt_tensor q, k_cache, v_cache, out, lse, sink;
  attnrt_tensor index_q, index_k_cache, topk;
} attnrt_tensors;

typedef struct attnrt_plan_s* attnrt_plan; /* opaque, owned by the plugin */

typedef struct attnrt_plugin_v1 {
  /* Equal to the exported attnrt_plugin_abi_version. */
  uint32_t abi_version;
  /* sizeof(attnrt_plugin_v1) as the plugin was built; fields past it are absent. */
  uint32_t struct_size;
  /* Unique, non-empty, [a-z0-9_]+; the name users pass to ATTNRT_BACKEND / ATTNRT_DISABLE. */
  const char* name;
  /* Selection priority; higher is tried first. Built-ins: reference 0, cpu 100; a generic GPU
   * backend 200; an architecture-specific fast path above that. */
  int32_t priority;

  /* Required. Called once after loading, before any other function but last_error. A plugin
   * whose runtime (a driver, a library) is missing returns ATTNRT_UNAVAILABLE with the loader's
   * text in last_error. */
  int32_t (*init)(void);
  /* Required. Number of devices of `kind` this plugin serves (0 when none); *count set on OK. */
  int32_t (*device_count)(int32_t kind, int32_t* count);
  /* Required. Cheap, side-effect free. OK when plan and run will work for this problem on
   * problem->device; ATTNRT_UNAVAILABLE otherwise, with the reason in last_error
   * (e.g. "head_dim 96 not supported (64, 128, 256)"). For an op the plugin never serves, the
   * reason starts with "op not served" (tools list such skips quietly). */
  int32_t (*probe)(const attnrt_problem* problem);
  /* Required. Builds a plan for this problem and layout. May allocate and do host work; the
   * device data it writes is in place when it returns (a launch on any stream sees it). On a
   * GPU it loads the code of every kernel its runs may launch: a kernel loaded at its first
   * launch (CUDA's lazy loading) may wait for every kernel on the device, one on another stream
   * waiting for this run included. */
  int32_t (*plan)(const attnrt_problem* problem, const attnrt_layout* layout, attnrt_plan* out);
  /* Required. Runs a plan on tensors that match its problem and layout (the host checked).
   * Writes every element of the outputs, or returns non-OK before writing any of them. `stream`
   * is the device stream (NULL: the default stream); the call may return before the device
   * finishes. Neither allocates, synchronizes nor loads code on GPU paths (graph-capturable).
   * The host shares cached plans between threads: run may be called concurrently on one plan,
   * so it must not modify the plan. On a non-host device the host passes the default stream and
   * enqueues one run of a plan at a time, so a plan's device scratch may be reused by its runs
   * (a caller passing its own streams must not run one plan on two streams at once). */
  int32_t (*run)(attnrt_plan plan, const attnrt_tensors* tensors, void* stream);
  /* Required. Frees a plan; NULL is a no-op. */
  void (*destroy_plan)(attnrt_plan plan);
  /* Required. Message of the calling thread's last failure; never NULL. */
  const char* (*last_error)(void);

  /* Optional (NULL: not supported). Refreshes a decode plan in place for a new layout with the
   * same number of requests (new kv_len and page ids), keeping every device address the plan
   * uses, so that a graph captured over run() replays with the new lengths. On a GPU it first
   * waits for the device to finish work already enqueued (which may read the plan) and returns
   * with the new values in place. Returns ATTNRT_UNAVAILABLE when the plan cannot absorb the
   * change (then the host re-plans). */
  int32_t (*update_plan)(attnrt_plan plan, const attnrt_layout* layout);

  /* Preferred page size for this device (0: no preference) and a short note for doctor.
   * Optional (NULL). */
  int32_t (*preferred_page_size)(attnrt_device device, int32_t* page_size);

  /* Device memory, required for plugins serving non-host devices, NULL otherwise.
   * Copies are synchronous with respect to the host: on return the data is in place for a
   * launch on any stream. */
  int32_t (*mem_alloc)(attnrt_device device, size_t bytes, void** out);
  int32_t (*mem_free)(attnrt_device device, void* ptr);
  int32_t (*copy_to_device)(attnrt_device device, void* dst, const void* src, size_t bytes);
  int32_t (*copy_to_host)(attnrt_device device, void* dst, const void* src, size_t bytes);
  int32_t (*synchronize)(attnrt_device device);
  /* One line describing the device ("NVIDIA H200, sm_90, 132 SMs"), written into buf. */
  int32_t (*describe_device)(attnrt_device device, char* buf, size_t cap);

  /* ABI 1.2. Optional (NULL: the plugin never degrades). How many times, since init, runs of
   * `op` on `device` went a slower way than their plan chose, their results still correct (for
   * example a kernel whose CTAs could not all start beside another kernel), in *count, counted
   * per run or per request of a run; and a short note of what is counted and why, written into
   * note (cap bytes, NUL-terminated), which may be empty when the count is 0. Runs still in
   * flight may not be counted yet. For reports, not for every step: it may wait for the
   * device's default stream. */
  int32_t (*degraded_runs)(attnrt_device device, int32_t op, uint64_t* count, char* note,
                           size_t cap);
} attnrt_plugin_v1;

/* The size of a 1.0 or 1.1 table: every field before degraded_runs. */
#define ATTNRT_PLUGIN_V1_1_SIZE offsetof(attnrt_plugin_v1, degraded_runs)

typedef const attnrt_plugin_v1* (*attnrt_plugin_get_fn)(void);

#define ATTNRT_PLUGIN_ENTRY_SYMBOL "attnrt_plugin_get"
#define ATTNRT_PLUGIN_VERSION_SYMBOL "attnrt_plugin_abi_version"

#ifdef __cplusplus
}
#endif

#endif /* ATTNRT_PLUGIN_H_ */
