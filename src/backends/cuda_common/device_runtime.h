// Host side shared by the CUDA plugins (header-only): the device table each plugin reads once in
// init(), and the device memory entry points of the plugin ABI on top of the CUDA runtime (linked
// statically into each plugin, so every plugin owns one DeviceRuntime object). Errors go to the
// caller's last-error buffer (err, cap).
#pragma once

#include <attnrt/plugin.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <vector>

namespace attnrt_cuda_common {

// cudaMemcpy from pageable memory and cudaMemset run on the legacy default stream and may still
// be in flight when they return, and a caller's non-blocking stream does not wait for the legacy
// one: host writes that a later launch on any stream must see (plan metadata, counters, a copy
// to the device) end with this.
inline cudaError_t land_host_writes() { return cudaStreamSynchronize(cudaStreamLegacy); }

// update_plan rewrites a plan's device metadata in place while launches already enqueued on any
// stream (a replayed graph) may still read it: wait for the device first, so that no launch sees
// half of the old layout and half of the new.
inline cudaError_t quiesce_before_rewrite() { return cudaDeviceSynchronize(); }

struct DeviceInfo {
  int major = 0, minor = 0, sms = 0;
  int64_t l2_bytes = 0;
  char name[256] = "";
};

class DeviceRuntime {
 public:
  explicit DeviceRuntime(const char* plugin) : plugin_(plugin) {}

  // Reads every device's properties on the first call; later calls repeat the first answer.
  // ATTNRT_UNAVAILABLE with the runtime's reason when there is no driver or no device.
  int32_t init(char* err, size_t cap) {
    if (!done_) {
      done_ = true;
      status_ = discover();
    }
    if (status_ != ATTNRT_OK) std::snprintf(err, cap, "%s", init_error_);
    return status_;
  }
  int32_t device_count(int32_t kind, int32_t* count) const {
    *count = kind == ATTNRT_DEVICE_CUDA && status_ == ATTNRT_OK ? static_cast<int32_t>(devices_.size())
                                                                : 0;
    return ATTNRT_OK;
  }
  // OK when d is a CUDA device found by init(); ATTNRT_UNAVAILABLE with the reason otherwise.
  int32_t check(attnrt_device d, char* err, size_t cap) const {
    if (d.kind != ATTNRT_DEVICE_CUDA)
      return say(err, cap, ATTNRT_UNAVAILABLE, "%s serves cuda devices only", plugin_);
    if (status_ != ATTNRT_OK) return say(err, cap, ATTNRT_UNAVAILABLE, "%s", init_error_);
    if (d.index < 0 || d.index >= static_cast<int>(devices_.size()))
      return say(err, cap, ATTNRT_UNAVAILABLE, "cuda:%d does not exist (%zu CUDA devices)", d.index,
                 devices_.size());
    return ATTNRT_OK;
  }
  // Valid after check(d) returned OK.
  const DeviceInfo& info(int index) const { return devices_[index]; }

  int32_t alloc(attnrt_device d, size_t bytes, void** out, char* err, size_t cap) const {
    if (int32_t s = check(d, err, cap); s != ATTNRT_OK) return s;
    return call(err, cap, "cudaMalloc", d, [&] { return cudaMalloc(out, std::max<size_t>(bytes, 1)); });
  }
  int32_t free(attnrt_device d, void* ptr, char* err, size_t cap) const {
    if (int32_t s = check(d, err, cap); s != ATTNRT_OK) return s;
    return call(err, cap, "cudaFree", d, [&] { return cudaFree(ptr); });
  }
  int32_t to_device(attnrt_device d, void* dst, const void* src, size_t bytes, char* err,
                    size_t cap) const {
    if (int32_t s = check(d, err, cap); s != ATTNRT_OK) return s;
    return call(err, cap, "cudaMemcpy to device", d,
                [&] {
                  const cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
                  return e == cudaSuccess ? land_host_writes() : e;
                });
  }
  int32_t to_host(attnrt_device d, void* dst, const void* src, size_t bytes, char* err,
                  size_t cap) const {
    if (int32_t s = check(d, err, cap); s != ATTNRT_OK) return s;
    return call(err, cap, "cudaMemcpy to host", d,
                [&] { return cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost); });
  }
  int32_t synchronize(attnrt_device d, char* err, size_t cap) const {
    if (int32_t s = check(d, err, cap); s != ATTNRT_OK) return s;
    return call(err, cap, "cudaDeviceSynchronize", d, [] { return cudaDeviceSynchronize(); });
  }

  static int32_t say(char* err, size_t cap, int32_t status, const char* fmt, ...)
      __attribute__((format(printf, 4, 5))) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return status;
  }

 private:
  int32_t discover() {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e == cudaErrorNoDevice || (e == cudaSuccess && count == 0)) {
      std::snprintf(init_error_, sizeof init_error_, "no CUDA device");
      return ATTNRT_UNAVAILABLE;
    }
    if (e != cudaSuccess) {
      std::snprintf(init_error_, sizeof init_error_, "no CUDA driver: %s (%s)", cudaGetErrorName(e),
                    cudaGetErrorString(e));
      return ATTNRT_UNAVAILABLE;
    }
    devices_.resize(count);
    for (int i = 0; i < count; ++i) {
      cudaDeviceProp prop{};
      if ((e = cudaGetDeviceProperties(&prop, i)) != cudaSuccess) {
        std::snprintf(init_error_, sizeof init_error_, "cudaGetDeviceProperties(%d): %s", i,
                      cudaGetErrorString(e));
        devices_.clear();
        return ATTNRT_UNAVAILABLE;
      }
      devices_[i].major = prop.major;
      devices_[i].minor = prop.minor;
      devices_[i].sms = prop.multiProcessorCount;
      devices_[i].l2_bytes = prop.l2CacheSize;
      std::snprintf(devices_[i].name, sizeof devices_[i].name, "%s", prop.name);
    }
    return ATTNRT_OK;
  }
  // Runs a CUDA call on device d; ATTNRT_INTERNAL with the runtime's error if it fails.
  template <class F>
  static int32_t call(char* err, size_t cap, const char* what, attnrt_device d, F f) {
    cudaError_t e = cudaSetDevice(d.index);
    if (e == cudaSuccess) e = f();
    if (e == cudaSuccess) return ATTNRT_OK;
    return say(err, cap, ATTNRT_INTERNAL, "%s: %s (%s)", what, cudaGetErrorName(e),
               cudaGetErrorString(e));
  }

  const char* plugin_;
  bool done_ = false;
  int32_t status_ = ATTNRT_UNAVAILABLE;
  char init_error_[512] = "";
  std::vector<DeviceInfo> devices_;
};

// Allocates device room for max(count, capacity, 1) elements and copies the first `count` from
// the host (plans keep room to grow in place). ATTNRT_INTERNAL with the runtime's error on failure.
template <typename T>
int32_t upload(T** dst, const T* src, size_t count, size_t capacity, char* err, size_t cap) {
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(dst), sizeof(T) * std::max<size_t>({count, capacity, 1}));
  if (e == cudaSuccess && count > 0) e = cudaMemcpy(*dst, src, sizeof(T) * count, cudaMemcpyHostToDevice);
  if (e == cudaSuccess && count > 0) e = land_host_writes();
  if (e == cudaSuccess) return ATTNRT_OK;
  return DeviceRuntime::say(err, cap, ATTNRT_INTERNAL, "upload of %zu elements: %s (%s)", count,
                            cudaGetErrorName(e), cudaGetErrorString(e));
}

}  // namespace attnrt_cuda_common
