// The attention tensors of a run as the CUDA kernels read them: data pointers and element
// strides. Each plugin's kernel-argument struct derives from AttendTensors, and attend_tensors()
// is the one place that fills it from the plugin ABI's attnrt_tensors (host and device code,
// header-only).
#pragma once

#include <attnrt/plugin.h>

#include <cstdint>

namespace attnrt_cuda_common {

struct AttendTensors {
  const void* q;        // [T, Hq, D]
  const void* kc;       // [pages, page_size, Hkv, D]
  const void* vc;
  void* out;            // [T, Hq, D]
  float* lse;           // [T, Hq]; null unless the problem writes lse
  const float* sink;    // [Hq]; null unless the problem has a sink
  const int32_t* topk;  // [H_idx, T, K]; null for dense ops
  int64_t q_s0, q_s1, o_s0, o_s1, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, lse_s0, t_s0, t_s1, t_s2;
};

inline AttendTensors attend_tensors(const attnrt_tensors& t, const attnrt_problem& p) {
  AttendTensors a{};
  a.q = t.q.data;
  a.kc = t.k_cache.data;
  a.vc = t.v_cache.data;
  a.out = t.out.data;
  a.lse = p.write_lse ? static_cast<float*>(t.lse.data) : nullptr;
  a.sink = p.has_sink ? static_cast<const float*>(t.sink.data) : nullptr;
  a.topk = static_cast<const int32_t*>(t.topk.data);
  a.q_s0 = t.q.strides[0];
  a.q_s1 = t.q.strides[1];
  a.o_s0 = t.out.strides[0];
  a.o_s1 = t.out.strides[1];
  a.k_s0 = t.k_cache.strides[0];
  a.k_s1 = t.k_cache.strides[1];
  a.k_s2 = t.k_cache.strides[2];
  a.v_s0 = t.v_cache.strides[0];
  a.v_s1 = t.v_cache.strides[1];
  a.v_s2 = t.v_cache.strides[2];
  a.lse_s0 = a.lse ? t.lse.strides[0] : 0;
  a.t_s0 = t.topk.strides[0];
  a.t_s1 = t.topk.strides[1];
  a.t_s2 = t.topk.strides[2];
  return a;
}

}  // namespace attnrt_cuda_common
