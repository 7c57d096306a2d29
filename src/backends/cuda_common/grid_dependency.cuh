// Programmatic dependent launch (sm_90), shared by the CUDA plugins (device code only,
// header-only). A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may
// start while the kernel before it in the stream still runs, once every CTA of that kernel has
// called grid_launch_dependents() (or exited); it must call grid_dependency_wait() before it
// touches anything the earlier kernel writes. Both are no-ops for a kernel launched plainly.
#pragma once

namespace attnrt_cuda_common {

// Blocks until the preceding kernel has completed and its memory writes are visible.
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Lets the next kernel (if launched as a programmatic dependent) start its CTAs early.
__device__ __forceinline__ void grid_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace attnrt_cuda_common
