// The selection and fallback policy, the plugin loader and the canary, against real shared
// libraries built with injected faults (tests/plugins/).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <new>
#include <thread>
#include <utility>

#include "backends/cpu/cpu_backend.h"
#include "backends/reference/reference_backend.h"
#include "core/cpu_dispatch.h"
#include "registry/plugin_backend.h"
#include "support.h"

namespace attnrt {
namespace {

using test::HostTensor;
using ::testing::HasSubstr;

std::string plugin_dir(const std::string& fault) {
  return std::string(ATTNRT_TEST_PLUGIN_ROOT) + "/" + fault;
}

// Captures every log line for the duration of a test (info and up; the level is restored).
class LogCapture {
 public:
  LogCapture() : level_(log_level()) {
    set_log_level(LogLevel::info);
    set_log_sink([this](LogLevel l, std::string_view m) {
      std::lock_guard lock(mu_);
      (l >= LogLevel::warn ? warnings_ : infos_).emplace_back(m);
    });
  }
  ~LogCapture() {
    set_log_sink(nullptr);
    set_log_level(level_);
  }
  std::vector<std::string> warnings() {
    std::lock_guard lock(mu_);
    return warnings_;
  }
  std::vector<std::string> infos() {
    std::lock_guard lock(mu_);
    return infos_;
  }

 private:
  LogLevel level_;
  std::mutex mu_;
  std::vector<std::string> warnings_, infos_;
};

RuntimeOptions options_for(const std::string& fault) {
  RuntimeOptions o;
  o.plugin_path = fault == "none" ? "" : plugin_dir(fault);
  o.search_library_dir = false;
  o.disable = std::vector<std::string>{};
  o.force_backend = "";
  o.strict = false;
  o.force_replan = false;
  return o;
}

// A small dense f32 problem with its data; `check` compares the output with the reference.
struct DenseCase {
  Problem problem;
  BatchLayout layout;
  HostTensor q, k, v, out, lse, ref_out, ref_lse;

  explicit DenseCase(uint64_t seed, Op op = Op::dense_extend, int kv0 = 29, DType dt = DType::f32) {
    problem.op = op;
    problem.q_dtype = problem.kv_dtype = dt;
    problem.page_size = 4;
    problem.num_q_heads = 4;
    problem.num_kv_heads = 2;
    problem.head_dim = 16;
    problem.write_lse = true;
    const bool dec = is_decode(op);
    std::vector<int32_t> ql = dec ? std::vector<int32_t>{1, 1} : std::vector<int32_t>{3, 2};
    std::vector<int32_t> kv = {kv0, 9};
    std::vector<std::vector<int32_t>> pages(2);
    // Pages handed out from the top of the pool down (page order is not request order).
    const int pool = std::max(21, (kv0 + 3) / 4 + 3);
    int next = 0;
    for (int r = 0; r < 2; ++r)
      for (int i = 0; i < (kv[r] + 3) / 4; ++i) pages[r].push_back(pool - 1 - next++);
    layout = BatchLayout::make(4, ql, kv, pages);
    int64_t T = layout.total_q();
    std::mt19937_64 rng(seed);
    q = HostTensor(dt, {T, 4, 16});
    k = HostTensor(dt, {pool, 4, 2, 16});
    v = HostTensor(dt, {pool, 4, 2, 16});
    out = HostTensor(dt, {T, 4, 16});
    lse = HostTensor(DType::f32, {T, 4});
    ref_out = out;
    ref_lse = lse;
    ref_out.view.data = ref_out.bytes.data();
    ref_lse.view.data = ref_lse.bytes.data();
    test::fill_normal(q, rng);
    test::fill_normal(k, rng);
    test::fill_normal(v, rng);
    Tensors t = tensors();
    t.out = ref_out.view;
    t.lse = ref_lse.view;
    reference_compute(problem, layout, t);
  }
  Tensors tensors() {
    Tensors t;
    t.q = q.view;
    t.k_cache = k.view;
    t.v_cache = v.view;
    t.out = out.view;
    t.lse = lse.view;
    return t;
  }
  void run(Runtime& rt) {
    test::poison(out);
    test::poison(lse);
    rt.execute(problem, layout, tensors());
  }
  double err() const { return std::max(test::rel_l2(out, ref_out), test::rel_l2(lse, ref_lse)); }
  // Labels the problem and the tensors with another device; the data stays in host memory,
  // which is what the fake-GPU test plugins use as device memory.
  void on_device(const Device& d) {
    problem.device = d;
    for (HostTensor* t : {&q, &k, &v, &out, &lse}) t->view.device = d;
  }
};

// A sparse index problem on a DenseCase layout: no fault plugin claims it (its probe says
// Unavailable), so the cpu backend serves it without that being a fallback.
Problem unclaimed_problem(const DenseCase& c) {
  Problem p = c.problem;
  p.op = Op::sparse_index_extend;
  p.num_index_heads = 2;
  p.index_dim = 16;
  p.block_size = 4;
  p.topk = 2;
  p.write_lse = false;
  return p;
}

// A sparse_decode problem on a dense_decode DenseCase's layout (no fault plugin computes it).
Problem sparse_decode_problem(const DenseCase& c) {
  Problem p = c.problem;
  p.op = Op::sparse_decode;
  p.num_index_heads = 2;
  p.index_dim = 16;
  p.block_size = 4;
  p.topk = 2;
  p.local_blocks = 1;
  return p;
}

BackendState state_of(const std::vector<BackendState>& states, const std::string& name) {
  auto it = std::find_if(states.begin(), states.end(),
                         [&](const BackendState& s) { return s.backend == name; });
  if (it == states.end()) throw std::runtime_error("no backend " + name + " in diagnose()");
  return *it;
}

int count_containing(const std::vector<std::string>& lines, const std::string& s) {
  int n = 0;
  for (const auto& l : lines) n += l.find(s) != std::string::npos;
  return n;
}

struct FaultCase {
  std::string fault;
  std::string reason;  // expected in the warning and the report
  bool canary = true;
};
void PrintTo(const FaultCase& c, std::ostream* os) { *os << c.fault << (c.canary ? "" : " (canary off)"); }

class FaultMatrix : public ::testing::TestWithParam<FaultCase> {};

TEST_P(FaultMatrix, AutomaticModeFallsBackWithOneWarning) {
  const FaultCase& fc = GetParam();
  LogCapture logs;
  RuntimeOptions o = options_for(fc.fault);
  o.canary = fc.canary;
  Runtime rt(o);
  DenseCase c(test::fresh_seed());
  for (int i = 0; i < 3; ++i) {  // repeated calls: still one warning
    c.run(rt);
    EXPECT_LT(c.err(), 1e-5) << "call " << i;
    EXPECT_FALSE(test::has_nan(c.out));
  }
  auto w = logs.warnings();
  EXPECT_EQ(count_containing(w, fc.reason), 1) << ::testing::PrintToString(w);
  EXPECT_EQ(w.size(), 1u) << ::testing::PrintToString(w);
  Report r = rt.report();
  std::string text = r.to_string();
  EXPECT_THAT(text, HasSubstr(fc.reason));
  EXPECT_EQ(rt.plan(c.problem, c.layout)->backend(), "cpu");
}

TEST_P(FaultMatrix, ForcedModeFailsClosedWithTheReason) {
  const FaultCase& fc = GetParam();
  LogCapture logs;
  RuntimeOptions o = options_for(fc.fault);
  o.canary = fc.canary;
  o.force_backend = "fault_" + fc.fault;
  Runtime rt(o);
  DenseCase c(test::fresh_seed());
  try {
    c.run(rt);
    FAIL() << "forced broken backend did not fail";
  } catch (const BackendUnavailable& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr(fc.reason));
    EXPECT_EQ(e.backend(), "fault_" + fc.fault);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Faults, FaultMatrix,
    ::testing::Values(
        FaultCase{"missing_entry", "missing symbol attnrt_plugin_get"},
        FaultCase{"wrong_abi", "plugin ABI version 2.0, host needs major 1"},
        FaultCase{"null_plan", "required entry point is null: plan"},
        FaultCase{"plan_fails", "injected plan failure"},
        FaultCase{"run_fails", "injected run failure", /*canary=*/false},
        FaultCase{"run_fails", "canary failed: run failed: injected run failure"},
        FaultCase{"wrong_numbers", "canary mismatch (max err"},
        FaultCase{"missing_dep", "libattnrt_testdep.so: cannot open shared object file"},
        FaultCase{"short_table", "required by ABI 1.2"},
        FaultCase{"null_get", "attnrt_plugin_get() returned NULL"},
        FaultCase{"missing_version", "missing symbol attnrt_plugin_abi_version"},
        FaultCase{"version_mismatch", "table abi_version 65537 differs from exported"},
        FaultCase{"bad_name", "invalid plugin name 'Fault-Bad'"}),
    [](const auto& info) {
      return info.param.fault + (info.param.canary ? "" : "_nocanary");
    });

// A pipe where a plugin would be is refused without opening it (dlopen would block on it), and
// so is a path entry that does not exist; each is one warning naming the path and the reason.
TEST(Registry, NonRegularPluginFilesAreRefusedUnopened) {
  const auto tmp = std::filesystem::temp_directory_path() / ("attnrt_fifo_" + std::to_string(test::fresh_seed()));
  std::filesystem::create_directories(tmp);
  const std::string dir = tmp.string(), fifo = dir + "/libattnrt_fifo.so", missing = dir + "/none.so";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  LogCapture logs;
  RuntimeOptions o = options_for("none");
  o.plugin_path = dir + ":" + missing;
  Runtime rt(o);
  auto w = logs.warnings();
  EXPECT_EQ(count_containing(w, fifo + ") not used: not a regular file"), 1) << ::testing::PrintToString(w);
  EXPECT_EQ(count_containing(w, missing + ") not used: cannot read it: No such file"), 1)
      << ::testing::PrintToString(w);
  DenseCase c(test::fresh_seed());
  c.run(rt);
  EXPECT_LT(c.err(), 1e-5);
  std::filesystem::remove_all(tmp);
}

// Two plugins of one name: the first found (in file-name order) serves, the other is refused
// with one warning. The second computes wrong numbers, so serving in its stead would show.
TEST(Registry, DuplicateNameLoadsTheFirstAndWarnsOnce) {
  LogCapture logs;
  Runtime rt(options_for("duplicate"));
  DenseCase c(test::fresh_seed());
  for (int i = 0; i < 2; ++i) {
    c.run(rt);
    EXPECT_LT(c.err(), 1e-5);
  }
  EXPECT_EQ(rt.plan(c.problem, c.layout)->backend(), "fault_duplicate");
  auto names = rt.backend_names();
  EXPECT_EQ(std::count(names.begin(), names.end(), "fault_duplicate"), 1);
  auto w = logs.warnings();
  ASSERT_EQ(w.size(), 1u) << ::testing::PrintToString(w);
  EXPECT_THAT(w[0], HasSubstr("libattnrt_fault_duplicate_twin.so"));
  EXPECT_THAT(w[0], HasSubstr("duplicate backend name 'fault_duplicate'"));
}

// A plugin that fails its canary is unavailable on that device for every op: one warning for a
// whole forward pass (extend and decode), and both ops run on the cpu with correct results.
TEST(Registry, CanaryFailureIsOneWarningForEveryOp) {
  for (const std::string fault : {"plan_fails", "run_fails", "wrong_numbers"}) {
    SCOPED_TRACE(fault);
    LogCapture logs;
    Runtime rt(options_for(fault));
    DenseCase extend(test::fresh_seed()), decode(test::fresh_seed() + 1, Op::dense_decode);
    for (int i = 0; i < 2; ++i) {
      extend.run(rt);
      decode.run(rt);
      EXPECT_LT(extend.err(), 1e-5);
      EXPECT_LT(decode.err(), 1e-5);
    }
    auto w = logs.warnings();
    ASSERT_EQ(w.size(), 1u) << ::testing::PrintToString(w);
    EXPECT_THAT(w[0], HasSubstr("'fault_" + fault + "' unavailable on cpu"));
    EXPECT_EQ(rt.plan(extend.problem, extend.layout)->backend(), "cpu");
    EXPECT_EQ(rt.plan(decode.problem, decode.layout)->backend(), "cpu");
    EXPECT_THAT(rt.report().to_string(), HasSubstr("fault_" + fault));
  }
}

TEST(Registry, HealthyPluginOutranksCpu) {
  LogCapture logs;
  Runtime rt(options_for("healthy"));
  DenseCase c(test::fresh_seed());
  c.run(rt);
  EXPECT_LT(c.err(), 1e-5);
  EXPECT_EQ(rt.plan(c.problem, c.layout)->backend(), "fault_healthy");
  EXPECT_TRUE(logs.warnings().empty()) << ::testing::PrintToString(logs.warnings());
  // An op it does not claim goes to the next candidate without a warning.
  const Problem unclaimed = unclaimed_problem(c);
  EXPECT_EQ(rt.diagnose(unclaimed).front().backend, "fault_healthy");
  EXPECT_FALSE(rt.diagnose(unclaimed).front().available);
  EXPECT_EQ(rt.plan(unclaimed, c.layout)->backend(), "cpu");
  EXPECT_TRUE(logs.warnings().empty()) << ::testing::PrintToString(logs.warnings());
}

// A plugin built for ABI 1.0 predates sparse_decode (1.1): it loads and serves its other ops,
// and the host never passes it op 6 (its probe would claim it): diagnose() says why, in the
// words plugin.h gives an op a plugin does not serve, and the cpu backend takes the op without
// a warning. Forced onto it, sparse_decode fails closed with the same reason.
TEST(Registry, AbiMinorZeroPluginIsNeverAskedForSparseDecode) {
  LogCapture logs;
  Runtime rt(options_for("abi_minor0"));
  const Report r = rt.report();
  ASSERT_EQ(r.plugins.size(), 1u);
  EXPECT_TRUE(r.plugins[0].loaded) << r.plugins[0].reason;
  DenseCase c(test::fresh_seed(), Op::dense_decode);
  c.run(rt);
  EXPECT_LT(c.err(), 1e-5);
  EXPECT_EQ(rt.plan(c.problem, c.layout)->backend(), "fault_abi_minor0");

  const Problem fused = sparse_decode_problem(c);
  const BackendState st = state_of(rt.diagnose(fused), "fault_abi_minor0");
  EXPECT_FALSE(st.available);
  EXPECT_EQ(st.reason.rfind("op not served", 0), 0u) << st.reason;
  EXPECT_THAT(st.reason, HasSubstr("plugin ABI 1.0 predates sparse_decode (1.1)"));
  EXPECT_EQ(rt.plan(fused, c.layout)->backend(), "cpu");
  EXPECT_TRUE(logs.warnings().empty()) << ::testing::PrintToString(logs.warnings());
  // Its table ends where 1.0 ends: the report never reads degraded_runs (it would abort).
  for (const OpDeviceReport& e : rt.report().ops) EXPECT_EQ(e.degraded_runs, 0);

  RuntimeOptions o = options_for("abi_minor0");
  o.force_backend = "fault_abi_minor0";
  Runtime forced(o);
  try {
    forced.plan(fused, c.layout);
    ADD_FAILURE() << "a 1.0 plugin was given sparse_decode";
  } catch (const BackendUnavailable& e) {
    EXPECT_EQ(e.backend(), "fault_abi_minor0");
    EXPECT_EQ(e.reason().rfind("op not served", 0), 0u) << e.reason();
  }
}

// A 1.2 plugin's degraded runs reach the report of the op it serves, with its note, in
// to_string() and to_json(); an op it cannot answer for shows -1 and why. (The 1.0 plugin above
// never has the field read: its table ends before it, and calling it aborts.)
TEST(Registry, DegradedRunsReachTheReport) {
  LogCapture logs;
  RuntimeOptions o = options_for("degrades");
  o.canary = false;  // the canary's runs would count too
  Runtime rt(o);
  DenseCase extend(test::fresh_seed()), decode(test::fresh_seed() + 1, Op::dense_decode);
  const int runs = 2 + static_cast<int>(test::fresh_seed() % 4);
  for (int i = 0; i < runs; ++i) {
    decode.run(rt);
    EXPECT_LT(decode.err(), 1e-5);
  }
  extend.run(rt);
  EXPECT_LT(extend.err(), 1e-5);
  const Report r = rt.report();
  ASSERT_EQ(r.ops.size(), 2u);
  for (const OpDeviceReport& e : r.ops) {
    EXPECT_EQ(e.chosen, "fault_degrades");
    if (e.op == Op::dense_decode) {
      EXPECT_EQ(e.degraded_runs, runs);
      EXPECT_EQ(e.degraded_note, "injected: every decode run");
    } else {
      EXPECT_EQ(e.degraded_runs, -1);
      EXPECT_THAT(e.degraded_note, HasSubstr("injected degraded_runs failure"));
    }
  }
  EXPECT_THAT(r.to_string(),
              HasSubstr(std::to_string(runs) + " degraded: injected: every decode run"));
  EXPECT_THAT(r.to_string(), HasSubstr("degraded runs unknown: degraded_runs failed"));
  const nlohmann::json j = nlohmann::json::parse(r.to_json());
  int64_t sum = 0;
  for (const auto& e : j["ops"]) sum += e["degraded_runs"].get<int64_t>();
  EXPECT_EQ(sum, runs - 1);
  EXPECT_TRUE(logs.warnings().empty()) << ::testing::PrintToString(logs.warnings());
}

// A plugin of ABI 1.1 or later (the host's) is asked about sparse_decode: the reason diagnose() gives is
// its own probe's answer.
TEST(Registry, AbiMinorOnePluginIsProbedForSparseDecode) {
  Runtime rt(options_for("healthy"));
  DenseCase c(test::fresh_seed(), Op::dense_decode);
  const BackendState st = state_of(rt.diagnose(sparse_decode_problem(c)), "fault_healthy");
  EXPECT_FALSE(st.available);
  EXPECT_EQ(st.reason, "only dense ops");
}

// The canary covers sparse_decode: a backend computing it correctly passes; one whose top-k or
// whose attention output is wrong fails with the reason. (The cpu backend stands in for a
// plugin; run_canary compares it with the reference's sparse_decode.)
class CorruptingBackend : public Backend {
 public:
  enum class Fault { none, topk, out };
  CorruptingBackend(std::unique_ptr<Backend> inner, Fault fault)
      : inner_(std::move(inner)), fault_(fault) {}
  const std::string& name() const override { return inner_->name(); }
  int priority() const override { return inner_->priority(); }
  std::vector<Device> devices() const override { return inner_->devices(); }
  Availability probe(const Problem& p) const override { return inner_->probe(p); }
  std::unique_ptr<BackendPlan> plan(const Problem& p, const BatchLayout& l,
                                    Workspace& ws) override {
    return inner_->plan(p, l, ws);
  }
  void run(const BackendPlan& plan, const Problem& p, const BatchLayout& l, const Tensors& t,
           Workspace& ws) override {
    inner_->run(plan, p, l, t, ws);
    if (fault_ == Fault::topk) {
      // Request 0's first row of index head 0 loses its first block for an unselected one.
      int32_t* row = t.topk.ptr<int32_t>();
      std::vector<int32_t> kept(row, row + p.topk);
      int32_t other = 0;
      while (std::find(kept.begin(), kept.end(), other) != kept.end()) ++other;
      kept[0] = other;
      std::sort(kept.begin(), kept.end());
      std::copy(kept.begin(), kept.end(), row);
    } else if (fault_ == Fault::out) {
      store_from_f32(t.out.data, t.out.dtype, 0, load_as_f32(t.out.data, t.out.dtype, 0) + 1.0f);
    }
  }

 private:
  std::unique_ptr<Backend> inner_;
  Fault fault_;
};

TEST(Canary, CoversSparseDecode) {
  Problem p;
  p.op = Op::sparse_decode;
  p.q_dtype = p.kv_dtype = DType::bf16;
  p.page_size = 16;
  p.num_q_heads = 8;
  p.num_kv_heads = 2;
  p.head_dim = 32;
  p.has_sink = true;
  p.write_lse = true;
  p.num_index_heads = 2;
  p.index_dim = 32;
  p.block_size = 16;
  p.topk = 3;
  p.local_blocks = 1;
  Workspace ws(Device::cpu(), std::make_shared<test::HostMemory>());
  using Fault = CorruptingBackend::Fault;
  CorruptingBackend good(make_cpu_backend(2), Fault::none);
  EXPECT_EQ(run_canary(good, p, ws), "");
  CorruptingBackend bad_topk(make_cpu_backend(2), Fault::topk);
  EXPECT_THAT(run_canary(bad_topk, p, ws), HasSubstr("canary mismatch (1 top-k rows differ"));
  CorruptingBackend bad_out(make_cpu_backend(2), Fault::out);
  EXPECT_THAT(run_canary(bad_out, p, ws), HasSubstr("in out)"));
}

// The test plugins read and write f16 and bf16 themselves (they may include only the plugin
// ABI): their outputs must round like the reference's, so nearly every element is bit-identical
// (a difference needs the two double results to straddle a rounding boundary).
TEST(Registry, HealthyPluginServesSixteenBitTypes) {
  RuntimeOptions o = options_for("healthy");
  o.force_backend = "fault_healthy";
  Runtime rt(o);
  for (DType dt : {DType::bf16, DType::f16})
    for (Op op : {Op::dense_extend, Op::dense_decode}) {
      const uint64_t seed = test::fresh_seed();
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + op_name(op) + " seed " + std::to_string(seed));
      DenseCase c(seed, op, 29, dt);
      c.run(rt);
      EXPECT_TRUE(test::allclose(c.out, c.ref_out, 5e-3, 5e-3)) << test::max_abs_diff(c.out, c.ref_out);
      EXPECT_LE(test::max_abs_diff(c.lse, c.ref_lse), 1e-4);
      int64_t differ = 0;
      for (int64_t i = 0; i < c.out.numel(); ++i)
        differ += std::memcmp(c.out.bytes.data() + 2 * i, c.ref_out.bytes.data() + 2 * i, 2) != 0;
      EXPECT_LE(differ * 100, c.out.numel()) << differ << " of " << c.out.numel() << " elements differ";
    }
}

// Setting up a canary allocates and copies through the plugin; a plugin whose allocation fails
// is unavailable with the reason and the call falls back (here to a second plugin serving the
// same pretend device), instead of plan() failing.
TEST(Registry, CanarySetupFailureMakesThePluginUnavailable) {
  LogCapture logs;
  Runtime rt(options_for("alloc_fails"));
  DenseCase c(test::fresh_seed());
  c.on_device(Device::cuda(0));
  c.run(rt);
  EXPECT_LT(c.err(), 1e-5);
  EXPECT_EQ(rt.plan(c.problem, c.layout)->backend(), "fault_fake_gpu");
  auto w = logs.warnings();
  ASSERT_EQ(w.size(), 1u) << ::testing::PrintToString(w);
  EXPECT_THAT(w[0], HasSubstr("'fault_alloc_fails' unavailable on cuda:0: canary failed"));
  EXPECT_THAT(w[0], HasSubstr("canary of dense_extend"));
  EXPECT_THAT(w[0], HasSubstr("injected allocation failure"));
  EXPECT_THAT(w[0], HasSubstr("using 'fault_fake_gpu' instead"));

  RuntimeOptions o = options_for("alloc_fails");
  o.force_backend = "fault_alloc_fails";
  Runtime forced(o);
  try {
    c.run(forced);
    ADD_FAILURE() << "forced plugin whose canary cannot be set up did not fail";
  } catch (const BackendUnavailable& e) {
    EXPECT_EQ(e.backend(), "fault_alloc_fails");
    EXPECT_THAT(e.reason(), HasSubstr("canary failed"));
    EXPECT_THAT(e.reason(), HasSubstr("injected allocation failure"));
  }
}

TEST(Registry, StrictModeRefusesFallback) {
  LogCapture logs;
  RuntimeOptions o = options_for("plan_fails");
  o.strict = true;
  Runtime rt(o);
  DenseCase c(test::fresh_seed());
  try {
    c.run(rt);
    FAIL() << "strict mode allowed a fallback";
  } catch (const BackendUnavailable& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("ATTNRT_STRICT"));
    EXPECT_THAT(std::string(e.what()), HasSubstr("injected plan failure"));
  }
}

// ATTNRT_STRICT takes the usual on/off spellings in any case; anything else is refused when the
// Runtime is made rather than read as either.
TEST(Registry, StrictFromTheEnvironment) {
  LogCapture logs;
  RuntimeOptions o = options_for("plan_fails");
  o.strict = std::nullopt;
  struct Case {
    const char* value;
    bool strict;
  };
  for (const Case& k : {Case{"no", false}, Case{"Off", false}, Case{"0", false},
                        Case{"", false}, Case{"YES", true}, Case{"on", true}, Case{"1", true}}) {
    SCOPED_TRACE(k.value);
    ::setenv("ATTNRT_STRICT", k.value, 1);
    Runtime rt(o);
    DenseCase c(test::fresh_seed());
    if (k.strict) {
      EXPECT_THROW(c.run(rt), BackendUnavailable);
    } else {
      c.run(rt);
      EXPECT_LT(c.err(), 1e-5);
    }
  }
  ::setenv("ATTNRT_STRICT", "sometimes", 1);
  try {
    Runtime rt(o);
    ADD_FAILURE() << "ATTNRT_STRICT=sometimes accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("ATTNRT_STRICT: 'sometimes'"));
  }
  ::unsetenv("ATTNRT_STRICT");
}

// Strict mode refuses every call that a fallback would serve, not only the first one: later
// plans of the same op and runs of a plan whose backend failed throw too.
TEST(Registry, StrictModeRefusesEveryFallback) {
  LogCapture logs;
  RuntimeOptions o = options_for("plan_fails");
  o.strict = true;
  Runtime rt(o);
  DenseCase a(test::fresh_seed()), b(test::fresh_seed() + 1, Op::dense_extend, 30);
  for (DenseCase* c : {&a, &b, &a}) {
    try {
      c->run(rt);
      ADD_FAILURE() << "strict mode allowed a fallback";
    } catch (const BackendUnavailable& e) {
      EXPECT_EQ(e.backend(), "fault_plan_fails");
      EXPECT_THAT(e.reason(), HasSubstr("injected plan failure"));
      EXPECT_THAT(e.reason(), HasSubstr("ATTNRT_STRICT=1: fallback to 'cpu' refused"));
    }
  }
  // A candidate whose probe declines the problem is skipped without a fallback.
  EXPECT_EQ(rt.plan(unclaimed_problem(a), a.layout)->backend(), "cpu");
  EXPECT_TRUE(rt.report().warnings.empty()) << ::testing::PrintToString(rt.report().warnings);
}

TEST(Registry, StrictModeRefusesEveryFallbackAfterARunFailure) {
  RuntimeOptions o = options_for("run_fails");
  o.strict = true;
  o.canary = false;  // the plugin passes plan; its failure shows in run
  Runtime rt(o);
  DenseCase c(test::fresh_seed());
  auto plan = rt.plan(c.problem, c.layout);
  ASSERT_EQ(plan->backend(), "fault_run_fails");
  for (int i = 0; i < 2; ++i) {
    test::poison(c.out);
    try {
      rt.run(*plan, c.tensors());
      ADD_FAILURE() << "call " << i << ": strict mode allowed a fallback to " << plan->backend();
    } catch (const BackendUnavailable& e) {
      EXPECT_THAT(e.reason(), HasSubstr("injected run failure")) << "call " << i;
      EXPECT_THAT(e.reason(), HasSubstr("ATTNRT_STRICT=1")) << "call " << i;
    }
    EXPECT_TRUE(test::has_nan(c.out)) << "call " << i << " wrote output";
  }
  DenseCase other(test::fresh_seed(), Op::dense_decode);
  EXPECT_THROW(other.run(rt), BackendUnavailable);
}

// A plugin whose init reports its runtime absent (a GPU plugin on a machine without a GPU) is
// not a defect: info, not a warning; report() and diagnose() still list it with the reason.
TEST(Registry, PluginWithoutItsRuntimeIsInfoNotWarning) {
  LogCapture logs;
  Runtime rt(options_for("no_runtime"));
  EXPECT_TRUE(logs.warnings().empty()) << ::testing::PrintToString(logs.warnings());
  EXPECT_EQ(count_containing(logs.infos(), "no test runtime on this machine"), 1)
      << ::testing::PrintToString(logs.infos());
  Report r = rt.report();
  ASSERT_EQ(r.plugins.size(), 1u);
  EXPECT_FALSE(r.plugins[0].loaded);
  EXPECT_TRUE(r.plugins[0].expected);
  EXPECT_EQ(r.plugins[0].reason, "init failed: no test runtime on this machine (injected)");
  EXPECT_TRUE(r.warnings.empty());
  DenseCase c(test::fresh_seed());
  EXPECT_EQ(count_containing({rt.diagnose(c.problem).back().reason}, "init failed: no test runtime"), 1);
  c.run(rt);
  EXPECT_LT(c.err(), 1e-5);
  EXPECT_TRUE(logs.warnings().empty()) << ::testing::PrintToString(logs.warnings());
}

// ATTNRT_DISABLE keeps a plugin from being initialised: it is recorded as disabled (not with its
// init failure) and costs no warning. Structural defects stay warnings even when disabled.
TEST(Registry, DisabledPluginIsNotInitialised) {
  LogCapture logs;
  RuntimeOptions o = options_for("no_runtime");
  o.disable = std::vector<std::string>{"fault_no_runtime"};
  Runtime rt(o);
  Report r = rt.report();
  ASSERT_EQ(r.plugins.size(), 1u);
  EXPECT_FALSE(r.plugins[0].loaded);
  EXPECT_TRUE(r.plugins[0].expected);
  EXPECT_EQ(r.plugins[0].reason, "disabled by ATTNRT_DISABLE (not initialised)");
  EXPECT_TRUE(logs.warnings().empty()) << ::testing::PrintToString(logs.warnings());

  o = options_for("healthy");
  o.disable = std::vector<std::string>{"fault_healthy"};
  Runtime healthy_disabled(o);
  EXPECT_EQ(healthy_disabled.report().plugins[0].reason, "disabled by ATTNRT_DISABLE (not initialised)");
  DenseCase c(test::fresh_seed());
  EXPECT_EQ(healthy_disabled.plan(c.problem, c.layout)->backend(), "cpu");

  o = options_for("null_plan");
  o.disable = std::vector<std::string>{"fault_null_plan"};
  Runtime defective(o);
  EXPECT_FALSE(defective.report().plugins[0].expected);
  EXPECT_EQ(count_containing(logs.warnings(), "required entry point is null: plan"), 1);
}

TEST(Registry, UnknownNamesListTheKnownOnes) {
  RuntimeOptions o = options_for("healthy");
  o.disable = std::vector<std::string>{"nosuch"};
  try {
    Runtime rt(o);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("ATTNRT_DISABLE: unknown backend 'nosuch'"));
    EXPECT_THAT(std::string(e.what()), HasSubstr("cpu, fault_healthy, reference"));
  }
  o.disable = std::vector<std::string>{};
  o.force_backend = "nosuch";
  EXPECT_THROW(Runtime{o}, InvalidArgument);
}

// ATTNRT_CPU_ISA (RuntimeOptions::cpu_isa): each kernel set the CPU has serves; an unknown name
// or one the CPU lacks is InvalidArgument when the Runtime is made, not a SIGILL at the first run.
TEST(Registry, CpuIsaChoice) {
  RuntimeOptions o = options_for("none");
  o.cpu_isa = "sse9";
  EXPECT_THROW(Runtime{o}, InvalidArgument);
  for (CpuIsa isa : {CpuIsa::baseline, CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512_bf16}) {
    SCOPED_TRACE(cpu_isa_name(isa));
    o.cpu_isa = cpu_isa_name(isa);
    if (!cpu_supports(isa)) {
      EXPECT_THROW(Runtime{o}, InvalidArgument);
      continue;
    }
    Runtime rt(o);
    DenseCase c(test::fresh_seed());
    c.run(rt);
    EXPECT_LT(c.err(), 1e-5);
    EXPECT_EQ(rt.plan(c.problem, c.layout)->backend(), "cpu");
  }
}

TEST(Registry, DisableRemovesBackends) {
  RuntimeOptions o = options_for("healthy");
  o.disable = std::vector<std::string>{"fault_healthy", "cpu"};
  Runtime rt(o);
  DenseCase c(test::fresh_seed());
  c.run(rt);
  EXPECT_LT(c.err(), 1e-5);
  EXPECT_EQ(rt.plan(c.problem, c.layout)->backend(), "reference");
}

TEST(Registry, BadInputNeverTriggersFallback) {
  LogCapture logs;
  Runtime rt(options_for("healthy"));
  DenseCase c(test::fresh_seed());
  c.layout.q_len[0] = c.layout.kv_len[0] + 1;
  c.layout = BatchLayout::make(c.layout.page_size, c.layout.q_len, c.layout.kv_len, {});
  EXPECT_THROW(c.run(rt), InvalidArgument);
  EXPECT_TRUE(logs.warnings().empty());
  EXPECT_TRUE(rt.report().ops.empty());
}

// update() refreshes a decode plan in place when its backend can (the healthy plugin can): the
// same plan object then computes the new layout correctly, and plan() no longer hands it out
// for the old layout.
TEST(PlanCache, UpdateRefreshesInPlaceAndLeavesTheCache) {
  Runtime rt(options_for("healthy"));
  DenseCase c(test::fresh_seed(), Op::dense_decode, 29);
  const BatchLayout old_layout = c.layout;
  auto plan = rt.plan(c.problem, old_layout);
  ASSERT_EQ(plan->backend(), "fault_healthy");
  // Each request grows by three tokens, onto pages of the pool nobody used yet.
  std::vector<std::vector<int32_t>> pages(2);
  std::vector<int32_t> kv = {old_layout.kv_len[0] + 3, old_layout.kv_len[1] + 3};
  std::vector<bool> used(c.k.view.shape[0], false);
  for (int32_t id : old_layout.page_ids) used[id] = true;
  int32_t spare = 0;
  for (int r = 0; r < 2; ++r) {
    pages[r].assign(old_layout.page_ids.begin() + old_layout.page_indptr[r],
                    old_layout.page_ids.begin() + old_layout.page_indptr[r + 1]);
    while (static_cast<int32_t>(pages[r].size()) * 4 < kv[r]) {
      while (used[spare]) ++spare;
      used[spare] = true;
      pages[r].push_back(spare);
    }
  }
  c.layout = BatchLayout::make(4, old_layout.q_len, kv, pages);
  Tensors ref = c.tensors();
  ref.out = c.ref_out.view;
  ref.lse = c.ref_lse.view;
  reference_compute(c.problem, c.layout, ref);
  auto updated = rt.update(plan, c.layout);
  EXPECT_EQ(updated.get(), plan.get()) << "refreshed in place";
  EXPECT_EQ(plan->layout(), c.layout);
  test::poison(c.out);
  test::poison(c.lse);
  rt.run(*updated, c.tensors());
  EXPECT_LT(c.err(), 1e-5);
  auto again = rt.plan(c.problem, old_layout);
  EXPECT_NE(again.get(), plan.get()) << "the cache must not return the refreshed plan";
  EXPECT_EQ(again->layout(), old_layout);
}

// A run racing update() of the same plan runs the layout its tensors were checked against: a
// layout whose page lies past the pools is refused with InvalidArgument, never read from, and
// every run that goes through computes the good layout.
TEST(PlanCache, RunRacingUpdateRunsTheLayoutItChecked) {
  Runtime rt(options_for("healthy"));
  DenseCase c(test::fresh_seed(), Op::dense_decode, 29);
  BatchLayout past_pool = c.layout;
  past_pool.page_ids.back() = 50'000'000;  // update() cannot know the pools; run() can
  auto plan = rt.plan(c.problem, c.layout);
  ASSERT_EQ(plan->backend(), "fault_healthy");
  std::atomic<bool> stop{false};
  std::atomic<int> refused{0};
  std::thread updater([&] {
    for (int i = 0; !stop; ++i)
      EXPECT_EQ(rt.update(plan, i % 2 ? c.layout : past_pool).get(), plan.get());
  });
  int ran = 0;
  double worst = 0;
  for (int i = 0; i < 3000; ++i) {
    test::poison(c.out);
    test::poison(c.lse);
    try {
      rt.run(*plan, c.tensors());
      ++ran;
      worst = std::max(worst, c.err());
    } catch (const InvalidArgument& e) {
      ++refused;
      EXPECT_THAT(e.what(), testing::HasSubstr("50000000"));
    }
  }
  stop = true;
  updater.join();
  EXPECT_LT(worst, 1e-5) << "a run that went through computed another layout";
  EXPECT_GT(ran + refused, 0);
  std::printf("%d runs went through, %d were refused\n", ran, refused.load());
}

TEST(PlanCache, ExactKeys) {
  Runtime rt(options_for("none"));
  DenseCase a(1), b(1, Op::dense_extend, 30);  // differ in one kv_len
  auto pa = rt.plan(a.problem, a.layout);
  auto pb = rt.plan(b.problem, b.layout);
  EXPECT_NE(pa.get(), pb.get());
  EXPECT_EQ(pa.get(), rt.plan(a.problem, a.layout).get());
  EXPECT_EQ(pb->layout().kv_len[0], 30);
  Problem other = a.problem;
  other.write_lse = false;
  EXPECT_NE(pa.get(), rt.plan(other, a.layout).get());
  // A page id change is a different layout too.
  BatchLayout moved = a.layout;
  std::swap(moved.page_ids[0], moved.page_ids[1]);
  EXPECT_NE(pa.get(), rt.plan(a.problem, moved).get());
  Report r = rt.report();
  EXPECT_EQ(r.plan_cache_hits, 1);
}

TEST(PlanCache, ForceReplanDisablesReuse) {
  RuntimeOptions o = options_for("none");
  o.force_replan = true;
  Runtime rt(o);
  DenseCase a(1);
  EXPECT_NE(rt.plan(a.problem, a.layout).get(), rt.plan(a.problem, a.layout).get());
}

TEST(PlanCache, BoundedLru) {
  RuntimeOptions o = options_for("none");
  o.plan_cache_capacity = 2;
  Runtime rt(o);
  DenseCase a(1, Op::dense_extend, 20), b(1, Op::dense_extend, 21), c(1, Op::dense_extend, 22);
  auto pa = rt.plan(a.problem, a.layout);
  rt.plan(b.problem, b.layout);
  rt.plan(c.problem, c.layout);  // evicts a
  EXPECT_NE(pa.get(), rt.plan(a.problem, a.layout).get());
}

TEST(Runtime, PlanRunsWithTheSameResultEveryLayer) {
  Runtime rt(options_for("none"));
  DenseCase c(test::fresh_seed());
  auto plan = rt.plan(c.problem, c.layout);
  test::poison(c.out);
  rt.run(*plan, c.tensors());
  HostTensor first = c.out;
  test::poison(c.out);
  rt.run(*plan, c.tensors());
  EXPECT_EQ(std::memcmp(first.bytes.data(), c.out.bytes.data(), c.out.bytes.size()), 0);
  EXPECT_LT(c.err(), 1e-5);
}

// A run that fails when no other candidate is left leaves the plan without a backend: every
// later run of it throws BackendUnavailable with the reason (never dereferences a null backend).
TEST(Runtime, PlanWithoutBackendThrowsOnEveryRun) {
  RuntimeOptions o = options_for("run_fails");
  o.canary = false;  // the plugin passes plan; its failure shows in run
  o.disable = std::vector<std::string>{"cpu", "reference"};
  Runtime rt(o);
  DenseCase c(test::fresh_seed());
  auto plan = rt.plan(c.problem, c.layout);
  ASSERT_EQ(plan->backend(), "fault_run_fails");
  for (int i = 0; i < 3; ++i) {
    try {
      rt.run(*plan, c.tensors());
      ADD_FAILURE() << "call " << i << " did not throw";
    } catch (const BackendUnavailable& e) {
      EXPECT_THAT(std::string(e.what()), HasSubstr("injected run failure")) << "call " << i;
    }
    EXPECT_EQ(plan->backend(), "") << "call " << i;
  }
  // The cached plan (same problem and layout) and update() fail the same way.
  EXPECT_THROW(c.run(rt), BackendUnavailable);
  EXPECT_THROW(rt.run(*rt.update(plan, c.layout), c.tensors()), BackendUnavailable);
}

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.bytes.size() == b.bytes.size() && std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0;
}

// Eight threads share one Runtime: every thread's every output is bit-identical to a serial run
// of the same case, and close to the reference. Once with a plugin serving the cases, once with
// the cpu backend (long decodes split over the keys, so workspace partials are in use).
TEST(Runtime, EightThreadsMatchSerial) {
  for (const std::string fault : {"healthy", "none"}) {
    SCOPED_TRACE(fault);
    Runtime rt(options_for(fault));
    std::vector<std::unique_ptr<DenseCase>> cases;
    std::vector<HostTensor> serial_out, serial_lse;
    for (int i = 0; i < 8; ++i) {
      const Op op = i % 2 ? Op::dense_decode : Op::dense_extend;
      cases.push_back(std::make_unique<DenseCase>(test::fresh_seed() + i, op, i % 2 ? 1500 : 29,
                                                  i % 4 == 3 ? DType::bf16 : DType::f32));
      cases.back()->run(rt);
      serial_out.push_back(cases.back()->out);
      serial_lse.push_back(cases.back()->lse);
    }
    EXPECT_EQ(rt.plan(cases[1]->problem, cases[1]->layout)->backend(),
              fault == "none" ? "cpu" : "fault_healthy");
    std::vector<std::thread> threads;
    std::atomic<int> differ{0}, far{0};
    for (int i = 0; i < 8; ++i)
      threads.emplace_back([&, i] {
        for (int rep = 0; rep < 5; ++rep) {
          cases[i]->run(rt);
          if (!same_bytes(cases[i]->out, serial_out[i]) || !same_bytes(cases[i]->lse, serial_lse[i]))
            ++differ;
          if (!(cases[i]->err() < 5e-3)) ++far;
        }
      });
    for (auto& t : threads) t.join();
    EXPECT_EQ(differ.load(), 0) << "runs differing from the serial run";
    EXPECT_EQ(far.load(), 0) << "runs far from the reference";
    for (auto& c : cases) {
      if (c->problem.q_dtype == DType::f32) {
        EXPECT_LT(c->err(), 1e-5);
      }
    }
  }
}

// Two Runtimes, both on the cpu backend, run at once on different data: each has its own
// workspace (split-KV decode partials included), so neither disturbs the other.
TEST(Runtime, TwoRuntimesConcurrentlyOnDifferentData) {
  RuntimeOptions o = options_for("none");
  o.force_backend = "cpu";
  Runtime r1(o), r2(o);
  DenseCase a(test::fresh_seed(), Op::dense_decode, 2000), b(test::fresh_seed() + 7, Op::dense_decode, 1700);
  EXPECT_EQ(r1.plan(a.problem, a.layout)->backend(), "cpu");
  EXPECT_EQ(r2.plan(b.problem, b.layout)->backend(), "cpu");
  a.run(r1);
  b.run(r2);
  const HostTensor a_out = a.out, b_out = b.out;
  std::atomic<int> bad{0};
  std::thread t1([&] {
    for (int i = 0; i < 10; ++i) {
      a.run(r1);
      if (!(a.err() < 1e-5) || !same_bytes(a.out, a_out)) ++bad;
    }
  });
  std::thread t2([&] {
    for (int i = 0; i < 10; ++i) {
      b.run(r2);
      if (!(b.err() < 1e-5) || !same_bytes(b.out, b_out)) ++bad;
    }
  });
  t1.join();
  t2.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(Logging, OneTimeWarningsAreOncePerKeyAcrossThreads) {
  LogCapture logs;
  RuntimeOptions o = options_for("plan_fails");
  Runtime rt(o);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      DenseCase c(100 + i);
      c.run(rt);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(count_containing(logs.warnings(), "injected plan failure"), 1);
}

TEST(Workspace, LeasesAreExclusiveAndReused) {
  Runtime rt(options_for("none"));
  DeviceBuffer b = rt.allocate(Device::cpu(), 1000);
  ASSERT_NE(b.data(), nullptr);
  std::vector<char> src(1000, 7), dst(1000, 0);
  rt.copy_to_device(b, src.data(), 1000);
  rt.copy_to_host(dst.data(), b, 1000);
  EXPECT_EQ(src, dst);
  EXPECT_THROW(rt.copy_to_device(b, src.data(), 1000, 1), InvalidArgument);
}

// A failed allocation leaves the workspace as it was before it: nothing counted as reserved for
// it, and no empty buffer on the free list.
TEST(Workspace, FailedAllocationReservesNothing) {
  struct FailOnRequest : DeviceMemory {
    bool fail_next = false;
    void* alloc(size_t n) override {
      if (std::exchange(fail_next, false)) throw std::bad_alloc();
      return std::aligned_alloc(64, n);
    }
    void free(void* p) noexcept override { std::free(p); }
  };
  auto mem = std::make_shared<FailOnRequest>();
  Workspace ws(Device::cpu(), mem);
  ws.acquire(1000);  // 1024 bytes, back on the free list at once
  EXPECT_EQ(ws.bytes_reserved(), 1024u);
  mem->fail_next = true;
  EXPECT_THROW(ws.acquire(1 << 20), std::bad_alloc);  // drops the 1024 first: too small
  EXPECT_EQ(ws.bytes_reserved(), 0u);
  Workspace::Lease a = ws.acquire(100), b = ws.acquire(100);
  EXPECT_NE(a.data(), nullptr);
  EXPECT_NE(b.data(), nullptr);
  EXPECT_NE(a.data(), b.data());
  EXPECT_EQ(ws.bytes_reserved(), 256u);
}

}  // namespace
}  // namespace attnrt
