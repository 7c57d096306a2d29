#include "support.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

namespace attnrt::test {

HostTensor::HostTensor(DType dtype, std::initializer_list<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  bytes.assign(static_cast<size_t>(n) * dtype_size(dtype) + 64, 0);
  view = TensorView::contiguous(bytes.data(), dtype, Device::cpu(), shape);
}

void fill_normal(HostTensor& t, std::mt19937_64& rng, float stddev) {
  std::normal_distribution<float> nd(0.0f, stddev);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, nd(rng));
}

void poison(HostTensor& t) {
  if (t.view.dtype == DType::i32) {
    std::memset(t.bytes.data(), 0x7f, t.bytes.size());
    return;
  }
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, std::numeric_limits<float>::quiet_NaN());
}

bool has_nan(const HostTensor& t) {
  if (t.view.dtype == DType::i32) return false;
  for (int64_t i = 0; i < t.numel(); ++i)
    if (std::isnan(t.get(i))) return true;
  return false;
}

double rel_l2(const HostTensor& a, const HostTensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    double d = static_cast<double>(a.get(i)) - b.get(i);
    num += d * d;
    den += static_cast<double>(b.get(i)) * b.get(i);
  }
  if (std::isnan(num)) return std::numeric_limits<double>::infinity();
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double max_abs_diff(const HostTensor& a, const HostTensor& b) {
  double m = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    double d = std::fabs(static_cast<double>(a.get(i)) - b.get(i));
    if (std::isnan(d)) return std::numeric_limits<double>::infinity();
    m = std::max(m, d);
  }
  return m;
}

bool allclose(const HostTensor& a, const HostTensor& b, double rtol, double atol) {
  for (int64_t i = 0; i < b.numel(); ++i) {
    double x = a.get(i), y = b.get(i);
    if (std::isnan(x) || std::isnan(y)) return false;
    if (std::fabs(x - y) > atol + rtol * std::fabs(y)) return false;
  }
  return true;
}

uint64_t fresh_seed() {
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

}  // namespace attnrt::test
