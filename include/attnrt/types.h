// attnrt core value types: element types, devices and non-owning strided tensor views.
//
// A TensorView never owns memory. Shapes and strides are in elements (not bytes); rank <= 4.
// Conversions between f32 and f16/bf16 round to nearest, ties to even, and keep NaN a NaN.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace attnrt {

enum class DType : uint8_t { f32 = 0, f16 = 1, bf16 = 2, i32 = 3 };

// Bytes per element of `t`.
size_t dtype_size(DType t);
// "f32", "f16", "bf16", "i32".
const char* dtype_name(DType t);
// Parses a name printed by dtype_name (also "float32", "float16", "bfloat16").
// Throws InvalidArgument naming `field` when `s` is not a dtype.
DType parse_dtype(std::string_view s, std::string_view field = "dtype");

enum class DeviceKind : uint8_t { cpu = 0, cuda = 1 };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;

  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int i) { return {DeviceKind::cuda, i}; }
  // Parses "cpu", "cuda", "cuda:N". Throws InvalidArgument on anything else.
  static Device parse(std::string_view s);
  // "cpu" or "cuda:N".
  std::string str() const;
  bool is_host() const { return kind == DeviceKind::cpu; }
  friend bool operator==(const Device&, const Device&) = default;
  friend auto operator<=>(const Device&, const Device&) = default;
};

constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> strides{};  // in elements

  // A contiguous (row-major) view over `data`.
  static TensorView contiguous(void* data, DType dtype, Device device,
                               std::initializer_list<int64_t> shape);
  bool defined() const { return data != nullptr; }
  int64_t numel() const;
  bool is_contiguous() const;
  // Element offset of a multi-index (size == rank).
  int64_t offset(std::initializer_list<int64_t> idx) const;
  // "[2, 3, 4]"
  std::string shape_str() const;
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// Round-to-nearest-even conversions.
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);
float bf16_to_f32(uint16_t b);

// Reads element `i` (linear element offset) of a float tensor of dtype `t` as f32.
float load_as_f32(const void* base, DType t, int64_t i);
// Stores `v` rounded to dtype `t` at linear element offset `i`.
void store_from_f32(void* base, DType t, int64_t i, float v);

}  // namespace attnrt
