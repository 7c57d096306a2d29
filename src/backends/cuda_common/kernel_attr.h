// Preparing kernels once per (kernel, device), for launchers that run per layer: loading a
// kernel's code and setting its function attributes are driver calls, done the first time on
// each device and later skipped after one atomic read (host code, header-only, safe to call
// from several threads).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace attnrt_cuda_common {

// Runs f() on the current device unless an earlier call with the same `done` succeeded there.
// Devices past the 64th run it on every call; a cudaDeviceReset in the process is not seen
// (attnrt never resets a device).
template <class F>
cudaError_t once_per_device(std::atomic<uint64_t>& done, F f) {
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  const cudaError_t e = f();
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  return e;
}

// Sets Kernel's attribute Attr to `value` on the current device the first time it is called
// there. `value` must be the same on every call for one (Kernel, Attr).
template <auto Kernel, cudaFuncAttribute Attr>
cudaError_t set_attribute_once(int value) {
  static std::atomic<uint64_t> done{0};  // bit d: device d is set
  return once_per_device(done, [&] { return cudaFuncSetAttribute(Kernel, Attr, value); });
}

// The dynamic shared memory a launch of Kernel may ask for (above the default 48 KB).
template <auto Kernel>
cudaError_t raise_smem_limit(int bytes) {
  return set_attribute_once<Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize>(bytes);
}

// Loads the code of every one of Kernels on the current device, once. CUDA loads modules
// lazily by default (since 12.2): a kernel never loaded loads at its first launch, and a load
// may wait for the whole context, for kernels running on other streams too, such as a
// collective that waits for other ranks (a hang). A plugin's plan() calls this for every kernel
// its run() may launch, so that run() never loads code.
template <auto... Kernels>
cudaError_t load_kernels() {
  static std::atomic<uint64_t> done{0};  // bit d: loaded on device d
  return once_per_device(done, [] {
    cudaError_t e = cudaSuccess;
    cudaFuncAttributes attr{};
    ((e = e == cudaSuccess ? cudaFuncGetAttributes(&attr, Kernels) : e), ...);
    return e;
  });
}

}  // namespace attnrt_cuda_common
