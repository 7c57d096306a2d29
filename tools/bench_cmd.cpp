// `attnrt bench`: times attention ops on the cpu backend at the minimax-m3-tp4 shapes (or custom
// shapes) and reports each against ceilings measured in the same run: a register-only FMA loop
// on the same threads (fp32 peak) and a large streaming read (bandwidth).
// Calls the Backend directly (plan once, run repeatedly); only --backend cpu is served for now.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attnrt/attnrt.h"
#include "backends/cpu/cpu_backend.h"
#include "core/backend.h"

namespace {
using namespace attnrt;
using Clock = std::chrono::steady_clock;

struct BenchOpts {
  std::string suite = "cpu-m3", op, dtype = "bf16", backend = "cpu";
  int batch = 1, q_len = 0, kv_len = 4096, repeat = 5, warmup = 1, threads = 0;
  bool json = false;
};

struct HostMem : DeviceMemory {
  void* alloc(size_t n) override { return std::aligned_alloc(64, (n + 63) / 64 * 64); }
  void free(void* p) noexcept override { std::free(p); }
};

struct CaseSpec {
  std::string name;
  Op op;
  DType dt;
  int batch, q_len, kv_len;
};

// Register-only FMA loop on `threads` threads: fp32 FLOP/s ceiling.
__attribute__((target_clones("arch=x86-64-v4", "default"))) float fma_kernel(long iters,
                                                                          float seed) {
  float a[64];
  for (int i = 0; i < 64; ++i) a[i] = seed + i;
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < 64; ++i) a[i] = a[i] * 0.999999f + 1e-7f;
  float s = 0;
  for (int i = 0; i < 64; ++i) s += a[i];
  return s;
}

double measure_peak(int threads) {
  const long iters = 4000000;
  std::vector<std::thread> ts;
  std::vector<float> sink(threads);
  auto t0 = Clock::now();
  for (int i = 0; i < threads; ++i) ts.emplace_back([&, i] { sink[i] = fma_kernel(iters, i); });
  for (auto& t : ts) t.join();
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  volatile float keep = sink[0];
  (void)keep;
  return 2.0 * 64 * iters * threads / s;
}

double measure_bw(int threads) {
  const size_t n = size_t(1) << 27;  // 512 MiB of floats
  std::vector<float> buf(n, 1.0f);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<std::thread> ts;
    std::vector<double> part(threads);
    auto t0 = Clock::now();
    for (int i = 0; i < threads; ++i)
      ts.emplace_back([&, i] {
        size_t a = n * i / threads, b = n * (i + 1) / threads;
        double s = 0;
        for (size_t j = a; j < b; ++j) s += buf[j];
        part[i] = s;
      });
    for (auto& t : ts) t.join();
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, n * 4.0 / s);
  }
  return best;
}

void fill(std::vector<unsigned char>& v, DType dt, int64_t n, std::mt19937_64& rng) {
  v.resize(n * dtype_size(dt));
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < n; ++i) store_from_f32(v.data(), dt, i, nd(rng));
}

nlohmann::json run_case(Backend& be, const CaseSpec& c, const BenchOpts& o, double peak,
                        double bw) {
  const int Hq = 16, Hkv = 1, D = 128, Hi = 1, Di = 128, B = 128, K = 16, P = 128;
  Problem p;
  p.op = c.op;
  p.q_dtype = p.kv_dtype = c.dt;
  p.page_size = P;
  p.num_q_heads = Hq;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.num_index_heads = Hi;
  p.index_dim = Di;
  p.block_size = B;
  p.topk = K;
  p.local_blocks = 1;
  std::vector<int32_t> ql(c.batch, c.q_len), kl(c.batch, c.kv_len);
  std::vector<std::vector<int32_t>> pages;
  int npages = 0;
  for (int b = 0; b < c.batch; ++b) {
    std::vector<int32_t> pg;
    for (int i = 0; i < (c.kv_len + P - 1) / P; ++i) pg.push_back(npages++);
    std::reverse(pg.begin(), pg.end());
    pages.push_back(pg);
  }
  BatchLayout L = BatchLayout::make(P, ql, kl, pages);
  const int64_t T = L.total_q();
  std::mt19937_64 rng(1);
  std::vector<unsigned char> q, k, v, iq, ik, out;
  std::vector<int32_t> topk(size_t(Hi) * T * K);
  Tensors t;
  const Device cpu = Device::cpu();
  double pairs = 0;  // visible (query, key) pairs
  for (int b = 0; b < c.batch; ++b)
    for (int i = 0; i < c.q_len; ++i) {
      int64_t pos = c.kv_len - c.q_len + i;
      if (is_sparse_attend(c.op)) {
        int nvis = int(pos / B + 1);
        pairs += std::min<int64_t>(pos + 1, int64_t(std::min(K, nvis)) * B);  // approx: full blocks
      } else {
        pairs += pos + 1;
      }
    }
  double flops = 0, bytes = 0;
  if (is_index(c.op)) {
    fill(iq, c.dt, T * Hi * Di, rng);
    fill(ik, c.dt, int64_t(npages) * P * Di, rng);
    t.index_q = TensorView::contiguous(iq.data(), c.dt, cpu, {T, Hi, Di});
    t.index_k_cache = TensorView::contiguous(ik.data(), c.dt, cpu, {npages, P, 1, Di});
    t.topk = TensorView::contiguous(topk.data(), DType::i32, cpu, {Hi, T, K});
    flops = 2 * pairs * Hi * Di;
    bytes = double(c.batch) * c.kv_len * Di * dtype_size(c.dt);
  } else {
    fill(q, c.dt, T * Hq * D, rng);
    fill(k, c.dt, int64_t(npages) * P * Hkv * D, rng);
    fill(v, c.dt, int64_t(npages) * P * Hkv * D, rng);
    out.resize(T * Hq * D * dtype_size(c.dt));
    t.q = TensorView::contiguous(q.data(), c.dt, cpu, {T, Hq, D});
    t.k_cache = TensorView::contiguous(k.data(), c.dt, cpu, {npages, P, Hkv, D});
    t.v_cache = TensorView::contiguous(v.data(), c.dt, cpu, {npages, P, Hkv, D});
    t.out = TensorView::contiguous(out.data(), c.dt, cpu, {T, Hq, D});
    if (is_sparse_attend(c.op)) {
      // Selection: the last K visible blocks (ascending), i.e. local window of K blocks.
      for (int b = 0; b < c.batch; ++b)
        for (int i = 0; i < c.q_len; ++i) {
          int64_t r = L.q_indptr[b] + i, pos = c.kv_len - c.q_len + i;
          int nvis = int(pos / B + 1), n = std::min(K, nvis);
          for (int kk = 0; kk < K; ++kk) topk[r * K + kk] = kk < n ? nvis - n + kk : -1;
        }
      t.topk = TensorView::contiguous(topk.data(), DType::i32, cpu, {Hi, T, K});
    }
    flops = 4 * pairs * Hq * D;
    // K and V read once per group (per query row for decode).
    bytes = 2.0 * (pairs / std::max(1, c.q_len)) * Hkv * D * dtype_size(c.dt) *
            (is_decode(c.op) ? 1 : 1);
  }
  Workspace ws(cpu, std::make_shared<HostMem>());
  auto av = be.probe(p);
  if (!av) throw InvalidArgument("bench: cpu backend unavailable: " + av.reason);
  auto pl = be.plan(p, L, ws);
  for (int i = 0; i < o.warmup; ++i) be.run(*pl, p, L, t, ws);
  std::vector<double> ts;
  for (int i = 0; i < o.repeat; ++i) {
    auto t0 = Clock::now();
    be.run(*pl, p, L, t, ws);
    ts.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  double med = ts[ts.size() / 2];
  double roof = std::max(flops / peak, bytes / bw);
  return {{"case", c.name},       {"op", op_name(c.op)},   {"dtype", dtype_name(c.dt)},
          {"batch", c.batch},     {"q_len", c.q_len},      {"kv_len", c.kv_len},
          {"median_ms", med * 1e3}, {"gflops", flops / med / 1e9}, {"gbps", bytes / med / 1e9},
          {"roofline_ms", roof * 1e3}, {"frac_roofline", roof / med}};
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto o = std::make_shared<BenchOpts>();
  auto* cmd = app.add_subcommand("bench", "benchmark attention ops against measured ceilings");
  cmd->add_option("--suite", o->suite, "named suite (cpu-m3) or 'custom'");
  cmd->add_option("--op", o->op, "custom case op (e.g. dense_extend); implies --suite custom");
  cmd->add_option("--batch", o->batch);
  cmd->add_option("--q-len", o->q_len, "0: kv_len for extend, 1 for decode");
  cmd->add_option("--kv-len", o->kv_len);
  cmd->add_option("--dtype", o->dtype);
  cmd->add_option("--repeat", o->repeat);
  cmd->add_option("--warmup", o->warmup);
  cmd->add_option("--threads", o->threads, "0: all cores");
  cmd->add_flag("--json", o->json);
  cmd->add_option("--backend", o->backend);
  cmd->callback([o] {
    if (o->backend != "cpu") throw InvalidArgument("bench: --backend '" + o->backend +
                                                   "' not supported yet (expected cpu)");
    int threads = o->threads > 0 ? o->threads : int(std::max(1u, std::thread::hardware_concurrency()));
    auto be = make_cpu_backend(threads);
    std::vector<CaseSpec> cases;
    if (!o->op.empty()) {
      Op op = parse_op(o->op);
      int ql = is_decode(op) ? 1 : (o->q_len > 0 ? o->q_len : o->kv_len);
      cases.push_back({"custom", op, parse_dtype(o->dtype, "--dtype"), o->batch, ql, o->kv_len});
    } else if (o->suite == "cpu-m3") {
      for (DType dt : {DType::bf16, DType::f32}) {
        cases.push_back({"dense extend 4096x4096", Op::dense_extend, dt, 1, 4096, 4096});
        cases.push_back({"dense decode 8x16k", Op::dense_decode, dt, 8, 1, 16384});
        cases.push_back({"index extend 1024@8k", Op::sparse_index_extend, dt, 1, 1024, 8192});
        cases.push_back({"sparse extend 1024@8k", Op::sparse_attend_extend, dt, 1, 1024, 8192});
        cases.push_back({"sparse decode 8x32k", Op::sparse_attend_decode, dt, 8, 1, 32768});
      }
    } else {
      throw InvalidArgument("bench: --suite '" + o->suite + "' unknown (expected cpu-m3)");
    }
    const double peak = measure_peak(threads), bw = measure_bw(threads);
    nlohmann::json res = {{"threads", threads}, {"fma_peak_gflops", peak / 1e9},
                          {"stream_read_gbps", bw / 1e9}, {"cases", nlohmann::json::array()}};
    for (auto& c : cases) res["cases"].push_back(run_case(*be, c, *o, peak, bw));
    if (o->json) {
      std::cout << res.dump(2) << "\n";
      return;
    }
    std::printf("threads %d  fp32 FMA peak %.1f GFLOP/s  stream read %.1f GB/s\n", threads,
                peak / 1e9, bw / 1e9);
    std::printf("%-24s %-5s %10s %10s %8s %10s\n", "case", "dtype", "median_ms", "GFLOP/s",
                "GB/s", "%roofline");
    for (auto& r : res["cases"])
      std::printf("%-24s %-5s %10.2f %10.1f %8.1f %9.1f%%\n",
                  r["case"].get<std::string>().c_str(), r["dtype"].get<std::string>().c_str(),
                  r["median_ms"].get<double>(), r["gflops"].get<double>(),
                  r["gbps"].get<double>(), 100 * r["frac_roofline"].get<double>());
  });
}
