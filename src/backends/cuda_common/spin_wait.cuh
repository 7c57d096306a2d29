// Device-side helpers for kernels whose CTAs wait for each other through global memory
// (header-only, device code): the clock of the GPU and a watchdog for such waits.
//
// A CTA that polls a counter its co-resident peers advance gets its answer within milliseconds;
// one that is still waiting after kSpinWatchdogNs waits for a peer that will never come (a bug).
// SpinWatch says so, so that the kernel can record where and stop with a trap: the caller then
// gets an error instead of a device spinning forever.
#pragma once

#include <cstdint>

namespace attnrt_cuda_common {

constexpr uint64_t kSpinWatchdogNs = 10ull * 1000 * 1000 * 1000;  // 10 s

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One wait's clock: expired() is false until kSpinWatchdogNs after its first call.
struct SpinWatch {
  uint64_t start = 0;
  __device__ __forceinline__ bool expired() {
    const uint64_t t = globaltimer_ns();
    if (start == 0) start = t;
    return t - start > kSpinWatchdogNs;
  }
};

}  // namespace attnrt_cuda_common
