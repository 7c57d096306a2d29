// Test helper of attnrt_gpu_sm90_tests: a kernel that holds most of the GPU's multiprocessors,
// as another engine's kernel on another stream would, so that a kernel launched beside it gets
// only the rest.
#pragma once

#include <cuda_runtime_api.h>

struct SmOccupier {
  int ctas = 0;
  volatile int* running = nullptr;  // host-mapped, [ctas]: 1 while CTA i holds its SM
  volatile int* release = nullptr;  // host-mapped: 1 lets every CTA exit
  void* mem = nullptr;              // the pinned allocation behind both
  int* relay = nullptr;             // device memory: CTA 0 passes `release` on to the others
};

// Launches one CTA on each of all but `free_sms` multiprocessors of the current device on `st`
// (each takes nearly all of its multiprocessor's shared memory, so no CTA that needs a few KB of
// it fits beside) and returns once every CTA runs, or an error (nothing left running or
// allocated) after 5 s. Only CTA 0 reads the host flag (every 1 us); the others poll device
// memory, so the occupier does not load the bus that carries the next launch. The CTAs spin until
// sm_occupier_release(), or until `limit_ms` have passed (a test that fails early still ends).
cudaError_t sm_occupier_start(int free_sms, int limit_ms, cudaStream_t st, SmOccupier* o);
// Lets the CTAs exit and frees the flags once they have (synchronizes `st`).
cudaError_t sm_occupier_release(SmOccupier* o, cudaStream_t st);
