// `attnrt run`: one forward pass of attention over every layer of a model.
//
// Random activations from a fixed seed (--seed, default 42). All K/V (and index-K) cache pages
// are filled with random values once on the host, then copied to the device; each step the
// layout grows from the PageAllocator (prefill of --prompt-len tokens, then --decode-steps single
// tokens). Per step, one plan per op is made and reused by every layer. Dense layers run
// dense_*; sparse layers run sparse_index_extend (top-k blocks) then sparse_attend_extend on that
// top-k in prefill, and one sparse_decode call (both in one) in decode.
// --check recomputes every layer with the reference backend on host copies and compares.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "attnrt/errors.h"
#include "attnrt/kv_cache.h"
#include "attnrt/model.h"
#include "attnrt/runtime.h"
#include "backends/reference/reference_backend.h"
#include "core/validate.h"
#include "cli_common.h"

namespace attnrt_cli {
namespace {

using attnrt::DType;
using attnrt::Op;
using Clock = std::chrono::steady_clock;

struct RunOptions {
  // minimax-m3-tp4 (60 layers, prompt 2560) takes ~43 s on 2 cores with the cpu backend and
  // minutes under --check, so the default is the small preset; pass --model minimax-m3-tp4 for
  // the real shapes.
  std::string model = "tiny";
  int batch = 1;
  int prompt_len = 0;  // 0: (topk + 4) * block_size for sparse models (sparsity is real), else 512
  int decode_steps = 4;
  int page_size = 0;  // 0: Runtime::preferred_page_size, or 128 for sparse models
  std::string dtype = "bf16";
  std::string device = "cpu";
  uint64_t seed = 42;
  int layers = 0;  // 0: all
  bool check = false;
  int check_rows = 0;  // 0: every query row; else the last N query tokens of each request
  bool json = false;
};

// A host array plus its device copy (the same memory when the device is the host).
struct Buf {
  std::vector<unsigned char> host;
  attnrt::DeviceBuffer dev;
  DType dtype = DType::f32;
};

Buf make_buf(attnrt::Runtime& rt, attnrt::Device d, DType t, int64_t n) {
  Buf b;
  b.dtype = t;
  b.host.assign(static_cast<size_t>(n) * attnrt::dtype_size(t), 0);
  b.dev = rt.allocate(d, b.host.size());
  return b;
}

void fill(Buf& b, std::mt19937_64& g) {
  fill_normal(b.host.data(), b.dtype, static_cast<int64_t>(b.host.size() / attnrt::dtype_size(b.dtype)), g());
}

void upload(attnrt::Runtime& rt, Buf& b) { rt.copy_to_device(b.dev, b.host.data(), b.host.size()); }
void download(attnrt::Runtime& rt, Buf& b) { rt.copy_to_host(b.host.data(), b.dev, b.host.size()); }

attnrt::TensorView view(void* p, DType t, attnrt::Device d, std::initializer_list<int64_t> s) {
  return attnrt::TensorView::contiguous(p, t, d, s);
}

// The rows --check compares: the last `n` query tokens of each request (all when n is 0 or
// larger than q_len), as a layout with the same contexts and pages (so the reference sees every
// key) and, for each of its packed rows, the packed row of the full layout.
struct CheckedRows {
  attnrt::BatchLayout layout;
  std::vector<int64_t> rows;
};

CheckedRows checked_rows(const attnrt::BatchLayout& full, int n) {
  CheckedRows c{full, {}};
  for (int b = 0; b < full.num_requests(); ++b) {
    const int32_t keep = n > 0 ? std::min(n, full.q_len[b]) : full.q_len[b];
    c.layout.q_len[b] = keep;
    c.layout.q_indptr[b + 1] = c.layout.q_indptr[b] + keep;
    for (int64_t r = full.q_indptr[b + 1] - keep; r < full.q_indptr[b + 1]; ++r) c.rows.push_back(r);
  }
  return c;
}

// Copies the checked rows out of `src`, laid out [outer, full_rows, row_bytes], into
// [outer, rows.size(), row_bytes].
std::vector<unsigned char> gather_rows(const unsigned char* src, const CheckedRows& c,
                                       int64_t full_rows, size_t row_bytes, int outer = 1) {
  std::vector<unsigned char> dst(static_cast<size_t>(outer) * c.rows.size() * row_bytes);
  for (int o = 0; o < outer; ++o)
    for (size_t r = 0; r < c.rows.size(); ++r)
      std::memcpy(&dst[(o * c.rows.size() + r) * row_bytes],
                  src + (o * full_rows + c.rows[r]) * row_bytes, row_bytes);
  return dst;
}

struct OpStats {
  std::string backend;
  double seconds = 0;
  int64_t calls = 0;
  double max_abs_err = 0;       // attention: max |a-b| of out
  double topk_rows_differ = 0;  // indexer: the largest fraction of top-k rows differing as sets
  bool failed = false;
};

void run_resolved(const RunOptions& o, const attnrt::ModelConfig& m);

void run(const RunOptions& o) {
  if (o.batch < 1) throw attnrt::InvalidArgument("--batch: got " + std::to_string(o.batch) + ", expected >= 1");
  if (o.prompt_len < 0)
    throw attnrt::InvalidArgument("--prompt-len: got " + std::to_string(o.prompt_len) + ", expected >= 0");
  if (o.decode_steps < 0)
    throw attnrt::InvalidArgument("--decode-steps: got " + std::to_string(o.decode_steps) + ", expected >= 0");
  if (o.layers < 0) throw attnrt::InvalidArgument("--layers: got " + std::to_string(o.layers) + ", expected >= 0");
  if (o.check_rows < 0)
    throw attnrt::InvalidArgument("--check-rows: got " + std::to_string(o.check_rows) + ", expected >= 0");
  if (o.page_size < 0)
    throw attnrt::InvalidArgument("--page-size: got " + std::to_string(o.page_size) + ", expected >= 1");
  // Upper limits, so that token, page and row counts stay in 32-bit ints (kv_len, page ids and
  // the sizes computed below are int32): 16M tokens per request is beyond any model's context.
  constexpr int kMaxTokens = 1 << 24, kMaxPageSize = 1 << 16, kMaxBatch = 1 << 16;
  auto at_most = [](const char* option, int64_t v, int64_t limit, const char* what = "") {
    if (v > limit)
      throw attnrt::InvalidArgument(std::string(option) + ": got " + std::to_string(v) + what +
                                    ", expected <= " + std::to_string(limit));
  };
  at_most("--batch", o.batch, kMaxBatch);
  at_most("--prompt-len", o.prompt_len, kMaxTokens);
  at_most("--decode-steps", o.decode_steps, kMaxTokens);
  at_most("--page-size", o.page_size, kMaxPageSize);
  const attnrt::ModelConfig m = attnrt::resolve_model(o.model);
  RunOptions opt = o;
  if (opt.prompt_len == 0) {
    const int64_t dflt = m.use_sparse ? (int64_t{m.sparse.topk} + 4) * m.sparse.block_size : 512;
    at_most("--prompt-len", dflt, kMaxTokens, " by default ((the model's top-k + 4) x its block size)");
    opt.prompt_len = static_cast<int>(dflt);
  }
  const int64_t per_request = int64_t{opt.prompt_len} + opt.decode_steps;
  at_most("--prompt-len + --decode-steps", per_request, kMaxTokens, " tokens per request");
  at_most("--batch x (--prompt-len + --decode-steps)", o.batch * per_request,
          std::numeric_limits<int32_t>::max(), " tokens in the batch");
  return run_resolved(opt, m);
}

void run_resolved(const RunOptions& o, const attnrt::ModelConfig& m) {
  const DType dt = attnrt::parse_dtype(o.dtype, "--dtype");
  if (dt == DType::i32) throw attnrt::InvalidArgument("--dtype: got i32, expected f32, f16 or bf16");
  attnrt::Device dev = attnrt::Device::parse(o.device);
  const attnrt::Device requested = dev;
  std::string device_note;  // why the run is not on the requested device
  const attnrt::Device host = attnrt::Device::cpu();
  attnrt::Runtime rt;
  const std::vector<attnrt::Device> devices = rt.devices();
  if (std::find(devices.begin(), devices.end(), dev) == devices.end()) {
    // A requested accelerator that no backend can serve: run on the host, say so once, with
    // every plugin that did not load and why (or the devices there are, if all loaded).
    std::string why;
    for (const auto& r : rt.report().plugins)
      if (!r.loaded) why += (why.empty() ? "" : "; ") + r.name + ": " + r.reason;
    if (why.empty()) {
      why = "devices here:";
      for (const auto& d : devices) why += " " + d.str();
    }
    device_note = dev.str() + " is not available (" + why + "); running on cpu instead";
    std::fprintf(stderr, "attnrt: %s\n", device_note.c_str());
    dev = host;
  }

  const int L = o.layers > 0 ? std::min(o.layers, m.num_layers) : m.num_layers;
  int ps = o.page_size;
  if (ps == 0) ps = rt.preferred_page_size(dev);
  // Sparse layers: page = block is the fast path of every backend.
  if (ps <= 0 || (o.page_size == 0 && m.use_sparse)) ps = m.use_sparse ? m.sparse.block_size : 16;
  const int Hq = m.num_q_heads, Hkv = m.num_kv_heads, D = m.head_dim;
  const int Hidx = m.sparse.num_index_heads, Didx = m.sparse.index_dim, K = m.sparse.topk;
  const int total_len = o.prompt_len + o.decode_steps;
  const int pages_per_req = (total_len + ps - 1) / ps;
  const int num_pages = o.batch * pages_per_req;

  auto base = [&](Op op) { return model_problem(op, m, dev, dt, ps); };
  // The model's shapes, checked before gigabytes of caches are filled for them.
  for (Op op : {Op::dense_extend, Op::sparse_index_extend, Op::sparse_attend_extend}) {
    if (!m.use_sparse && !attnrt::is_dense(op)) continue;
    try {
      attnrt::validate_problem(base(op));
    } catch (const attnrt::InvalidArgument& e) {
      throw attnrt::InvalidArgument("model '" + o.model + "': " + e.what());
    }
  }

  std::mt19937_64 gen(o.seed);
  // Caches: one pool per layer, [pages, ps, heads, dim].
  std::vector<Buf> kc, vc, ikc;
  for (int l = 0; l < L; ++l) {
    kc.push_back(make_buf(rt, dev, dt, int64_t{num_pages} * ps * Hkv * D));
    vc.push_back(make_buf(rt, dev, dt, int64_t{num_pages} * ps * Hkv * D));
    fill(kc.back(), gen);
    fill(vc.back(), gen);
    upload(rt, kc.back());
    upload(rt, vc.back());
    if (m.layer_sparse[l]) {
      ikc.push_back(make_buf(rt, dev, dt, int64_t{num_pages} * ps * Didx));
      fill(ikc.back(), gen);
      upload(rt, ikc.back());
    } else {
      ikc.emplace_back();
    }
  }
  attnrt::PageAllocator alloc(num_pages, ps, o.seed);
  std::vector<int> reqs;
  for (int b = 0; b < o.batch; ++b) reqs.push_back(alloc.create());

  if (!o.json) {
    std::printf("model: %s\n", m.describe().c_str());
    std::printf("run: %d of %d layers (%d sparse), batch %d, prompt %d, decode %d, page %d, %s, %s, seed %llu\n",
                L, m.num_layers,
                static_cast<int>(std::count(m.layer_sparse.begin(), m.layer_sparse.begin() + L, true)),
                o.batch, o.prompt_len, o.decode_steps, ps, attnrt::dtype_name(dt), dev.str().c_str(),
                static_cast<unsigned long long>(o.seed));
  }

  std::map<std::string, OpStats> stats;
  double phase_s[2] = {0, 0};
  int64_t phase_tokens[2] = {0, 0};
  bool any_fail = false;
  auto last_progress = Clock::now();
  const double tol = dt == DType::f32 ? 1e-5 : 5e-3;

  // The previous decode step's plans, refreshed for each next step's lengths.
  std::map<Op, std::shared_ptr<const attnrt::Plan>> decode_plans;
  for (int step = 0; step <= o.decode_steps; ++step) {
    const bool prefill = step == 0;
    const int qn = prefill ? o.prompt_len : 1;
    for (int r : reqs) alloc.append(r, qn);
    const attnrt::BatchLayout layout = alloc.layout(reqs, std::vector<int32_t>(reqs.size(), qn));
    const int64_t T = layout.total_q();
    const CheckedRows chk = o.check ? checked_rows(layout, o.check_rows) : CheckedRows{};
    // The calls of one layer. A sparse layer runs the indexer, then sparse attention on its
    // selections: two calls in prefill, one sparse_decode call in decode.
    const std::vector<Op> dense_ops = {prefill ? Op::dense_extend : Op::dense_decode};
    const std::vector<Op> sparse_ops =
        prefill ? std::vector<Op>{Op::sparse_index_extend, Op::sparse_attend_extend}
                : std::vector<Op>{Op::sparse_decode};
    // Plans of this step, one per op for all its layers. Decode steps refresh the previous
    // step's plans for the new lengths (update_plan: same device addresses) instead of planning.
    std::map<Op, std::shared_ptr<const attnrt::Plan>> plans;
    if (!prefill)
      for (const auto& [op, plan] : decode_plans) plans[op] = rt.update(plan, layout);
    Buf q = make_buf(rt, dev, dt, T * Hq * D), out = make_buf(rt, dev, dt, T * Hq * D);
    Buf iq, tk;
    if (m.use_sparse) {
      iq = make_buf(rt, dev, dt, T * Hidx * Didx);
      tk = make_buf(rt, dev, DType::i32, int64_t{Hidx} * T * K);
    }
    for (int l = 0; l < L; ++l) {
      const bool sparse = m.layer_sparse[l];
      fill(q, gen);
      upload(rt, q);
      if (sparse) {
        fill(iq, gen);
        upload(rt, iq);
      }
      // The tensors `op` reads and writes, of this layer.
      auto tensors_of = [&](Op op) {
        attnrt::Tensors t;
        if (attnrt::reads_attention_inputs(op)) {
          t.q = view(q.dev.data(), dt, dev, {T, Hq, D});
          t.out = view(out.dev.data(), dt, dev, {T, Hq, D});
          t.k_cache = view(kc[l].dev.data(), dt, dev, {num_pages, ps, Hkv, D});
          t.v_cache = view(vc[l].dev.data(), dt, dev, {num_pages, ps, Hkv, D});
        }
        if (attnrt::reads_index_inputs(op)) {
          t.index_q = view(iq.dev.data(), dt, dev, {T, Hidx, Didx});
          t.index_k_cache = view(ikc[l].dev.data(), dt, dev, {num_pages, ps, 1, Didx});
        }
        if (!attnrt::is_dense(op)) t.topk = view(tk.dev.data(), DType::i32, dev, {Hidx, T, K});
        return t;
      };
      for (Op op : sparse ? sparse_ops : dense_ops) {
        std::shared_ptr<const attnrt::Plan>& plan = plans[op];
        if (!plan) plan = rt.plan(base(op), layout);
        auto t0 = Clock::now();
        rt.run(*plan, tensors_of(op));
        rt.synchronize(dev);
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        OpStats& st = stats[attnrt::op_name(op)];
        st.backend = plan->backend();
        st.seconds += s;
        st.calls += 1;
        phase_s[prefill ? 0 : 1] += s;
        if (!o.check) continue;
        // Reference on host copies of the same inputs, over the checked rows, one step at a time
        // (sparse_decode: its indexer, then its attention on the backend's own top-k).
        const int64_t TC = static_cast<int64_t>(chk.rows.size());
        const size_t es = attnrt::dtype_size(dt);
        if (!attnrt::is_dense(op)) download(rt, tk);
        if (attnrt::reads_index_inputs(op)) {
          attnrt::Problem hp = base(attnrt::index_step(op));
          hp.device = host;
          std::vector<int32_t> ref(static_cast<size_t>(Hidx) * TC * K, -7);
          std::vector<unsigned char> hq = gather_rows(iq.host.data(), chk, T, Hidx * Didx * es);
          std::vector<unsigned char> got_rows = gather_rows(tk.host.data(), chk, T, K * 4, Hidx);
          attnrt::Tensors h;
          h.index_q = view(hq.data(), dt, host, {TC, Hidx, Didx});
          h.index_k_cache = view(ikc[l].host.data(), dt, host, {num_pages, ps, 1, Didx});
          h.topk = view(ref.data(), DType::i32, host, {Hidx, TC, K});
          attnrt::reference_compute(hp, chk.layout, h);
          const int32_t* got = reinterpret_cast<const int32_t*>(got_rows.data());
          int64_t bad = 0;
          for (int64_t row = 0; row < int64_t{Hidx} * TC; ++row) {
            std::set<int32_t> a(got + row * K, got + row * K + K), b(&ref[row * K], &ref[row * K] + K);
            if (a != b) ++bad;
          }
          const double frac = static_cast<double>(bad) / (double(Hidx) * TC);
          st.topk_rows_differ = std::max(st.topk_rows_differ, frac);
          // Exact ties in low precision may swap a block; more than 1% of rows is a real bug.
          if (frac > (dt == DType::f32 ? 0.0 : 0.01)) st.failed = true;
        }
        if (attnrt::reads_attention_inputs(op)) {
          attnrt::Problem hp = base(attnrt::attention_step(op));
          hp.device = host;
          download(rt, out);
          const size_t row_bytes = static_cast<size_t>(Hq) * D * es;
          // The reference output stays f32 (not rounded to dt): the tolerance is against the
          // exact result, and two independently rounded 16-bit values can differ by one ulp,
          // which exceeds rtol 5e-3 just above a power of two.
          std::vector<float> ref(static_cast<size_t>(TC) * Hq * D);
          std::vector<unsigned char> hq = gather_rows(q.host.data(), chk, T, row_bytes);
          std::vector<unsigned char> got = gather_rows(out.host.data(), chk, T, row_bytes);
          std::vector<unsigned char> htk;
          attnrt::Tensors h;
          h.q = view(hq.data(), dt, host, {TC, Hq, D});
          h.out = view(ref.data(), DType::f32, host, {TC, Hq, D});
          h.k_cache = view(kc[l].host.data(), dt, host, {num_pages, ps, Hkv, D});
          h.v_cache = view(vc[l].host.data(), dt, host, {num_pages, ps, Hkv, D});
          if (attnrt::attends_selected_blocks(op)) {  // the backend's own top-k
            htk = gather_rows(tk.host.data(), chk, T, K * 4, Hidx);
            h.topk = view(htk.data(), DType::i32, host, {Hidx, TC, K});
          }
          attnrt::reference_compute(hp, chk.layout, h);
          const int64_t n = TC * Hq * D;
          double num = 0, den = 0, maxe = 0;
          bool bad = false;
          for (int64_t i = 0; i < n; ++i) {
            const double a = attnrt::load_as_f32(got.data(), dt, i);
            const double b = ref[i];
            const double e = std::fabs(a - b);
            if (!(e <= tol + tol * std::fabs(b))) bad = true;  // NaN counts as bad
            maxe = std::max(maxe, std::isnan(e) ? INFINITY : e);
            num += e * e;
            den += b * b;
          }
          if (dt == DType::f32) bad = !(std::sqrt(num / std::max(den, 1e-30)) <= tol);
          st.max_abs_err = std::max(st.max_abs_err, maxe);
          if (bad) st.failed = true;
        }
        any_fail = any_fail || st.failed;
      }
      if (std::chrono::duration<double>(Clock::now() - last_progress).count() >= 1.0) {
        std::fprintf(stderr, "attnrt run: %s, layer %d/%d\n",
                     prefill ? "prefill" : ("decode step " + std::to_string(step)).c_str(), l + 1, L);
        last_progress = Clock::now();
      }
    }
    if (!prefill) decode_plans = plans;
    phase_tokens[prefill ? 0 : 1] += T;
  }

  const attnrt::Report rep = rt.report();
  // One line per op that a loaded, higher-ranked backend (a fast path) could have served but
  // did not take, with its reason, and one per plugin switched off by ATTNRT_DISABLE. Backends
  // that never serve the op (reason "op not served...", plugin.h) stay quiet.
  for (const auto& r : rep.plugins)
    if (!r.loaded && r.reason.find("ATTNRT_DISABLE") != std::string::npos)
      std::fprintf(stderr, "attnrt: %s is off (%s)\n", r.name.c_str(), r.reason.c_str());
  for (const auto& e : rep.ops)
    for (const auto& sk : e.skipped)
      if (e.device == dev && !sk.available && sk.reason.rfind("not loaded", 0) != 0 &&
          sk.reason.rfind("op not served", 0) != 0)
        std::fprintf(stderr, "attnrt: %s on %s runs on %s: %s skipped (%s)\n",
                     attnrt::op_name(e.op), dev.str().c_str(), e.chosen.c_str(), sk.backend.c_str(),
                     sk.reason.c_str());
  // And one per op whose backend ran some of its runs a slower way than planned (still correct).
  int64_t degraded = 0;
  for (const auto& e : rep.ops) {
    if (e.device != dev || e.degraded_runs == 0) continue;
    if (e.degraded_runs > 0) {
      degraded += e.degraded_runs;
      std::fprintf(stderr, "attnrt: %s on %s: %s ran %lld slower: %s\n", attnrt::op_name(e.op),
                   dev.str().c_str(), e.chosen.c_str(), static_cast<long long>(e.degraded_runs),
                   e.degraded_note.c_str());
    } else {
      std::fprintf(stderr, "attnrt: %s on %s: %s degraded runs %s\n", attnrt::op_name(e.op),
                   dev.str().c_str(), e.chosen.c_str(), e.degraded_note.c_str());
    }
  }
  int64_t fallbacks = 0;
  for (const auto& e : rep.ops) fallbacks += e.fallbacks;
  if (o.json) {
    nlohmann::json j;
    j["model"] = m.name;
    j["layers"] = L;
    j["batch"] = o.batch;
    j["prompt_len"] = o.prompt_len;
    j["decode_steps"] = o.decode_steps;
    j["page_size"] = ps;
    j["dtype"] = attnrt::dtype_name(dt);
    j["device"] = dev.str();
    j["requested_device"] = requested.str();
    if (!device_note.empty()) j["device_note"] = device_note;
    j["seed"] = o.seed;
    for (const auto& [name, st] : stats) {
      j["ops"][name] = {{"backend", st.backend}, {"seconds", st.seconds}, {"calls", st.calls}};
      if (o.check) {
        // max_error: of out where the op writes it, else of the top-k rows.
        const Op op = attnrt::parse_op(name);
        j["ops"][name]["max_error"] =
            attnrt::reads_attention_inputs(op) ? st.max_abs_err : st.topk_rows_differ;
        if (attnrt::reads_index_inputs(op))
          j["ops"][name]["topk_rows_differ"] = st.topk_rows_differ;
        j["ops"][name]["ok"] = !st.failed;
      }
    }
    j["prefill"] = {{"seconds", phase_s[0]}, {"tokens", phase_tokens[0]},
                    {"tokens_per_s", phase_tokens[0] / std::max(phase_s[0], 1e-12)}};
    j["decode"] = {{"seconds", phase_s[1]}, {"tokens", phase_tokens[1]},
                   {"tokens_per_s", phase_tokens[1] / std::max(phase_s[1], 1e-12)}};
    j["fallbacks"] = fallbacks;
    j["degraded_runs"] = degraded;
    j["warnings"] = rep.warnings;
    if (o.check) {
      j["check_ok"] = !any_fail;
      j["check_rows"] = o.check_rows;  // 0: every query token
    }
    std::cout << j.dump(2) << "\n";
  } else {
    for (const auto& [name, st] : stats) {
      std::printf("  %-22s backend %-10s %6lld calls %10.3f ms", name.c_str(), st.backend.c_str(),
                  static_cast<long long>(st.calls), st.seconds * 1e3);
      if (o.check) {
        const Op op = attnrt::parse_op(name);
        std::printf("  max");
        if (attnrt::reads_index_inputs(op)) std::printf(" rows-differ %.3g", st.topk_rows_differ);
        if (attnrt::reads_index_inputs(op) && attnrt::reads_attention_inputs(op)) std::printf(",");
        if (attnrt::reads_attention_inputs(op)) std::printf(" abs err %.3g", st.max_abs_err);
        std::printf(" %s", st.failed ? "FAIL" : "ok");
      }
      std::printf("\n");
    }
    std::printf("prefill: %.3f ms, %lld tokens, %.1f tokens/s (attention only, %d layers)\n",
                phase_s[0] * 1e3, static_cast<long long>(phase_tokens[0]),
                phase_tokens[0] / std::max(phase_s[0], 1e-12), L);
    std::printf("decode:  %.3f ms, %lld tokens, %.1f tokens/s\n", phase_s[1] * 1e3,
                static_cast<long long>(phase_tokens[1]), phase_tokens[1] / std::max(phase_s[1], 1e-12));
    // The warnings themselves went to stderr as they happened (and are in --json).
    std::printf("fallbacks: %lld\n", static_cast<long long>(fallbacks));
    if (o.check && o.check_rows > 0)
      std::printf("check: %s (last %d query tokens of each request per layer)\n",
                  any_fail ? "FAILED" : "ok", o.check_rows);
    else if (o.check)
      std::printf("check: %s\n", any_fail ? "FAILED" : "ok");
  }
  if (any_fail) throw Failure("--check: results differ from the reference beyond tolerance");
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  auto* sub = app.add_subcommand("run", "Forward pass of attention over every layer of a model");
  sub->add_option("--model", o->model, "Preset (minimax-m3, minimax-m3-tp4, tiny) or a config.json path or its folder")->capture_default_str();
  sub->add_option("--batch", o->batch, "Requests in the batch")->capture_default_str();
  sub->add_option("--prompt-len", o->prompt_len, "Prompt tokens per request (0: (topk + 4) * block_size, 512 if dense)")->capture_default_str();
  sub->add_option("--decode-steps", o->decode_steps, "Decode steps after prefill")->capture_default_str();
  sub->add_option("--page-size", o->page_size,
                  "KV page size (0: backend's preferred, 128 for sparse models)")
      ->capture_default_str();
  sub->add_option("--dtype", o->dtype, "f32, f16 or bf16")->capture_default_str();
  sub->add_option("--device", o->device, "cpu or cuda:N; a device no backend serves falls back to cpu with one line saying why")->capture_default_str();
  sub->add_option("--seed", o->seed, "Random seed")->capture_default_str();
  sub->add_option("--layers", o->layers, "Run only the first N layers (0: all)")->capture_default_str();
  auto* check = sub->add_flag("--check", o->check, "Compare every layer with the reference backend");
  sub->add_option("--check-rows", o->check_rows,
                  "With --check: compare only the last N query tokens of each request per layer "
                  "(0: all). The reference then costs N x context per layer, which makes long "
                  "prompts checkable")
      ->capture_default_str()
      ->needs(check);
  sub->add_flag("--json", o->json, "Print JSON");
  read_integers_as_decimal(*sub);
  sub->callback([o] { run(*o); });
}

}  // namespace attnrt_cli
