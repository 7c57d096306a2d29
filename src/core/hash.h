// 64-bit FNV-1a style hasher over plain values, for plan-cache and canary keys.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace attnrt {

class Hasher {
 public:
  template <typename T>
  Hasher& add(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    return add_bytes(&v, sizeof(T));
  }
  template <typename T>
  Hasher& add_span(const T* p, size_t n) {
    add(n);
    return add_bytes(p, n * sizeof(T));
  }
  Hasher& add_bytes(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
      h_ ^= b[i];
      h_ *= 0x100000001b3ull;
    }
    return *this;
  }
  uint64_t value() const { return h_ ^ (h_ >> 29); }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

}  // namespace attnrt
