// The softmax state every CUDA attention kernel keeps per query row, in the log2 domain: m, the
// running max of score x log2(e), and l, the sum of exp2(score x log2(e) - m). Two things each
// kernel does with it at the end, written once here (device code only, header-only).
#pragma once

#include <cmath>

namespace attnrt_cuda_common {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Folds a sink logit (natural-log units) into the row's state: afterwards l also counts
// exp(sink). Returns the factor the row's accumulated output must take (0 for a row with no key).
__device__ __forceinline__ float fold_sink(float& m, float& l, float sink) {
  const float s2 = sink * kLog2e;
  const float mn = fmaxf(m, s2);
  const float c = m == -INFINITY ? 0.f : exp2f(m - mn);
  l = l * c + exp2f(s2 - mn);
  m = mn;
  return c;
}

// The row's log-sum-exp in natural-log units; -inf (never NaN) for a row with no mass.
__device__ __forceinline__ float natural_lse(float m, float l) {
  return l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// The row's log-sum-exp in the log2 domain (split partials merged later); -inf for no mass.
__device__ __forceinline__ float log2_lse(float m, float l) {
  return l > 0.f ? m + log2f(l) : -INFINITY;
}

}  // namespace attnrt_cuda_common
