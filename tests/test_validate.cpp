// Every input rule of design.md §3, through the public Runtime: the call throws InvalidArgument
// and the message names the request (where there is one), the field, the value and what was
// expected. A valid baseline runs first so that each test changes exactly one thing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "support.h"

namespace attnrt {
namespace {

using test::HostTensor;
using ::testing::AllOf;
using ::testing::HasSubstr;

RuntimeOptions host_only() {
  RuntimeOptions o;
  o.plugin_path = "";
  o.search_library_dir = false;
  o.disable = std::vector<std::string>{};
  o.force_backend = "";
  return o;
}

// A small valid call of `op`; tests break one field and expect the matching message.
struct Call {
  Problem p;
  BatchLayout layout;
  HostTensor q, k, v, out, lse, sink, iq, ik, topk;

  explicit Call(Op op) {
    p.op = op;
    p.page_size = 4;
    p.num_q_heads = 4;
    p.num_kv_heads = 2;
    p.head_dim = 8;
    p.write_lse = true;
    p.has_sink = true;
    p.num_index_heads = 2;
    p.index_dim = 8;
    p.block_size = 4;
    p.topk = 2;
    p.init_blocks = 1;
    p.local_blocks = 1;
    if (!reads_attention_inputs(p.op)) p.write_lse = p.has_sink = false;
    const bool dec = is_decode(op);
    layout = BatchLayout::make(4, {dec ? 1 : 3, 1}, {9, 5}, {{5, 1, 3}, {0, 2}});
    const int64_t T = layout.total_q();
    std::mt19937_64 rng(7);
    q = HostTensor(DType::f32, {T, 4, 8});
    k = HostTensor(DType::f32, {6, 4, 2, 8});
    v = HostTensor(DType::f32, {6, 4, 2, 8});
    out = HostTensor(DType::f32, {T, 4, 8});
    lse = HostTensor(DType::f32, {T, 4});
    sink = HostTensor(DType::f32, {4});
    iq = HostTensor(DType::f32, {T, 2, 8});
    ik = HostTensor(DType::f32, {6, 4, 1, 8});
    topk = HostTensor(DType::i32, {2, T, 2});
    for (HostTensor* t : {&q, &k, &v, &sink, &iq, &ik}) test::fill_normal(*t, rng);
    // Valid selections: block 0 for every row (always visible).
    for (int64_t i = 0; i < topk.numel(); ++i) topk.view.ptr<int32_t>()[i] = (i % 2 == 0) ? 0 : -1;
  }

  Tensors tensors() const {
    Tensors t;
    if (reads_index_inputs(p.op)) {
      t.index_q = iq.view;
      t.index_k_cache = ik.view;
    }
    if (reads_attention_inputs(p.op)) {
      t.q = q.view;
      t.k_cache = k.view;
      t.v_cache = v.view;
      t.out = out.view;
      if (p.write_lse) t.lse = lse.view;
      if (p.has_sink) t.sink = sink.view;
    }
    if (!is_dense(p.op)) t.topk = topk.view;
    return t;
  }
};

void expect_invalid(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected InvalidArgument containing '" << parts.front() << "'";
  } catch (const InvalidArgument& e) {
    for (const auto& s : parts) EXPECT_THAT(e.what(), HasSubstr(s));
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected InvalidArgument, got another error: " << e.what();
  }
}

class Validate : public ::testing::Test {
 protected:
  Runtime rt{host_only()};
  void expect_call_invalid(const Call& c, const std::vector<std::string>& parts) {
    expect_invalid([&] { rt.execute(c.p, c.layout, c.tensors()); }, parts);
  }
};

TEST_F(Validate, BaselinesAreValidForEveryOp) {
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    Call c(op);
    EXPECT_NO_THROW(rt.execute(c.p, c.layout, c.tensors())) << op_name(op);
  }
}

TEST_F(Validate, ProblemFields) {
  {
    Call c(Op::dense_extend);
    c.p.num_q_heads = 0;
    expect_call_invalid(c, {"num_q_heads 0", "expected > 0"});
  }
  {
    Call c(Op::dense_extend);
    c.p.num_kv_heads = 0;
    expect_call_invalid(c, {"num_kv_heads 0", "expected > 0"});
  }
  {
    Call c(Op::dense_extend);
    c.p.num_q_heads = 6;
    c.p.num_kv_heads = 4;
    expect_call_invalid(c, {"num_q_heads 6 % num_kv_heads 4", "multiple"});
  }
  {
    Call c(Op::dense_decode);
    c.p.head_dim = 1000;
    expect_call_invalid(c, {"head_dim 1000", "expected 1..512"});
  }
  {
    Call c(Op::dense_extend);
    c.p.q_dtype = DType::i32;
    expect_call_invalid(c, {"q_dtype i32", "f32, f16 or bf16"});
  }
  {
    Call c(Op::dense_extend);
    c.p.page_size = 0;
    expect_call_invalid(c, {"page_size 0", "expected > 0"});
  }
  {
    Call c(Op::dense_extend);
    c.p.sm_scale = -1.0f;
    expect_call_invalid(c, {"sm_scale -1", "expected finite >= 0"});
  }
  {
    Call c(Op::sparse_index_extend);
    c.p.topk = 0;
    expect_call_invalid(c, {"topk 0", "expected > 0"});
  }
  {
    Call c(Op::sparse_index_decode);
    c.p.init_blocks = 2;
    c.p.local_blocks = 1;
    expect_call_invalid(c, {"init_blocks 2 + local_blocks 1 > topk 2", "fit in topk"});
  }
  {
    Call c(Op::sparse_index_extend);
    c.p.block_size = 0;
    expect_call_invalid(c, {"block_size 0"});
  }
  {
    Call c(Op::sparse_index_extend);
    c.p.index_dim = 0;
    expect_call_invalid(c, {"index_dim 0", "expected 1..512"});
  }
  {
    Call c(Op::sparse_attend_extend);
    c.p.num_index_heads = 3;
    expect_call_invalid(c, {"num_index_heads 3 % num_kv_heads 2"});
  }
  {
    Call c(Op::dense_extend);
    c.p.op = static_cast<Op>(9);
    expect_call_invalid(c, {"op 9", "expected one of the 7 ops"});
  }
  {
    Call c(Op::dense_decode);
    c.p.kv_dtype = DType::i32;
    expect_call_invalid(c, {"kv_dtype i32", "expected f32, f16 or bf16"});
  }
  for (Op op : {Op::sparse_index_extend, Op::sparse_attend_decode}) {
    Call c(op);
    c.p.num_index_heads = 0;
    expect_call_invalid(c, {"num_index_heads 0", "expected > 0"});
    c.p.num_index_heads = -2;
    expect_call_invalid(c, {"num_index_heads -2", "expected > 0"});
  }
  {
    Call c(Op::sparse_index_extend);
    c.p.init_blocks = -1;
    expect_call_invalid(c, {"init_blocks -1", "expected >= 0"});
  }
  {
    Call c(Op::sparse_index_decode);
    c.p.local_blocks = -3;
    expect_call_invalid(c, {"local_blocks -3", "expected >= 0"});
  }
  {
    Call c(Op::sparse_index_extend);
    c.p.score_type = static_cast<ScoreType>(7);
    expect_call_invalid(c, {"score_type 7", "expected max or lse"});
  }
  {
    Call c(Op::sparse_index_decode);
    c.p.index_scale = -0.5f;
    expect_call_invalid(c, {"index_scale -0.5", "expected finite >= 0"});
    c.p.index_scale = std::numeric_limits<float>::infinity();
    expect_call_invalid(c, {"index_scale inf", "expected finite >= 0"});
    c.p.index_scale = std::numeric_limits<float>::quiet_NaN();
    expect_call_invalid(c, {"index_scale nan", "expected finite >= 0"});
  }
}

TEST_F(Validate, LayoutRules) {
  {
    Call c(Op::dense_extend);
    c.layout = BatchLayout::make(4, {}, {}, {});
    expect_call_invalid(c, {"batch is empty"});
  }
  {
    Call c(Op::dense_extend);
    c.layout = BatchLayout::make(4, {3, 6}, {9, 5}, {{5, 1, 3}, {0, 2}});
    expect_call_invalid(c, {"request 1", "q_len 6 > kv_len 5"});
  }
  {
    Call c(Op::dense_extend);
    c.layout = BatchLayout::make(4, {3, 0}, {9, 5}, {{5, 1, 3}, {0, 2}});
    expect_call_invalid(c, {"request 1", "q_len 0", "expected >= 1"});
  }
  {
    Call c(Op::dense_decode);
    c.layout = BatchLayout::make(4, {2, 1}, {9, 5}, {{5, 1, 3}, {0, 2}});
    expect_call_invalid(c, {"request 0", "q_len 2", "expected 1 for dense_decode"});
  }
  {
    Call c(Op::dense_extend);
    c.layout = BatchLayout::make(4, {3, 1}, {9, 5}, {{5, 1}, {0, 2}});
    expect_call_invalid(c, {"request 0", "page list length 2 < 3", "kv_len 9", "page_size 4"});
  }
  {
    Call c(Op::dense_extend);
    c.layout = BatchLayout::make(4, {3, 1}, {9, 5}, {{5, 1, 3}, {0, -2}});
    expect_call_invalid(c, {"request 1", "page id -2", "expected >= 0"});
  }
  {
    Call c(Op::dense_extend);
    c.layout = BatchLayout::make(4, {3, 1}, {9, 5}, {{5, 1, 3}, {0, 6}});
    expect_call_invalid(c, {"request 1: page id 6 at page_ids[4] >= k_cache pages 6",
                            "expected page ids < the pool's shape[0]"});
  }
  {
    Call c(Op::sparse_index_extend);
    c.layout = BatchLayout::make(4, {3, 1}, {9, 5}, {{5, 1, 9}, {0, 2}});
    expect_call_invalid(c, {"request 0: page id 9 at page_ids[2] >= index_k_cache pages 6"});
  }
  {
    Call c(Op::dense_extend);
    c.layout.page_size = 8;
    expect_call_invalid(c, {"layout.page_size 8 != problem.page_size 4"});
  }
  {
    Call c(Op::dense_extend);
    c.layout.q_indptr[1] = 2;
    expect_call_invalid(c, {"request 0", "q_indptr[1] - q_indptr[0] = 2", "expected q_len 3"});
  }
  {
    Call c(Op::dense_extend);
    c.layout.kv_len.pop_back();
    expect_call_invalid(c, {"kv_len size 1", "expected 2"});
  }
  {
    Call c(Op::dense_extend);
    c.layout.q_indptr.push_back(5);
    expect_call_invalid(c, {"q_indptr size 4", "expected 3"});
  }
  {
    Call c(Op::dense_extend);
    c.layout.page_indptr.pop_back();
    expect_call_invalid(c, {"page_indptr size 2", "expected 3"});
  }
  {
    Call c(Op::dense_extend);
    for (auto& x : c.layout.q_indptr) x += 1;
    expect_call_invalid(c, {"q_indptr[0] 1", "expected 0"});
  }
  {
    Call c(Op::dense_extend);
    c.layout.page_indptr[0] = 1;
    expect_call_invalid(c, {"page_indptr[0] 1", "expected 0"});
  }
  {
    // The end of the page table does not match page_ids (one id too many).
    Call c(Op::dense_extend);
    c.layout.page_ids.push_back(4);
    expect_call_invalid(c, {"page_indptr[2] 5", "expected 6, the size of page_ids"});
  }
  {
    // An offset far past page_ids: reported before any page id is read (no out-of-bounds read).
    Call c(Op::dense_decode);
    c.layout.page_indptr = {0, 200000000, 5};
    expect_call_invalid(c, {"request 1: page_indptr decreases", "page_indptr[1] 200000000",
                            "page_indptr[2] 5", "expected non-decreasing"});
  }
  {
    Call c(Op::sparse_index_extend);
    c.layout.page_indptr = {0, 3, 200000000};
    expect_call_invalid(c, {"page_indptr[2] 200000000", "expected 5, the size of page_ids"});
  }
  {
    Call c(Op::dense_extend);
    c.layout.page_indptr = {0, 4, 3};
    c.layout.page_ids = {5, 1, 3};
    expect_call_invalid(c, {"request 1: page_indptr decreases", "page_indptr[1] 4"});
  }
}

TEST_F(Validate, TensorRules) {
  {
    Call c(Op::dense_extend);
    c.q = HostTensor(DType::bf16, {4, 4, 8});
    expect_call_invalid(c, {"tensor q dtype bf16", "expected f32"});
  }
  {
    Call c(Op::dense_extend);
    Tensors t = c.tensors();
    t.k_cache.device = Device::cuda(0);
    expect_invalid([&] { rt.execute(c.p, c.layout, t); }, {"tensor k_cache device cuda:0", "expected cpu"});
  }
  {
    Call c(Op::dense_extend);
    c.out = HostTensor(DType::f32, {4, 4, 16});
    expect_call_invalid(c, {"tensor out shape [4, 4, 16] dim 2 is 16", "expected 8"});
  }
  {
    Call c(Op::dense_extend);
    c.v = HostTensor(DType::f32, {5, 4, 2, 8});
    expect_call_invalid(c, {"tensor v_cache pages 5", "expected 6"});
  }
  {
    Call c(Op::dense_extend);
    Tensors t = c.tensors();
    t.q = TensorView{};
    expect_invalid([&] { rt.execute(c.p, c.layout, t); }, {"tensor q is missing", "[4, 4, 8]"});
  }
  {
    Call c(Op::dense_extend);
    Tensors t = c.tensors();
    t.out = t.q;
    expect_invalid([&] { rt.execute(c.p, c.layout, t); },
                   {"tensor out aliases q", "expected a separate buffer"});
  }
  {
    Call c(Op::dense_extend);
    Tensors t = c.tensors();
    c.p.write_lse = false;
    expect_invalid([&] { rt.execute(c.p, c.layout, t); }, {"tensor lse is given but write_lse is false"});
  }
  {
    Call c(Op::dense_extend);
    Tensors t = c.tensors();
    t.sink = TensorView{};
    expect_invalid([&] { rt.execute(c.p, c.layout, t); }, {"tensor sink is missing", "expected shape [4]"});
  }
  {
    Call c(Op::dense_extend);
    Tensors t = c.tensors();
    t.q.strides[2] = 2;
    expect_invalid([&] { rt.execute(c.p, c.layout, t); }, {"tensor q last-dim stride 2", "expected 1"});
  }
  {
    Call c(Op::sparse_index_decode);
    c.topk = HostTensor(DType::f32, {2, 2, 2});
    expect_call_invalid(c, {"tensor topk dtype f32", "expected i32"});
  }
  {
    Call c(Op::dense_extend);
    c.q = HostTensor(DType::f32, {4, 32});
    expect_call_invalid(c, {"tensor q rank 2", "shape [4, 32]", "expected rank 3"});
  }
  {
    Call c(Op::sparse_index_extend);
    c.ik = HostTensor(DType::f32, {6, 4, 8});
    expect_call_invalid(c, {"tensor index_k_cache rank 3", "expected rank 4"});
  }
  {
    // The page count of a pool may be anything but negative.
    Call c(Op::dense_extend);
    Tensors t = c.tensors();
    t.k_cache.shape[0] = -6;
    expect_invalid([&] { rt.execute(c.p, c.layout, t); },
                   {"tensor k_cache shape [-6, 4, 2, 8] has a negative extent"});
  }
  {
    Call c(Op::dense_decode);
    Tensors t = c.tensors();
    t.lse = TensorView{};
    expect_invalid([&] { rt.execute(c.p, c.layout, t); }, {"tensor lse is missing", "[2, 4]"});
  }
  {
    Call c(Op::sparse_attend_extend);
    Tensors t = c.tensors();
    c.p.has_sink = false;
    expect_invalid([&] { rt.execute(c.p, c.layout, t); },
                   {"tensor sink is given but has_sink is false", "expected sink iff has_sink"});
  }
}

TEST_F(Validate, SparseSelectionRows) {
  // Row 0 of request 0 is the token at position 6: blocks 0 and 1 are visible.
  auto with = [](int32_t a, int32_t b) {
    Call c(Op::sparse_attend_extend);
    int32_t* s = c.topk.view.ptr<int32_t>();
    s[0] = a;
    s[1] = b;
    return c;
  };
  expect_call_invalid(with(1, 0), {"request 0", "topk[0, 0, 1] = 0", "not ascending and unique"});
  expect_call_invalid(with(0, 0), {"topk[0, 0, 1] = 0", "not ascending and unique"});
  expect_call_invalid(with(0, 2), {"topk[0, 0, 1] = 2", "out of range", "[0, 2)"});
  expect_call_invalid(with(-1, 1), {"topk[0, 0, 1] = 1", "after a -1"});
  expect_call_invalid(with(-7, -1), {"topk[0, 0, 0] = -7", "out of range"});
  Call ok = with(0, 1);
  EXPECT_NO_THROW(rt.execute(ok.p, ok.layout, ok.tensors()));
}

// sparse_decode checks the union of sparse_index_decode's and sparse_attend_decode's rules, with
// the same messages; its topk is an output, so its contents are not checked.
TEST_F(Validate, SparseDecode) {
  {
    Call c(Op::sparse_decode);
    Tensors t = c.tensors();
    t.topk = TensorView{};
    expect_invalid([&] { rt.execute(c.p, c.layout, t); }, {"tensor topk is missing", "[2, 2, 2]"});
  }
  {
    Call c(Op::sparse_decode);
    c.topk = HostTensor(DType::i32, {2, 2, 3});
    expect_call_invalid(c, {"tensor topk shape [2, 2, 3] dim 2 is 3", "expected 2"});
  }
  {
    Call c(Op::sparse_decode);
    c.topk = HostTensor(DType::f32, {2, 2, 2});
    expect_call_invalid(c, {"tensor topk dtype f32", "expected i32"});
  }
  {
    Call c(Op::sparse_decode);
    c.layout = BatchLayout::make(4, {2, 1}, {9, 5}, {{5, 1, 3}, {0, 2}});
    expect_call_invalid(c, {"request 0", "q_len 2", "expected 1 for sparse_decode"});
  }
  {
    Call c(Op::sparse_decode);
    Tensors t = c.tensors();
    t.index_q = TensorView{};
    expect_invalid([&] { rt.execute(c.p, c.layout, t); },
                   {"tensor index_q is missing", "[2, 2, 8]"});
  }
  {
    Call c(Op::sparse_decode);
    Tensors t = c.tensors();
    t.index_k_cache = TensorView{};
    expect_invalid([&] { rt.execute(c.p, c.layout, t); },
                   {"tensor index_k_cache is missing", "[-1, 4, 1, 8]"});
  }
  {
    Call c(Op::sparse_decode);
    Tensors t = c.tensors();
    t.k_cache = TensorView{};
    expect_invalid([&] { rt.execute(c.p, c.layout, t); },
                   {"tensor k_cache is missing", "[-1, 4, 2, 8]"});
  }
  {
    Call c(Op::sparse_decode);
    Tensors t = c.tensors();
    t.lse = TensorView{};
    expect_invalid([&] { rt.execute(c.p, c.layout, t); }, {"tensor lse is missing", "[2, 4]"});
  }
  {
    Call c(Op::sparse_decode);
    c.iq = HostTensor(DType::bf16, {2, 2, 8});
    expect_call_invalid(c, {"tensor index_q dtype bf16", "expected f32"});
  }
  {
    Call c(Op::sparse_decode);
    c.layout = BatchLayout::make(4, {1, 1}, {9, 5}, {{5, 1, 6}, {0, 2}});
    c.ik = HostTensor(DType::f32, {7, 4, 1, 8});
    expect_call_invalid(c, {"request 0: page id 6 at page_ids[2] >= k_cache pages 6"});
  }
  {
    Call c(Op::sparse_decode);
    Tensors t = c.tensors();
    t.topk.data = t.out.data;
    expect_invalid([&] { rt.execute(c.p, c.layout, t); },
                   {"tensor out aliases topk", "expected a separate buffer"});
  }
  // Problem fields of both steps.
  {
    Call c(Op::sparse_decode);
    c.p.index_dim = 0;
    expect_call_invalid(c, {"index_dim 0", "expected 1..512"});
  }
  {
    Call c(Op::sparse_decode);
    c.p.head_dim = 1000;
    expect_call_invalid(c, {"head_dim 1000", "expected 1..512"});
  }
  {
    Call c(Op::sparse_decode);
    c.p.num_index_heads = 3;
    expect_call_invalid(c, {"num_index_heads 3 % num_kv_heads 2"});
  }
  {
    Call c(Op::sparse_decode);
    c.p.init_blocks = 2;
    expect_call_invalid(c, {"init_blocks 2 + local_blocks 1 > topk 2", "fit in topk"});
  }
  {
    Call c(Op::sparse_decode);
    c.p.num_q_heads = 0;
    expect_call_invalid(c, {"num_q_heads 0", "expected > 0"});
  }
  {
    Call c(Op::sparse_decode);
    c.p.index_scale = -0.5f;
    expect_call_invalid(c, {"index_scale -0.5", "expected finite >= 0"});
  }
  // An output topk's incoming contents are not a selection to check.
  {
    Call c(Op::sparse_decode);
    test::poison(c.topk);
    EXPECT_NO_THROW(rt.execute(c.p, c.layout, c.tensors()));
  }
}

TEST_F(Validate, BadInputLeavesOutputsUntouched) {
  Call c(Op::dense_extend);
  test::poison(c.out);
  c.layout = BatchLayout::make(4, {3, 6}, {9, 5}, {{5, 1, 3}, {0, 2}});
  EXPECT_THROW(rt.execute(c.p, c.layout, c.tensors()), InvalidArgument);
  for (int64_t i = 0; i < c.out.numel(); ++i) ASSERT_TRUE(std::isnan(c.out.get(i))) << i;
}

}  // namespace
}  // namespace attnrt
