// A kernel that holds multiprocessors until released (sm_occupier.h).
#include "sm_occupier.h"

#include <chrono>
#include <cstdint>
#include <thread>

namespace {

__device__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void occupy(volatile int* running, volatile int* release, volatile int* relay,
                       uint64_t limit_ns) {
  extern __shared__ unsigned char held[];
  if (threadIdx.x != 0) return;
  held[0] = 1;  // the shared memory is the point, not its contents
  running[blockIdx.x] = 1;
  __threadfence_system();
  const uint64_t t0 = now_ns();
  // CTA 0 alone reads the host flag across the bus and relays it through device memory.
  volatile int* flag = blockIdx.x == 0 ? release : relay;
  while (*flag == 0 && now_ns() - t0 <= limit_ns) __nanosleep(1000);
  if (blockIdx.x == 0) *relay = 1;
  running[blockIdx.x] = 0;  // no longer holding its multiprocessor
  __threadfence_system();
}

}  // namespace

cudaError_t sm_occupier_start(int free_sms, int limit_ms, cudaStream_t st, SmOccupier* o) {
  int dev = 0, sms = 0, smem = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return e;
  o->ctas = sms - free_sms;
  if (o->ctas <= 0) return cudaErrorInvalidValue;
  if ((e = cudaHostAlloc(&o->mem, sizeof(int) * (o->ctas + 1), cudaHostAllocMapped)) != cudaSuccess)
    return e;
  int* h = static_cast<int*>(o->mem);
  for (int i = 0; i <= o->ctas; ++i) h[i] = 0;
  o->running = h;
  o->release = h + o->ctas;
  int* d = nullptr;
  if ((e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&d), o->mem, 0)) == cudaSuccess &&
      (e = cudaMalloc(reinterpret_cast<void**>(&o->relay), sizeof(int))) == cudaSuccess &&
      (e = cudaMemsetAsync(o->relay, 0, sizeof(int), st)) == cudaSuccess)  // before the CTAs
    e = cudaFuncSetAttribute(occupy, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess) {
    occupy<<<o->ctas, 32, smem, st>>>(d, d + o->ctas, o->relay,
                                      static_cast<uint64_t>(limit_ms) * 1000 * 1000);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) {
    cudaFree(o->relay);
    o->relay = nullptr;
    cudaFreeHost(o->mem);
    o->mem = nullptr;
    return e;
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    int n = 0;
    for (int i = 0; i < o->ctas; ++i) n += o->running[i];
    if (n == o->ctas) return cudaSuccess;
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(5)) {
      sm_occupier_release(o, st);  // the CTAs that did start exit
      return cudaErrorTimeout;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

cudaError_t sm_occupier_release(SmOccupier* o, cudaStream_t st) {
  if (o->mem == nullptr) return cudaSuccess;
  *o->release = 1;
  const cudaError_t e = cudaStreamSynchronize(st);
  cudaFree(o->relay);
  o->relay = nullptr;
  cudaFreeHost(o->mem);
  o->mem = nullptr;
  return e;
}
