// The cpu backend: tiled flash attention on host memory, threads and SIMD.
#pragma once

#include <memory>

#include "core/backend.h"

namespace attnrt {

// num_threads <= 0: all cores.
std::unique_ptr<Backend> make_cpu_backend(int num_threads);

}  // namespace attnrt
