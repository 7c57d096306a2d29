// `attnrt bench`: times attention ops through the public Runtime API (plan once, run
// repeatedly, as a user's forward pass does) at the minimax-m3-tp4 shapes or custom shapes, and
// reports each case against ceilings measured in the same run on the same threads:
//   * fp32 FMA peak: a register-only FMA loop (AVX-512 / AVX2 / scalar, chosen at run time), the
//     compute ceiling of %roof;
//   * bf16 dot peak, on CPUs with AVX512-BF16: the same loop of vdpbf16ps, the instruction the
//     avx512bf16 kernel set multiplies bf16 q, K, V with (2x the FMA peak on Zen 5, half of it
//     on Sapphire Rapids; shown, not in %roof);
//   * OpenBLAS sgemm (2048^3, loaded with dlopen so the program does not depend on it; its
//     environment variables are left as they are, only its thread count is set to ours);
//   * streaming read: a vectorised sum over a 512 MiB buffer.
// Work is counted as design.md §8 says: FLOPs of visible (query, key) pairs only; bytes of K/V
// (or index keys) actually read, once per KV group.
#include <CLI/CLI.hpp>
#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attnrt/attnrt.h"
#include "cli_common.h"
#include "core/cpu_dispatch.h"

namespace {
using namespace attnrt;
using Clock = std::chrono::steady_clock;

struct BenchOpts {
  std::string suite, op, dtype = "bf16", backend, device = "cpu";
  int batch = 1, q_len = 0, kv_len = 4096, repeat = 5, warmup = 1, threads = 0;
  int q_heads = 16, kv_heads = 1, head_dim = 128, page_size = 128;
  bool json = false;
};

// One timed case. Heads and page size default to the minimax-m3-tp4 per-rank shape (16 q heads,
// 1 KV head, D=128; 1 index head, D_idx=128; block 128, top-16; page 128).
struct CaseSpec {
  std::string name;
  Op op;
  DType dt;
  int batch, q_len, kv_len;
  int hq = 16, hkv = 1, d = 128, page = 128;
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- ceilings ----------------------------------------------------------------------------------

// Independent FMA chains, enough to cover FMA latency x pipes, each held in a register: the
// inner loops are unrolled by pragma, or -O2 keeps the chains in memory and the probe measures
// store forwarding instead (half the peak on an AVX2 machine). AVX2 has 16 vector registers, so
// 12 chains + 2 constants; AVX-512 has 32.
constexpr int kChains512 = 16, kChains256 = 12, kChainsScalar = 16;

// The sum of every lane of the AVX-512 probes' chains (kept, so the loops are not dead code).
__attribute__((target("avx512f"))) float sum_chains512(const __m512* a) {
  __m512 s = a[0];
  for (int i = 1; i < kChains512; ++i) s = _mm512_add_ps(s, a[i]);
  float out[16], sum = 0;
  _mm512_storeu_ps(out, s);
  for (float x : out) sum += x;
  return sum;
}

__attribute__((target("avx512f"))) float fma_avx512(long iters, float seed) {
  __m512 a[kChains512];
  for (int i = 0; i < kChains512; ++i) a[i] = _mm512_set1_ps(seed + i);
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (long it = 0; it < iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < kChains512; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
  return sum_chains512(a);
}

__attribute__((target("avx2,fma"))) float fma_avx2(long iters, float seed) {
  __m256 a[kChains256];
  for (int i = 0; i < kChains256; ++i) a[i] = _mm256_set1_ps(seed + i);
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (long it = 0; it < iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < kChains256; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
  float out[8], s = 0;
  for (int i = 1; i < kChains256; ++i) a[0] = _mm256_add_ps(a[0], a[i]);
  _mm256_storeu_ps(out, a[0]);
  for (float x : out) s += x;
  return s;
}

float fma_scalar(long iters, float seed) {
  float a[kChainsScalar];
  for (int i = 0; i < kChainsScalar; ++i) a[i] = seed + i;
  for (long it = 0; it < iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < kChainsScalar; ++i) a[i] = std::fma(a[i], 0.999999f, 1e-7f);
  float s = 0;
  for (float x : a) s += x;
  return s;
}

// bf16 pair dot products (vdpbf16ps, 32 multiply-adds per instruction), the instruction of the
// cpu backend's avx512bf16 kernel set, chained as the FMA probe.
__attribute__((target("avx512f,avx512bf16"))) float dot_bf16_avx512(long iters, float seed) {
  __m512 a[kChains512];
  for (int i = 0; i < kChains512; ++i) a[i] = _mm512_set1_ps(seed + i);
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  for (long it = 0; it < iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < kChains512; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, x);
  return sum_chains512(a);
}

// FLOP/s of `kernel` (flops_per_iter per iteration) on `threads` threads, best of 3.
double measure_peak(int threads, float (*kernel)(long, float), long iters, double flops_per_iter) {
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<std::thread> ts;
    std::vector<float> keep(threads);
    const auto t0 = Clock::now();
    for (int i = 0; i < threads; ++i) ts.emplace_back([&, i] { keep[i] = kernel(iters, i); });
    for (auto& t : ts) t.join();
    const double s = seconds_since(t0);
    volatile float sink = keep[0];
    (void)sink;
    best = std::max(best, flops_per_iter * iters * threads / s);
  }
  return best;
}

// bf16 dot-product FLOP/s over `threads` threads; 0 when the CPU lacks AVX512-BF16.
double measure_bf16_dot_peak(int threads) {
  if (!cpu_supports(CpuIsa::avx512_bf16)) return 0;
  return measure_peak(threads, dot_bf16_avx512, 20000000, 2.0 * 32 * kChains512);
}

// Returns FLOP/s over `threads` threads and the name of the variant used.
double measure_fma_peak(int threads, std::string* isa) {
  int lanes = 1, chains = kChainsScalar;
  float (*kernel)(long, float) = fma_scalar;
  *isa = "scalar";
  // The levels the cpu backend's kernel sets use, so the ceiling is that of the code it bounds.
  if (best_cpu_isa() >= CpuIsa::avx512) {
    kernel = fma_avx512, lanes = 16, chains = kChains512, *isa = "avx512";
  } else if (best_cpu_isa() == CpuIsa::avx2) {
    kernel = fma_avx2, lanes = 8, chains = kChains256, *isa = "avx2";
  }
  return measure_peak(threads, kernel, lanes == 1 ? 2000000 : 20000000, 2.0 * chains * lanes);
}

ATTNRT_TARGET_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default") float sum_floats(
    const float* p, size_t n) {
  typedef float v16 __attribute__((vector_size(64)));
  v16 acc[8] = {};
  size_t i = 0;
  for (; i + 128 <= n; i += 128)
    for (int k = 0; k < 8; ++k) {
      v16 x;
      std::memcpy(&x, p + i + 16 * k, sizeof x);
      acc[k] += x;
    }
  float s = 0;
  for (; i < n; ++i) s += p[i];
  for (int k = 0; k < 8; ++k)
    for (int j = 0; j < 16; ++j) s += acc[k][j];
  return s;
}

double measure_stream_read(int threads) {
  const size_t n = size_t(1) << 27;  // 512 MiB of floats
  std::vector<float> buf(n, 1.0f);
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    std::vector<std::thread> ts;
    std::vector<float> part(threads);
    const auto t0 = Clock::now();
    for (int i = 0; i < threads; ++i)
      ts.emplace_back([&, i] {
        const size_t a = n * i / threads, b = n * (i + 1) / threads;
        part[i] = sum_floats(buf.data() + a, b - a);
      });
    for (auto& t : ts) t.join();
    best = std::max(best, n * 4.0 / seconds_since(t0));
  }
  return best;
}

// OpenBLAS sgemm 2048^3 on `threads` threads; 0 when OpenBLAS cannot be loaded.
double measure_sgemm(int threads, std::string* note) {
  void* lib = nullptr;
  for (const char* name : {"libopenblas.so.0", "libopenblas.so"})
    if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
  if (!lib) {
    *note = "OpenBLAS not found";
    return 0;
  }
  using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                         int, float, float*, int);
  auto sgemm = reinterpret_cast<Sgemm>(dlsym(lib, "cblas_sgemm"));
  auto set_threads = reinterpret_cast<void (*)(int)>(dlsym(lib, "openblas_set_num_threads"));
  auto get_core = reinterpret_cast<char* (*)()>(dlsym(lib, "openblas_get_corename"));
  if (!sgemm) {
    *note = "cblas_sgemm missing";
    return 0;
  }
  if (set_threads) set_threads(threads);
  if (get_core) *note = std::string("OpenBLAS core ") + get_core();
  const int N = 2048;
  std::vector<float> a(size_t(N) * N, 0.5f), b(size_t(N) * N, 0.25f), c(size_t(N) * N);
  constexpr int kRowMajor = 101, kNoTrans = 111;
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    const auto t0 = Clock::now();
    sgemm(kRowMajor, kNoTrans, kNoTrans, N, N, N, 1.0f, a.data(), N, b.data(), N, 0.0f, c.data(),
          N);
    if (rep > 0) best = std::max(best, 2.0 * N * N * N / seconds_since(t0));
  }
  return best;
}

// ---- one case ----------------------------------------------------------------------------------

struct Buffer {
  std::vector<unsigned char> host;
  DeviceBuffer dev;
};

void fill(Runtime& rt, const Device& d, Buffer& b, DType dt, int64_t n, std::mt19937_64& rng) {
  b.host.resize(std::max<int64_t>(n, 1) * dtype_size(dt));
  if (dt == DType::i32)
    std::memset(b.host.data(), 0, b.host.size());
  else
    attnrt_cli::fill_normal(b.host.data(), dt, n, rng());
  b.dev = rt.allocate(d, b.host.size());
  rt.copy_to_device(b.dev, b.host.data(), b.host.size());
}

struct Ceilings {
  double fma = 0, sgemm = 0, stream = 0;
  double bf16_dot = 0;  // 0: no bf16 dot products on this CPU
};

nlohmann::json run_case(Runtime& rt, const Device& dev, const CaseSpec& c, const BenchOpts& o,
                        const Ceilings& ceil) {
  const int Hq = c.hq, Hkv = c.hkv, D = c.d, Hi = 1, Di = 128, B = 128, K = 16, P = c.page;
  Problem p;
  p.op = c.op;
  p.device = dev;
  p.q_dtype = p.kv_dtype = c.dt;
  p.page_size = P;
  if (reads_attention_inputs(c.op)) {
    p.num_q_heads = Hq;
    p.num_kv_heads = Hkv;
    p.head_dim = D;
  }
  if (!is_dense(c.op)) {
    p.num_index_heads = Hi;
    p.block_size = B;
    p.topk = K;
  }
  if (reads_index_inputs(c.op)) {
    p.index_dim = Di;
    p.local_blocks = 1;
  }
  std::vector<int32_t> ql(c.batch, c.q_len), kl(c.batch, c.kv_len);
  std::vector<std::vector<int32_t>> pages;
  int npages = 0;
  for (int b = 0; b < c.batch; ++b) {
    std::vector<int32_t> pg;
    for (int i = 0; i < (c.kv_len + P - 1) / P; ++i) pg.push_back(npages++);
    std::reverse(pg.begin(), pg.end());  // scattered pages, not 0, 1, 2, ...
    pages.push_back(pg);
  }
  const BatchLayout L = BatchLayout::make(P, ql, kl, pages);
  const int64_t T = L.total_q();
  // A caller's selection (sparse_attend_*) is the last K visible blocks of each row (the local
  // window). The indexer of sparse_decode selects K blocks too, the own (partial) block among
  // them, so its attention reads as many keys.
  std::vector<int32_t> topk(size_t(Hi) * T * K, -1);
  // Visible (query, key) pairs and keys read once per KV group, of the indexer (every visible
  // key) and of attention (the selected blocks' keys when sparse).
  double index_pairs = 0, index_keys = 0, attend_pairs = 0, attend_keys = 0;
  const bool selected = attends_selected_blocks(c.op);
  for (int b = 0; b < c.batch; ++b)
    for (int i = 0; i < c.q_len; ++i) {
      const int64_t r = L.q_indptr[b] + i, pos = c.kv_len - c.q_len + i;
      const int nvis = int(pos / B + 1), n = std::min(K, nvis);
      if (reads_topk_input(c.op))
        for (int kk = 0; kk < n; ++kk) topk[r * K + kk] = nvis - n + kk;
      index_pairs += double(pos + 1);
      attend_pairs += selected ? double(pos + 1) - double(nvis - n) * B : double(pos + 1);
      if (i == c.q_len - 1) {
        index_keys += pos + 1;
        attend_keys += selected ? std::min<double>(pos + 1, K * B) : pos + 1;
      }
    }
  std::mt19937_64 rng(1);
  Buffer q, k, v, iq, ik, out, tk;
  Tensors t;
  const size_t es = dtype_size(c.dt);
  // sparse_decode counts as the sum of its two steps.
  double flops = 0, bytes = 0;
  if (reads_index_inputs(c.op)) {
    fill(rt, dev, iq, c.dt, T * Hi * Di, rng);
    fill(rt, dev, ik, c.dt, int64_t(npages) * P * Di, rng);
    fill(rt, dev, tk, DType::i32, int64_t(Hi) * T * K, rng);
    t.index_q = TensorView::contiguous(iq.dev.data(), c.dt, dev, {T, Hi, Di});
    t.index_k_cache = TensorView::contiguous(ik.dev.data(), c.dt, dev, {npages, P, 1, Di});
    t.topk = TensorView::contiguous(tk.dev.data(), DType::i32, dev, {Hi, T, K});
    flops += 2 * index_pairs * Hi * Di;
    bytes += index_keys * Di * es;
  }
  if (reads_attention_inputs(c.op)) {
    fill(rt, dev, q, c.dt, T * Hq * D, rng);
    fill(rt, dev, k, c.dt, int64_t(npages) * P * Hkv * D, rng);
    fill(rt, dev, v, c.dt, int64_t(npages) * P * Hkv * D, rng);
    fill(rt, dev, out, c.dt, T * Hq * D, rng);
    t.q = TensorView::contiguous(q.dev.data(), c.dt, dev, {T, Hq, D});
    t.k_cache = TensorView::contiguous(k.dev.data(), c.dt, dev, {npages, P, Hkv, D});
    t.v_cache = TensorView::contiguous(v.dev.data(), c.dt, dev, {npages, P, Hkv, D});
    t.out = TensorView::contiguous(out.dev.data(), c.dt, dev, {T, Hq, D});
    if (reads_topk_input(c.op)) {
      tk.dev = rt.allocate(dev, topk.size() * sizeof(int32_t));
      rt.copy_to_device(tk.dev, topk.data(), topk.size() * sizeof(int32_t));
      t.topk = TensorView::contiguous(tk.dev.data(), DType::i32, dev, {Hi, T, K});
    }
    flops += 4 * attend_pairs * Hq * D;
    bytes += 2 * attend_keys * Hkv * D * es;
  }
  auto plan = rt.plan(p, L);  // once, like a forward pass reuses it over its layers
  for (int i = 0; i < o.warmup; ++i) rt.run(*plan, t);
  rt.synchronize(dev);
  // On an accelerator, one sample queues enough runs for >= 2 ms so that launch and
  // synchronisation latency do not dominate short kernels; a sample's time is per run.
  int per_sample = 1;
  if (dev.kind != DeviceKind::cpu) {
    const auto t0 = Clock::now();
    rt.run(*plan, t);
    rt.synchronize(dev);
    per_sample = int(std::clamp(2e-3 / std::max(seconds_since(t0), 1e-7), 1.0, 200.0));
  }
  std::vector<double> ts;
  for (int i = 0; i < o.repeat; ++i) {
    const auto t0 = Clock::now();
    for (int k = 0; k < per_sample; ++k) rt.run(*plan, t);
    rt.synchronize(dev);
    ts.push_back(seconds_since(t0) / per_sample);
  }
  std::sort(ts.begin(), ts.end());
  const double med = ts[ts.size() / 2];
  const double roof = ceil.fma > 0 ? std::max(flops / ceil.fma, bytes / ceil.stream) : 0.0;
  nlohmann::json r = {{"case", c.name},
                      {"op", op_name(c.op)},
                      {"dtype", dtype_name(c.dt)},
                      {"backend", plan->backend()},
                      {"batch", c.batch},
                      {"q_len", c.q_len},
                      {"kv_len", c.kv_len},
                      {"q_heads", c.hq},
                      {"kv_heads", c.hkv},
                      {"head_dim", c.d},
                      {"page_size", c.page},
                      {"median_ms", med * 1e3},
                      {"min_ms", ts.front() * 1e3},
                      {"ms_per_sequence", med * 1e3 / c.batch},
                      {"gflop", flops / 1e9},
                      {"mbytes", bytes / 1e6},
                      {"gflops", flops / med / 1e9},
                      {"gbps", bytes / med / 1e9},
                      {"runs_per_sample", per_sample}};
  // Ceilings are measured for the host only; an accelerator's are measured beside its peer
  // (bench/cuda_side_by_side.py).
  r["roofline_ms"] = r["bound"] = r["frac_roofline"] = nlohmann::json();
  if (roof > 0) {
    r["roofline_ms"] = roof * 1e3;
    r["bound"] = flops / ceil.fma >= bytes / ceil.stream ? "compute" : "memory";
    r["frac_roofline"] = roof / med;
  }
  r["frac_sgemm"] = ceil.sgemm > 0 ? nlohmann::json(flops / med / ceil.sgemm) : nlohmann::json();
  return r;
}

std::vector<CaseSpec> cpu_m3_suite() {
  std::vector<CaseSpec> cases;
  for (DType dt : {DType::bf16, DType::f32}) {
    cases.push_back({"dense extend 4096x4096", Op::dense_extend, dt, 1, 4096, 4096});
    cases.push_back({"dense extend 1024@8k", Op::dense_extend, dt, 1, 1024, 8192});
    cases.push_back({"dense decode 8x16k", Op::dense_decode, dt, 8, 1, 16384});
    cases.push_back({"dense decode 1x16k", Op::dense_decode, dt, 1, 1, 16384});
    cases.push_back({"index extend 1024@8k", Op::sparse_index_extend, dt, 1, 1024, 8192});
    cases.push_back({"index decode 8x32k", Op::sparse_index_decode, dt, 8, 1, 32768});
    cases.push_back({"sparse extend 1024@8k", Op::sparse_attend_extend, dt, 1, 1024, 8192});
    cases.push_back({"sparse decode 8x32k", Op::sparse_attend_decode, dt, 8, 1, 32768});
    cases.push_back({"fused decode 8x32k", Op::sparse_decode, dt, 8, 1, 32768});
  }
  return cases;
}

// Dense attention at the shapes PyTorch SDPA is compared on (Hq=32, Hkv=8, d=128, bf16):
// causal prefill and decode, through pages of 64 (scattered), 128, and one page per request.
std::vector<CaseSpec> cuda_dense_suite() {
  std::vector<CaseSpec> cases;
  auto add = [&](std::string name, Op op, int batch, int len, int page) {
    CaseSpec c{std::move(name), op, DType::bf16, batch, op == Op::dense_extend ? len : 1, len};
    c.hq = 32, c.hkv = 8, c.d = 128, c.page = page;
    cases.push_back(c);
  };
  add("prefill 4k x4", Op::dense_extend, 4, 4096, 64);
  add("prefill 16k", Op::dense_extend, 1, 16384, 64);
  add("prefill 64k", Op::dense_extend, 1, 65536, 64);
  for (auto [b, len] : {std::pair{1, 131072}, {32, 8192}, {64, 32768}}) {
    const std::string name = "decode " + std::to_string(b) + "x" + std::to_string(len / 1024) + "k";
    add(name, Op::dense_decode, b, len, 64);
    add(name + " p128", Op::dense_decode, b, len, 128);
    add(name + " contig", Op::dense_decode, b, len, len);
  }
  return cases;
}

// MiniMax-M3 sparse layers per rank (16 q heads, 1 KV head, 1 index head, D = D_idx = 128,
// block = page = 128, top-16, bf16): the indexer, sparse attend and both in one call
// (sparse_decode), decode at batch 1/16/64 and 64k/128k context, and the extend of 8192 new
// tokens at 64k. Sparse attend alone selects the last 16 visible blocks of each row.
// (ATTNRT_DISABLE=cuda_sm90 times the generic CUDA kernels.)
std::vector<CaseSpec> cuda_sparse_suite() {
  std::vector<CaseSpec> cases;
  for (auto [b, len] : {std::pair{1, 65536}, {1, 131072}, {16, 65536}, {64, 65536}, {64, 131072}}) {
    const std::string shape = std::to_string(b) + "x" + std::to_string(len / 1024) + "k";
    cases.push_back({"index decode " + shape, Op::sparse_index_decode, DType::bf16, b, 1, len});
    cases.push_back({"attend decode " + shape, Op::sparse_attend_decode, DType::bf16, b, 1, len});
    cases.push_back({"sparse_decode " + shape, Op::sparse_decode, DType::bf16, b, 1, len});
  }
  cases.push_back({"index extend 8192@64k", Op::sparse_index_extend, DType::bf16, 1, 8192, 65536});
  cases.push_back({"attend extend 8192@64k", Op::sparse_attend_extend, DType::bf16, 1, 8192, 65536});
  return cases;
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto o = std::make_shared<BenchOpts>();
  auto* cmd = app.add_subcommand("bench", "benchmark attention ops against measured ceilings");
  cmd->add_option("--suite", o->suite,
                  "named suite: cpu-m3 (minimax-m3-tp4 shapes, all ops; the default on cpu) or "
                  "cuda-dense (Hq=32 Hkv=8 d=128 prefill/decode, paged and contiguous; the "
                  "default on cuda) or cuda-sparse (minimax-m3-tp4 indexer, sparse attend and "
                  "sparse_decode, decode at batch 1/16/64 x 64k/128k and extend 8192@64k)");
  std::string op_names;
  for (int i = 0; i < kNumOps; ++i) op_names += (i ? ", " : "") + std::string(op_name(Op(i)));
  cmd->add_option("--op", o->op, "a single custom case of this op: " + op_names);
  cmd->add_option("--batch", o->batch, "custom case: requests")->capture_default_str();
  cmd->add_option("--q-len", o->q_len, "custom case: query tokens (0: kv_len for extend)");
  cmd->add_option("--kv-len", o->kv_len, "custom case: context length")->capture_default_str();
  cmd->add_option("--dtype", o->dtype, "custom case: f32, f16 or bf16")->capture_default_str();
  cmd->add_option("--repeat", o->repeat, "timed runs per case (median reported)")
      ->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "untimed runs per case first")->capture_default_str();
  cmd->add_option("--q-heads", o->q_heads, "custom case: query heads")->capture_default_str();
  cmd->add_option("--kv-heads", o->kv_heads, "custom case: KV heads")->capture_default_str();
  cmd->add_option("--head-dim", o->head_dim, "custom case: head dim")->capture_default_str();
  cmd->add_option("--page-size", o->page_size, "custom case: KV page size")->capture_default_str();
  cmd->add_option("--threads", o->threads, "cpu threads (0: ATTNRT_NUM_THREADS or all cores)");
  cmd->add_option("--backend", o->backend,
                  "backend to force, failing if it cannot serve (default: cpu on the host, "
                  "automatic choice on an accelerator)");
  cmd->add_option("--device", o->device, "cpu or cuda:N")->capture_default_str();
  cmd->add_flag("--json", o->json, "machine-readable output");
  attnrt_cli::read_integers_as_decimal(*cmd);
  cmd->callback([o, cmd] {
    if (o->repeat < 1) throw InvalidArgument("bench: --repeat " + std::to_string(o->repeat) + " (expected >= 1)");
    if (o->warmup < 0) throw InvalidArgument("bench: --warmup " + std::to_string(o->warmup) + " (expected >= 0)");
    if (o->threads < 0 || o->threads > 4096)
      throw InvalidArgument("bench: --threads " + std::to_string(o->threads) + " (expected 0..4096)");
    const Device dev = Device::parse(o->device);
    const bool host = dev.kind == DeviceKind::cpu;
    // --backend, else ATTNRT_BACKEND, else the cpu backend on the host (its kernels are what a
    // host bench measures) and the automatic choice on an accelerator.
    const char* env_backend = std::getenv("ATTNRT_BACKEND");
    std::string backend = !o->backend.empty()              ? o->backend
                          : env_backend && *env_backend ? std::string(env_backend)
                          : host                        ? "cpu"
                                                        : "";
    RuntimeOptions ro;
    ro.force_backend = backend;
    if (o->threads > 0) ro.num_threads = o->threads;
    std::unique_ptr<Runtime> runtime;
    try {
      runtime = std::make_unique<Runtime>(ro);
    } catch (const InvalidArgument& e) {
      const std::string m = e.what(), env_name = "ATTNRT_BACKEND";
      if (o->backend.empty() || m.rfind(env_name, 0) != 0) throw;
      throw InvalidArgument("bench: --backend" + m.substr(env_name.size()));
    }
    Runtime& rt = *runtime;
    const std::vector<Device> devices = rt.devices();
    if (std::find(devices.begin(), devices.end(), dev) == devices.end()) {
      std::string have;
      for (const Device& d : devices) have += (have.empty() ? "" : ", ") + d.str();
      throw InvalidArgument("bench: --device " + dev.str() + ": no backend serves it (devices: " +
                            have + "; `attnrt doctor` says why)");
    }
    if (backend.empty()) backend = "auto";
    int threads = o->threads;
    if (threads == 0) {
      const char* env = std::getenv("ATTNRT_NUM_THREADS");
      threads = env && std::atoi(env) > 0 ? std::atoi(env)
                                          : int(std::max(1u, std::thread::hardware_concurrency()));
    }
    std::vector<CaseSpec> cases;
    const char* custom_only[] = {"--batch", "--q-len", "--kv-len", "--dtype", "--q-heads",
                                 "--kv-heads", "--head-dim", "--page-size"};
    if (!o->op.empty() && !o->suite.empty())
      throw InvalidArgument("bench: --op and --suite both given (expected one: a custom case or a suite)");
    if (o->op.empty())
      for (const char* flag : custom_only)
        if (cmd->count(flag))
          throw InvalidArgument(std::string("bench: ") + flag +
                                " shapes a custom case and needs --op (a suite has its own shapes)");
    if (!o->op.empty()) {
      const Op op = parse_op(o->op);
      // The indexer's shape is fixed (1 index head, index dim 128): attention-shape flags
      // would be reported without having shaped anything.
      if (!reads_attention_inputs(op))
        for (const char* flag : {"--q-heads", "--kv-heads", "--head-dim"})
          if (cmd->count(flag))
            throw InvalidArgument(std::string("bench: ") + flag + " does not apply to " +
                                  op_name(op) + " (1 index head of dim 128)");
      if (!is_dense(op) && o->kv_heads != 1)
        throw InvalidArgument("bench: --kv-heads " + std::to_string(o->kv_heads) + " with " +
                              op_name(op) + " (expected 1: the sparse case has one index head, "
                              "which must be shared by whole KV heads)");
      // The limits of `attnrt run`: token, page and row counts stay in 32-bit ints.
      auto within = [](const char* option, int64_t v, int64_t lo, int64_t hi, const char* what = "") {
        if (v < lo || v > hi)
          throw InvalidArgument(std::string("bench: ") + option + " " + std::to_string(v) + what +
                                " (expected " + std::to_string(lo) + ".." + std::to_string(hi) + ")");
      };
      within("--batch", o->batch, 1, 1 << 16);
      within("--kv-len", o->kv_len, 1, 1 << 24);
      within("--page-size", o->page_size, 1, 1 << 16);
      within("--q-len", o->q_len, 0, o->kv_len);
      if (is_decode(op) && o->q_len > 1)
        throw InvalidArgument("bench: --q-len " + std::to_string(o->q_len) + " with " +
                              std::string(op_name(op)) + " (a decode op has one query token)");
      const int64_t pages = (int64_t{o->kv_len} + o->page_size - 1) / o->page_size;
      within("--batch x --kv-len", int64_t{o->batch} * o->kv_len, 1,
             std::numeric_limits<int32_t>::max(), " tokens");
      within("--batch x pages per request", o->batch * pages, 1, 1 << 24, " pages");
      const int ql = is_decode(op) ? 1 : (o->q_len > 0 ? o->q_len : o->kv_len);
      CaseSpec c{"custom", op, parse_dtype(o->dtype, "--dtype"), o->batch, ql, o->kv_len};
      c.hq = o->q_heads, c.hkv = o->kv_heads, c.d = o->head_dim, c.page = o->page_size;
      cases.push_back(c);
    } else {
      const std::string suite = o->suite.empty() ? (host ? "cpu-m3" : "cuda-dense") : o->suite;
      if (host && suite.rfind("cuda-", 0) == 0)
        throw InvalidArgument("bench: --suite " + suite + " times GPU shapes (up to 64 x 128k "
                              "tokens) and needs --device cuda:N");
      if (suite == "cpu-m3")
        cases = cpu_m3_suite();
      else if (suite == "cuda-dense")
        cases = cuda_dense_suite();
      else if (suite == "cuda-sparse")
        cases = cuda_sparse_suite();
      else
        throw InvalidArgument("bench: --suite '" + suite + "' unknown (expected cpu-m3, cuda-dense or cuda-sparse)");
    }
    Ceilings ceil;
    std::string isa, blas_note;
    if (host) {
      ceil.fma = measure_fma_peak(threads, &isa);
      ceil.bf16_dot = measure_bf16_dot_peak(threads);
      ceil.sgemm = measure_sgemm(threads, &blas_note);
      ceil.stream = measure_stream_read(threads);
    }
    nlohmann::json res = {{"threads", threads},
                          {"backend", backend},
                          {"device", dev.str()},
                          {"fma_peak_gflops", ceil.fma / 1e9},
                          {"fma_isa", isa},
                          {"bf16_dot_peak_gflops", ceil.bf16_dot / 1e9},
                          {"kernels", rt.describe_device(dev)},
                          {"sgemm_gflops", ceil.sgemm / 1e9},
                          {"sgemm_note", blas_note},
                          {"stream_read_gbps", ceil.stream / 1e9},
                          {"cases", nlohmann::json::array()}};
    for (size_t i = 0; i < cases.size(); ++i) {
      if (cases.size() > 1)  // a suite takes minutes: progress on stderr, results on stdout
        std::fprintf(stderr, "bench: case %zu of %zu: %s\n", i + 1, cases.size(), cases[i].name.c_str());
      res["cases"].push_back(run_case(rt, dev, cases[i], *o, ceil));
    }
    // Sparse attend extend vs (selected fraction x dense extend) at the same shape (issue 4).
    nlohmann::json derived = nlohmann::json::array();
    for (auto& sp : res["cases"])
      for (auto& dn : res["cases"])
        if (sp["op"] == "sparse_attend_extend" && dn["op"] == "dense_extend" &&
            sp["dtype"] == dn["dtype"] && sp["q_len"] == dn["q_len"] &&
            sp["kv_len"] == dn["kv_len"] && sp["batch"] == dn["batch"]) {
          const double frac = sp["gflop"].get<double>() / dn["gflop"].get<double>();
          derived.push_back({{"dtype", sp["dtype"]},
                             {"selected_fraction", frac},
                             {"sparse_over_fraction_x_dense",
                              sp["median_ms"].get<double>() / (frac * dn["median_ms"].get<double>())}});
        }
    res["sparse_vs_dense"] = derived;
    if (o->json) {
      std::cout << res.dump(2) << "\n";
      return;
    }
    if (host) {
      std::printf("backend %s (%s)  threads %d  fp32 FMA peak %.1f GFLOP/s (%s)", backend.c_str(),
                  rt.describe_device(dev).c_str(), threads, ceil.fma / 1e9, isa.c_str());
      if (ceil.bf16_dot > 0) std::printf("  bf16 dot peak %.1f GFLOP/s", ceil.bf16_dot / 1e9);
      std::printf("  sgemm %.1f GFLOP/s (%s)  stream read %.1f GB/s\n", ceil.sgemm / 1e9,
                  blas_note.c_str(), ceil.stream / 1e9);
    } else
      std::printf("backend %s  device %s  (ceilings: bench/cuda_side_by_side.py measures them)\n",
                  backend.c_str(), dev.str().c_str());
    std::printf("%-24s %-5s %10s %9s %9s %8s %8s %7s\n", "case", "dtype", "median_ms", "ms/seq",
                "GFLOP/s", "GB/s", "%roof", "%sgemm");
    auto pct = [](const nlohmann::json& v) {
      char b[16] = "-";
      if (!v.is_null()) std::snprintf(b, sizeof b, "%.1f%%", 100 * v.get<double>());
      return std::string(b);
    };
    for (auto& r : res["cases"])
      std::printf("%-24s %-5s %10.3f %9.3f %9.1f %8.1f %8s %7s\n",
                  r["case"].get<std::string>().c_str(), r["dtype"].get<std::string>().c_str(),
                  r["median_ms"].get<double>(), r["ms_per_sequence"].get<double>(),
                  r["gflops"].get<double>(), r["gbps"].get<double>(),
                  pct(r["frac_roofline"]).c_str(), pct(r["frac_sgemm"]).c_str());
    for (auto& d : res["sparse_vs_dense"])
      std::printf("sparse extend %s: %.2fx (selected fraction %.3f x dense extend time)\n",
                  d["dtype"].get<std::string>().c_str(),
                  d["sparse_over_fraction_x_dense"].get<double>(),
                  d["selected_fraction"].get<double>());
  });
}
