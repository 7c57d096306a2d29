#include "attnrt/types.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <sstream>

#include "attnrt/errors.h"

namespace attnrt {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::i32: return 4;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
  }
  return "?";
}

DType parse_dtype(std::string_view s, std::string_view field) {
  if (s == "f32" || s == "float32" || s == "fp32") return DType::f32;
  if (s == "f16" || s == "float16" || s == "fp16") return DType::f16;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "i32" || s == "int32") return DType::i32;
  throw InvalidArgument(std::string(field) + ": unknown dtype '" + std::string(s) +
                        "' (expected f32, f16 or bf16)");
}

Device Device::parse(std::string_view s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.substr(0, 5) == "cuda:" && s.size() > 5) {
    int idx = 0;
    for (char c : s.substr(5)) {
      if (c < '0' || c > '9' || idx > 100000)
        throw InvalidArgument("device: '" + std::string(s) + "' is not a device (expected cpu or cuda:N)");
      idx = idx * 10 + (c - '0');
    }
    return Device::cuda(idx);
  }
  throw InvalidArgument("device: '" + std::string(s) + "' is not a device (expected cpu or cuda:N)");
}

std::string Device::str() const {
  if (kind == DeviceKind::cpu) return "cpu";
  return "cuda:" + std::to_string(index);
}

TensorView TensorView::contiguous(void* data, DType dtype, Device device,
                                  std::initializer_list<int64_t> shape) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.rank = static_cast<int>(shape.size());
  if (t.rank > kMaxRank) throw InvalidArgument("tensor rank " + std::to_string(t.rank) + " > 4");
  int i = 0;
  for (int64_t d : shape) t.shape[i++] = d;
  int64_t s = 1;
  for (int d = t.rank - 1; d >= 0; --d) {
    t.strides[d] = s;
    s *= t.shape[d];
  }
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != s) return false;
    s *= shape[d];
  }
  return true;
}

int64_t TensorView::offset(std::initializer_list<int64_t> idx) const {
  int64_t o = 0;
  int d = 0;
  for (int64_t i : idx) o += i * strides[d++];
  return o;
}

std::string TensorView::shape_str() const {
  std::ostringstream os;
  os << '[';
  for (int d = 0; d < rank; ++d) os << (d ? ", " : "") << shape[d];
  os << ']';
  return os.str();
}

uint16_t f32_to_bf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet NaN
  uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return static_cast<uint16_t>(x >> 16);
}

float bf16_to_f32(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint16_t f32_to_f16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (ax < 0x38800000u) {
    // Subnormal (or zero) in f16: value = ax_float / 2^-24, rounded to nearest even.
    float a = std::bit_cast<float>(ax);
    float scaled = a * 16777216.0f;  // 2^24, exact
    float r = std::nearbyint(scaled);  // default rounding mode: nearest even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));
  }
  uint32_t mant = ax & 0x7fffffu;
  uint32_t exp = (ax >> 23) - 127 + 15;
  uint32_t h = (exp << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: fine
  return static_cast<uint16_t>(sign | h);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

float load_as_f32(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::i32: return static_cast<float>(static_cast<const int32_t*>(base)[i]);
  }
  return 0.0f;
}

void store_from_f32(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::f32: static_cast<float*>(base)[i] = v; return;
    case DType::f16: static_cast<uint16_t*>(base)[i] = f32_to_f16(v); return;
    case DType::bf16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(v); return;
    case DType::i32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
  }
}

}  // namespace attnrt
