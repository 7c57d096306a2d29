// Bench helper of attnrt_gpu_sm90_tests: evicts L2 by reading a buffer, so that L2 is left
// holding clean lines (a memset leaves it full of dirty ones, which the timed kernel then pays
// to write back as it evicts them).
#include "l2_read_flush.h"

namespace {

__global__ void read_all(const uint4* p, size_t n, unsigned* sink) {
  unsigned x = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) atomicAdd(sink, 1u);  // a use of every load, practically never taken
}

}  // namespace

cudaError_t l2_read_flush(const void* p, size_t bytes, unsigned* sink, cudaStream_t st) {
  read_all<<<1024, 256, 0, st>>>(static_cast<const uint4*>(p), bytes / sizeof(uint4), sink);
  return cudaGetLastError();
}
