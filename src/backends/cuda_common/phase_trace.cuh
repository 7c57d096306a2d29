// Opt-in per-CTA phase timestamps, for profiling a kernel on the device (header-only).
//
// Configured with -DATTNRT_PHASE_TRACE=ON, a kernel's ATTNRT_PHASE(table, slot) records
// %globaltimer (ns) from thread 0 of each of the first kPhaseCtas CTAs into `table`, a device
// array that one translation unit declares with ATTNRT_PHASE_TABLE(table, "name,name,..."). The
// plugin then exports
//
//   extern "C" int attnrt_phase_<table>(uint64_t* dst, int max_ctas, const char** slot_names);
//
// which copies [min(max_ctas, kPhaseCtas)][kPhaseSlots] stamps of the latest launch(es) to the
// host (0 = not reached), clears the table, sets *slot_names to the comma-separated names and
// returns the number of named slots (-1 when the copy fails). Kernels write stamps with plain
// stores: the table holds the last launch's stamps only when launches do not overlap.
// Without the option both macros compile to nothing and the symbol does not exist.
#pragma once

#include <cstdint>

namespace attnrt_cuda_common {

constexpr int kPhaseCtas = 1024;
constexpr int kPhaseSlots = 16;

}  // namespace attnrt_cuda_common

#ifdef ATTNRT_PHASE_TRACE
#include <cuda_runtime.h>

#include "cuda_common/spin_wait.cuh"

#define ATTNRT_PHASE_TABLE(table, names)                                                         \
  __device__ uint64_t table[attnrt_cuda_common::kPhaseCtas][attnrt_cuda_common::kPhaseSlots];     \
  extern "C" __attribute__((visibility("default"))) int attnrt_phase_##table(                  \
      uint64_t* dst, int max_ctas, const char** slot_names) {                                    \
    using namespace attnrt_cuda_common;                                                           \
    const int ctas = max_ctas < kPhaseCtas ? max_ctas : kPhaseCtas;                               \
    const size_t bytes = sizeof(uint64_t) * kPhaseSlots * (ctas > 0 ? ctas : 0);                  \
    if (cudaDeviceSynchronize() != cudaSuccess ||                                                 \
        cudaMemcpyFromSymbol(dst, table, bytes) != cudaSuccess)                                   \
      return -1;                                                                                  \
    static const uint64_t zeros[kPhaseCtas][kPhaseSlots] = {};                                    \
    if (cudaMemcpyToSymbol(table, zeros, sizeof zeros) != cudaSuccess) return -1;                 \
    *slot_names = names;                                                                          \
    int n = 1;                                                                                    \
    for (const char* c = names; *c; ++c) n += *c == ',';                                          \
    return n;                                                                                     \
  }

#define ATTNRT_PHASE(table, slot)                                                \
  do {                                                                           \
    if (threadIdx.x == 0 && blockIdx.x < attnrt_cuda_common::kPhaseCtas) {       \
      table[blockIdx.x][slot] = attnrt_cuda_common::globaltimer_ns();            \
    }                                                                            \
  } while (0)
#else
#define ATTNRT_PHASE_TABLE(table, names)
#define ATTNRT_PHASE(table, slot) \
  do {                            \
  } while (0)
#endif
