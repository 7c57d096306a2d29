// Raising a kernel's dynamic shared-memory limit once per (kernel, device), for launchers that run
// per layer: cudaFuncSetAttribute is a driver call, and the attribute is per function and device
// (host code, header-only, safe to call from several threads).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace attnrt_cuda_common {

// Sets Kernel's cudaFuncAttributeMaxDynamicSharedMemorySize to `bytes` on the current device the
// first time it is called there; later calls read one atomic. `bytes` must be the same on every
// call for one Kernel. Devices past the 64th are set on every call; a cudaDeviceReset in the
// process is not seen (attnrt never resets a device).
template <auto Kernel>
cudaError_t raise_smem_limit(int bytes) {
  static std::atomic<uint64_t> done{0};  // bit d: device d is set
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  const cudaError_t e =
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  return e;
}

}  // namespace attnrt_cuda_common
