// The cpu backend: tiled flash attention on host memory, threads and SIMD.
#pragma once

#include <memory>

#include "core/backend.h"
#include "core/cpu_dispatch.h"

namespace attnrt {

// num_threads <= 0: all cores. isa: the kernel set (vector width and register blocking), fixed
// for the backend's lifetime; InvalidArgument when the CPU lacks it.
std::unique_ptr<Backend> make_cpu_backend(int num_threads, CpuIsa isa = best_cpu_isa());

}  // namespace attnrt
