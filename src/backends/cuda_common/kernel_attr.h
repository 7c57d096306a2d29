// Setting a kernel's function attributes once per (kernel, device), for launchers that run per
// layer: cudaFuncSetAttribute is a driver call, and an attribute is per function and device
// (host code, header-only, safe to call from several threads).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace attnrt_cuda_common {

// Sets Kernel's attribute Attr to `value` on the current device the first time it is called
// there; later calls read one atomic. `value` must be the same on every call for one (Kernel,
// Attr). Devices past the 64th are set on every call; a cudaDeviceReset in the process is not
// seen (attnrt never resets a device).
template <auto Kernel, cudaFuncAttribute Attr>
cudaError_t set_attribute_once(int value) {
  static std::atomic<uint64_t> done{0};  // bit d: device d is set
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(Kernel, Attr, value);
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  return e;
}

// The dynamic shared memory a launch of Kernel may ask for (above the default 48 KB).
template <auto Kernel>
cudaError_t raise_smem_limit(int bytes) {
  return set_attribute_once<Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize>(bytes);
}

}  // namespace attnrt_cuda_common
