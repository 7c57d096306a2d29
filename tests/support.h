// Test support shared by every test file: random tensors that own their storage, poisoning,
// comparisons. One place for each of these; add to it rather than writing a local copy.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "attnrt/attnrt.h"
#include "core/backend.h"

namespace attnrt::test {

// A host tensor that owns its (contiguous) storage.
struct HostTensor {
  std::vector<unsigned char> bytes;
  TensorView view;
  HostTensor() = default;
  HostTensor(DType dtype, std::initializer_list<int64_t> shape);
  float get(int64_t i) const { return load_as_f32(view.data, view.dtype, i); }
  void set(int64_t i, float v) { store_from_f32(view.data, view.dtype, i, v); }
  int64_t numel() const { return view.numel(); }
};

// Fills with N(0, stddev) values rounded to the dtype.
void fill_normal(HostTensor& t, std::mt19937_64& rng, float stddev = 1.0f);
// Fills with NaN (float dtypes) or 0x7f7f7f7f (i32) so unwritten elements show.
void poison(HostTensor& t);
// True if any element is NaN (float dtypes).
bool has_nan(const HostTensor& t);
// ||a-b|| / ||b|| over all elements.
double rel_l2(const HostTensor& a, const HostTensor& b);
// max |a-b|.
double max_abs_diff(const HostTensor& a, const HostTensor& b);
// Fraction-free elementwise allclose: |a-b| <= atol + rtol*|b| for all; NaN fails.
bool allclose(const HostTensor& a, const HostTensor& b, double rtol, double atol);
// Host memory for a Workspace of a test that drives a backend directly (no Runtime).
struct HostMemory : DeviceMemory {
  void* alloc(size_t n) override { return std::aligned_alloc(64, (n + 63) / 64 * 64); }
  void free(void* p) noexcept override { std::free(p); }
};
// A fresh seed for each call (time-based), printed by the caller on failure.
uint64_t fresh_seed();

}  // namespace attnrt::test
