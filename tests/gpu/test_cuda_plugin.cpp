// GPU tests of the CUDA plugin through its C ABI (dlopen), against a double-precision host
// reference written here. Outputs are poisoned (NaN) before every run; repeats must be
// bit-identical. Without a CUDA device every test is skipped with the plugin's reason.
// The plugin is found via ATTNRT_CUDA_PLUGIN (full path) or ../lib/<file> beside this binary.
#include <attnrt/plugin.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

const attnrt_plugin_v1* g_plugin = nullptr;
std::string g_skip;

std::string plugin_path() {
  if (const char* e = std::getenv("ATTNRT_CUDA_PLUGIN")) return e;
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  std::string exe = n > 0 ? std::string(buf, n) : std::string("./x");
  return exe.substr(0, exe.rfind('/')) + "/../lib/" ATTNRT_CUDA_PLUGIN_FILE;
}

const attnrt_plugin_v1* plugin() {
  static bool done = false;
  if (done) return g_plugin;
  done = true;
  const std::string path = plugin_path();
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    g_skip = std::string("cannot load ") + path + ": " + dlerror();
    return nullptr;
  }
  auto get = reinterpret_cast<attnrt_plugin_get_fn>(dlsym(h, ATTNRT_PLUGIN_ENTRY_SYMBOL));
  if (!get) {
    g_skip = "no entry symbol";
    return nullptr;
  }
  const attnrt_plugin_v1* p = get();
  if (p->init() != ATTNRT_OK) {
    g_skip = std::string("cuda plugin unavailable: ") + p->last_error();
    return nullptr;
  }
  int32_t count = 0;
  p->device_count(ATTNRT_DEVICE_CUDA, &count);
  if (count == 0) {
    g_skip = "no CUDA device";
    return nullptr;
  }
  g_plugin = p;
  return p;
}

#define REQUIRE_GPU()                                  \
  do {                                                 \
    if (!plugin()) GTEST_SKIP() << g_skip;             \
  } while (0)

#define OKC(x) ASSERT_EQ((x), ATTNRT_OK) << g_plugin->last_error()

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t to_f16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
float from_f16(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}

struct Case {
  int op = ATTNRT_OP_DENSE_EXTEND;
  int dtype = ATTNRT_BF16;
  int hq = 8, hkv = 2, d = 128, page = 16;
  bool sink = false, lse = true;
  std::vector<int> q_len, kv_len;
};

struct Result {
  double rel_o = 0, max_lse = 0;
  bool all_written = true, repeat_identical = true;
};

attnrt_tensor tensor(void* data, int dtype, int rank, std::initializer_list<int64_t> shape) {
  attnrt_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.device = {ATTNRT_DEVICE_CUDA, 0};
  t.rank = rank;
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t st = 1;
  for (int k = rank - 1; k >= 0; --k) {
    t.strides[k] = st;
    st *= t.shape[k];
  }
  return t;
}

struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t b) : bytes(b) {
    if (g_plugin->mem_alloc({1, 0}, b, &p) != ATTNRT_OK) p = nullptr;
  }
  ~Dev() {
    if (p) g_plugin->mem_free({1, 0}, p);
  }
  void up(const void* src) { g_plugin->copy_to_device({1, 0}, p, src, bytes); }
  void down(void* dst) const { g_plugin->copy_to_host({1, 0}, dst, p, bytes); }
};

// Runs one case `reps` times (repeat check) and compares with the double reference.
Result run_case(const Case& c, uint32_t seed, int reps = 2, double* ms_per_run = nullptr,
                int timed = 0, bool check = true) {
  Result r;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int n = static_cast<int>(c.q_len.size());
  std::vector<int64_t> q_indptr(n + 1, 0);
  std::vector<int32_t> page_indptr(n + 1, 0), ql(c.q_len.begin(), c.q_len.end()),
      kl(c.kv_len.begin(), c.kv_len.end());
  for (int b = 0; b < n; ++b) {
    q_indptr[b + 1] = q_indptr[b] + c.q_len[b];
    page_indptr[b + 1] = page_indptr[b] + (c.kv_len[b] + c.page - 1) / c.page;
  }
  const int total_pages = page_indptr[n];
  const int num_pages = total_pages + 3;
  std::vector<int32_t> page_ids(total_pages);
  std::vector<int32_t> perm(num_pages);
  for (int i = 0; i < num_pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);  // scattered physical pages
  for (int i = 0; i < total_pages; ++i) page_ids[i] = perm[i];
  const int64_t T = q_indptr[n];
  const int D = c.d;
  const bool bf = c.dtype == ATTNRT_BF16;
  auto enc = [&](float f) { return bf ? to_bf16(f) : to_f16(f); };
  auto dec = [&](uint16_t u) { return bf ? from_bf16(u) : from_f16(u); };
  std::vector<uint16_t> q(T * c.hq * D), kc(static_cast<size_t>(num_pages) * c.page * c.hkv * D),
      vc(kc.size());
  for (auto& x : q) x = enc(nd(rng));
  for (auto& x : kc) x = enc(nd(rng));
  for (auto& x : vc) x = enc(nd(rng));
  std::vector<float> sink(c.hq);
  for (auto& x : sink) x = nd(rng) * 2.f;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));

  // Reference.
  std::vector<double> ro(T * c.hq * D), rl(T * c.hq);
  const int G = c.hq / c.hkv;
  for (int b = 0; b < n && check; ++b)
    for (int64_t t = q_indptr[b]; t < q_indptr[b + 1]; ++t) {
      const int pos = c.kv_len[b] - c.q_len[b] + static_cast<int>(t - q_indptr[b]);
      for (int h = 0; h < c.hq; ++h) {
        const int g = h / G;
        std::vector<double> s(pos + 1);
        double m = -INFINITY;
        for (int j = 0; j <= pos; ++j) {
          const int64_t base =
              ((static_cast<int64_t>(page_ids[page_indptr[b] + j / c.page]) * c.page + j % c.page) *
                   c.hkv + g) * D;
          double acc = 0;
          for (int k = 0; k < D; ++k) acc += dec(q[(t * c.hq + h) * D + k]) * dec(kc[base + k]);
          s[j] = acc * scale;
          m = std::max(m, s[j]);
        }
        if (c.sink) m = std::max(m, static_cast<double>(sink[h]));
        double L = 0;
        std::vector<double> o(D, 0.0);
        for (int j = 0; j <= pos; ++j) {
          const double p = std::exp(s[j] - m);
          L += p;
          const int64_t base =
              ((static_cast<int64_t>(page_ids[page_indptr[b] + j / c.page]) * c.page + j % c.page) *
                   c.hkv + g) * D;
          for (int k = 0; k < D; ++k) o[k] += p * dec(vc[base + k]);
        }
        if (c.sink) L += std::exp(sink[h] - m);
        for (int k = 0; k < D; ++k) ro[(t * c.hq + h) * D + k] = o[k] / L;
        rl[t * c.hq + h] = m + std::log(L);
      }
    }

  // Device run.
  attnrt_problem p{};
  p.op = c.op;
  p.device = {ATTNRT_DEVICE_CUDA, 0};
  p.q_dtype = p.kv_dtype = c.dtype;
  p.page_size = c.page;
  p.num_q_heads = c.hq;
  p.num_kv_heads = c.hkv;
  p.head_dim = D;
  p.sm_scale = scale;
  p.has_sink = c.sink;
  p.write_lse = c.lse;
  attnrt_layout L{n, c.page, ql.data(), kl.data(), q_indptr.data(), page_indptr.data(),
                  page_ids.data(), 0};
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_OK) << g_plugin->last_error();
  attnrt_plan plan = nullptr;
  EXPECT_EQ(g_plugin->plan(&p, &L, &plan), ATTNRT_OK) << g_plugin->last_error();
  if (!plan) return r;
  Dev dq(q.size() * 2), dk(kc.size() * 2), dv(vc.size() * 2), dout(q.size() * 2),
      dlse(rl.size() * 4 + 4), dsink(sink.size() * 4);
  dq.up(q.data());
  dk.up(kc.data());
  dv.up(vc.data());
  dsink.up(sink.data());
  attnrt_tensors ts{};
  ts.q = tensor(dq.p, c.dtype, 3, {T, c.hq, D});
  ts.k_cache = tensor(dk.p, c.dtype, 4, {num_pages, c.page, c.hkv, D});
  ts.v_cache = tensor(dv.p, c.dtype, 4, {num_pages, c.page, c.hkv, D});
  ts.out = tensor(dout.p, c.dtype, 3, {T, c.hq, D});
  if (c.lse) ts.lse = tensor(dlse.p, ATTNRT_F32, 2, {T, c.hq});
  if (c.sink) ts.sink = tensor(dsink.p, ATTNRT_F32, 1, {c.hq});
  std::vector<uint16_t> out(q.size()), first;
  std::vector<float> lse(rl.size()), first_lse;
  for (int rep = 0; rep < reps; ++rep) {
    std::vector<uint16_t> poison(q.size(), 0x7fc1);  // NaN in both bf16 and f16
    std::vector<float> lpoison(rl.size() + 1, std::numeric_limits<float>::quiet_NaN());
    dout.up(poison.data());
    dlse.up(lpoison.data());
    EXPECT_EQ(g_plugin->run(plan, &ts, nullptr), ATTNRT_OK) << g_plugin->last_error();
    EXPECT_EQ(g_plugin->synchronize({1, 0}), ATTNRT_OK) << g_plugin->last_error();
    dout.down(out.data());
    g_plugin->copy_to_host({1, 0}, lse.data(), dlse.p, lse.size() * 4);
    if (rep == 0) {
      first = out;
      first_lse = lse;
    } else if (first != out || std::memcmp(first_lse.data(), lse.data(), lse.size() * 4) != 0) {
      r.repeat_identical = false;
    }
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const float v = dec(out[i]);
    if (!std::isfinite(v)) r.all_written = false;
    num += (v - ro[i]) * (v - ro[i]);
    den += ro[i] * ro[i];
  }
  r.rel_o = std::sqrt(num / std::max(den, 1e-30));
  if (c.lse) {
    for (size_t i = 0; i < lse.size(); ++i) {
      if (!std::isfinite(lse[i])) r.all_written = false;
      r.max_lse = std::max(r.max_lse, std::fabs(lse[i] - rl[i]));
    }
  }
  if (timed > 0 && ms_per_run) {
    for (int i = 0; i < 3; ++i) g_plugin->run(plan, &ts, nullptr);
    g_plugin->synchronize({1, 0});
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < timed; ++i) g_plugin->run(plan, &ts, nullptr);
    g_plugin->synchronize({1, 0});
    *ms_per_run =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
        timed;
  }
  g_plugin->destroy_plan(plan);
  return r;
}

void expect_good(const Case& c, uint32_t seed) {
  Result r = run_case(c, seed);
  const double tol = c.dtype == ATTNRT_BF16 ? 2e-2 : 5e-3;
  EXPECT_TRUE(r.all_written) << "unwritten (NaN) output, seed " << seed;
  EXPECT_TRUE(r.repeat_identical) << "repeat not bit-identical, seed " << seed;
  EXPECT_LT(r.rel_o, tol) << "seed " << seed << " op " << c.op << " d " << c.d;
  if (c.lse) {
    EXPECT_LT(r.max_lse, 1e-3) << "seed " << seed;
  }
}

TEST(CudaPlugin, LoadsAndReportsDevice) {
  REQUIRE_GPU();
  char buf[256] = "";
  OKC(g_plugin->describe_device({1, 0}, buf, sizeof buf));
  EXPECT_NE(std::string(buf).find("sm_"), std::string::npos) << buf;
  std::printf("device: %s\n", buf);
}

TEST(CudaPlugin, ProbeReasons) {
  REQUIRE_GPU();
  attnrt_problem p{};
  p.op = ATTNRT_OP_DENSE_EXTEND;
  p.device = {1, 0};
  p.q_dtype = p.kv_dtype = ATTNRT_F32;
  p.page_size = 16;
  p.num_q_heads = 8;
  p.num_kv_heads = 2;
  p.head_dim = 128;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("dtype"), std::string::npos);
  p.q_dtype = p.kv_dtype = ATTNRT_BF16;
  p.head_dim = 96;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("head_dim 96"), std::string::npos);
  p.head_dim = 128;
  p.op = ATTNRT_OP_SPARSE_ATTEND_DECODE;  // sparse ops: test_cuda_sparse.cpp; block_size 0 here
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_UNAVAILABLE);
  EXPECT_NE(std::string(g_plugin->last_error()).find("block_size 0"), std::string::npos);
  p.op = ATTNRT_OP_DENSE_DECODE;
  EXPECT_EQ(g_plugin->probe(&p), ATTNRT_OK) << g_plugin->last_error();
}

TEST(CudaPlugin, ExtendRandomSweep) {
  REQUIRE_GPU();
  std::mt19937 rng(1234);
  const int dims[] = {64, 128, 256};
  const int pages[] = {1, 16, 32, 64, 128};
  for (int it = 0; it < 12; ++it) {
    Case c;
    c.op = ATTNRT_OP_DENSE_EXTEND;
    c.dtype = it % 2 ? ATTNRT_F16 : ATTNRT_BF16;
    c.d = dims[it % 3];
    c.page = pages[it % 5];
    c.hkv = 1 + it % 3;
    c.hq = c.hkv * (1 + (it % 4));
    c.sink = it % 3 == 1;
    c.lse = it % 4 != 3;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int b = 0; b < n; ++b) {
      const int ql = 1 + static_cast<int>(rng() % 40);
      c.q_len.push_back(ql);
      c.kv_len.push_back(ql + static_cast<int>(rng() % 200));
    }
    SCOPED_TRACE(it);
    expect_good(c, 100 + it);
  }
}

TEST(CudaPlugin, DecodeRandomSweepWithSplits) {
  REQUIRE_GPU();
  std::mt19937 rng(99);
  const int dims[] = {64, 128, 256};
  const int pages[] = {1, 16, 32, 64, 128};
  for (int it = 0; it < 12; ++it) {
    Case c;
    c.op = ATTNRT_OP_DENSE_DECODE;
    c.dtype = it % 2 ? ATTNRT_BF16 : ATTNRT_F16;
    c.d = dims[it % 3];
    c.page = pages[it % 5];
    c.hkv = 1 + it % 2;
    c.hq = c.hkv * (1 + (it % 4) * 2);
    c.sink = it % 3 == 0;
    c.lse = it % 4 != 2;
    const int n = 1 + static_cast<int>(rng() % 5);
    for (int b = 0; b < n; ++b) {
      c.q_len.push_back(1);
      // Long single contexts force several splits (some possibly short/empty at the tail).
      c.kv_len.push_back(1 + static_cast<int>(rng() % (it < 4 ? 9000 : 700)));
    }
    SCOPED_TRACE(it);
    expect_good(c, 300 + it);
  }
}

// Optional timing (ATTNRT_GPU_BENCH=1): launch+kernel wall time per run after warm-up.
TEST(CudaPlugin, Bench) {
  REQUIRE_GPU();
  if (!std::getenv("ATTNRT_GPU_BENCH")) GTEST_SKIP() << "set ATTNRT_GPU_BENCH=1 to time";
  struct B {
    const char* name;
    int op, page, n, ql, kl;
  };
  const B shapes[] = {
      {"prefill 4k x4", ATTNRT_OP_DENSE_EXTEND, 64, 4, 4096, 4096},
      {"decode 1x128k", ATTNRT_OP_DENSE_DECODE, 64, 1, 1, 131072},
      {"decode 32x8k", ATTNRT_OP_DENSE_DECODE, 64, 32, 1, 8192},
      {"decode 64x32k", ATTNRT_OP_DENSE_DECODE, 64, 64, 1, 32768},
      {"decode 32x8k p128", ATTNRT_OP_DENSE_DECODE, 128, 32, 1, 8192},
  };
  for (const B& s : shapes) {
    Case c;
    c.op = s.op;
    c.hq = 32;
    c.hkv = 8;
    c.d = 128;
    c.page = s.page;
    c.q_len.assign(s.n, s.ql);
    c.kv_len.assign(s.n, s.kl);
    double ms = 0;
    // The host reference is O(T*kv); skip its cost for big shapes by checking only decode.
    Result r = run_case(c, 7, 1, &ms, 20, s.n == 1 && s.op == ATTNRT_OP_DENSE_DECODE);
    const double kv_bytes = 2.0 * s.n * s.kl * c.hkv * c.d * 2;
    const double flops = s.op == ATTNRT_OP_DENSE_EXTEND
                             ? 4.0 * s.n * c.hq * c.d * (double)s.ql * (s.ql + 1) / 2
                             : 4.0 * s.n * c.hq * c.d * (double)s.kl;
    std::printf("BENCH %-20s %9.3f ms  %8.1f TFLOP/s  %7.2f TB/s(kv)  rel_o %.2e (0: not checked)\n", s.name, ms,
                flops / ms / 1e9, kv_bytes / ms / 1e9,
                s.n == 1 ? r.rel_o : 0.0);
  }
}

}  // namespace
