// Core types: rounding conversions against exact rules, devices, tensor views, op names and
// problem signatures.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "support.h"

namespace attnrt {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// bf16 by an independent rule: the two neighbours and a tie broken to the even mantissa.
uint16_t bf16_rne_naive(float f) {
  const uint32_t u = bits(f);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double d = f, dlo = from_bits(uint32_t{lo} << 16), dhi = from_bits(uint32_t{hi} << 16);
  const double elo = std::fabs(d - dlo), ehi = std::fabs(dhi - d);
  if (elo < ehi) return lo;
  if (ehi < elo) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(Types, Bf16RoundsToNearestEven) {
  std::mt19937_64 rng(test::fresh_seed());
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = static_cast<uint32_t>(rng());
    const float f = from_bits(u);
    if (!std::isfinite(f) || std::fabs(f) > 3.0e38f) continue;
    ASSERT_EQ(f32_to_bf16(f), bf16_rne_naive(f)) << std::hex << u;
  }
  // Exact ties: 1 + 2^-8 lies between 1 and 1 + 2^-7: rounds to even (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(INFINITY)), INFINITY);
}

TEST(Types, F16RoundsToNearestEvenIncludingSubnormalsAndOverflow) {
  // Every f16 value converts to f32 and back exactly.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), h) << std::hex << h;
  }
  // Midpoints between neighbouring finite f16 values round to the even one.
  for (uint32_t h = 0; h < 0x7bff; h += 7) {
    const double a = f16_to_f32(static_cast<uint16_t>(h)), b = f16_to_f32(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((a + b) / 2);
    ASSERT_EQ(f32_to_f16(mid), (h & 1) ? h + 1 : h) << std::hex << h;
  }
  EXPECT_EQ(f16_to_f32(f32_to_f16(65520.0f)), INFINITY);  // halfway to 2^16 rounds up
  EXPECT_EQ(f16_to_f32(f32_to_f16(65519.0f)), 65504.0f);
  EXPECT_EQ(f32_to_f16(1e-9f), 0);
  EXPECT_EQ(f16_to_f32(f32_to_f16(-2.0f)), -2.0f);
}

TEST(Types, DeviceParseAndErrors) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu());
  EXPECT_EQ(Device::parse("cuda:3"), Device::cuda(3));
  EXPECT_EQ(Device::cuda(1).str(), "cuda:1");
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:x", ""}) {
    try {
      Device::parse(bad);
      ADD_FAILURE() << bad;
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("device"));
    }
  }
}

TEST(Types, TensorViewOffsetsAndContiguity) {
  float buf[24];
  TensorView t = TensorView::contiguous(buf, DType::f32, Device::cpu(), {2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.offset({1, 2, 3}), 23);
  EXPECT_EQ(t.shape_str(), "[2, 3, 4]");
  t.strides[0] = 20;
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.offset({1, 0, 1}), 21);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(parse_dtype("bf16", "x"), DType::bf16);
  EXPECT_THROW(parse_dtype("fp8", "--dtype"), InvalidArgument);
}

TEST(Problem, OpNamesRoundTrip) {
  for (int i = 0; i < kNumOps; ++i)
    EXPECT_EQ(parse_op(op_name(static_cast<Op>(i))), static_cast<Op>(i));
  EXPECT_EQ(parse_op("sparse_decode"), Op::sparse_decode);
  EXPECT_THROW(parse_op("sparse_fused"), InvalidArgument);
}

// sparse_decode uses every field of sparse_index_decode and of sparse_attend_decode: a change of
// any of them gives another signature (plan cache and canary keys), and describe() names each.
TEST(Problem, SparseDecodeSignatureAndDescribeCoverEveryField) {
  Problem p;
  p.op = Op::sparse_decode;
  p.num_q_heads = 8;
  p.num_kv_heads = 2;
  p.head_dim = 64;
  p.num_index_heads = 2;
  p.index_dim = 32;
  p.block_size = 16;
  p.topk = 4;
  p.local_blocks = 1;
  const std::vector<std::pair<const char*, std::function<void(Problem&)>>> changes = {
      {"q_dtype", [](Problem& x) { x.q_dtype = DType::bf16; }},
      {"kv_dtype", [](Problem& x) { x.kv_dtype = DType::bf16; }},
      {"page_size", [](Problem& x) { x.page_size = 32; }},
      {"num_q_heads", [](Problem& x) { x.num_q_heads = 16; }},
      {"num_kv_heads", [](Problem& x) { x.num_kv_heads = 1; }},
      {"head_dim", [](Problem& x) { x.head_dim = 128; }},
      {"sm_scale", [](Problem& x) { x.sm_scale = 0.5f; }},
      {"has_sink", [](Problem& x) { x.has_sink = true; }},
      {"write_lse", [](Problem& x) { x.write_lse = true; }},
      {"num_index_heads", [](Problem& x) { x.num_index_heads = 4; }},
      {"index_dim", [](Problem& x) { x.index_dim = 64; }},
      {"block_size", [](Problem& x) { x.block_size = 32; }},
      {"topk", [](Problem& x) { x.topk = 8; }},
      {"init_blocks", [](Problem& x) { x.init_blocks = 1; }},
      {"local_blocks", [](Problem& x) { x.local_blocks = 2; }},
      {"score_type", [](Problem& x) { x.score_type = ScoreType::lse; }},
      {"index_scale", [](Problem& x) { x.index_scale = 0.25f; }},
  };
  for (const auto& [field, change] : changes) {
    Problem q = p;
    change(q);
    EXPECT_NE(q.signature(), p.signature()) << field;
    EXPECT_NE(q.describe(), p.describe()) << field;
  }
  Problem index = p, attend = p;
  index.op = Op::sparse_index_decode;
  attend.op = Op::sparse_attend_decode;
  EXPECT_NE(p.signature(), index.signature());
  EXPECT_NE(p.signature(), attend.signature());
  EXPECT_THAT(p.describe(), ::testing::HasSubstr("sparse_decode on cpu"));
}

}  // namespace
}  // namespace attnrt
