// Reads `bytes` (a multiple of 16) at device address `p` on `st`, which leaves L2 holding clean
// lines of that buffer; `sink` is one device word the kernel may write.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

cudaError_t l2_read_flush(const void* p, size_t bytes, unsigned* sink, cudaStream_t st);
