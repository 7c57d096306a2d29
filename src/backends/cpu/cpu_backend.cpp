// The cpu backend: tiled online-softmax (flash) attention on host memory.
//
// Layout of the work. A work item is a block of query rows that share their keys: for dense
// extend, QT consecutive query tokens x all G query heads of one KV group (QT*G <= 64 rows);
// for sparse attend and decode, one token x G heads; for the indexer, QT tokens x the index
// heads (they all score the single shared index-key head). Each item holds its queries
// transposed, qT[d][m], and walks its keys in tiles of kKeyTile keys: the tile's K and V rows
// are converted to f32 once (page run by page run, no per-token gather in the inner loops),
// then
//   sT[n][m] = sum_d K[n][d] * qT[d][m]        (broadcast K, W-wide vectors over rows m)
//   online softmax per row, vectorised over m  (polynomial exp2, no horizontal reductions)
//   oT[d][m] += sum_n V[n][d] * pT[n][m]        (broadcast V, vectors over m)
// so both products are register-blocked GEMM-like loops and every K/V row is read once per item.
// Scores are kept in log2 units (q pre-scaled by sm_scale*log2(e)).
//
// Decode with few requests and long contexts is split over the keys (split-KV): the split is
// chosen in plan and reused by every run of the plan; each split writes (max, sum, unnormalised
// o) to the workspace and a merge pass combines them in a fixed order. An empty split has
// max = -inf, sum = 0, o = 0 and contributes nothing (never NaN).
//
// Vector code: GCC vector extensions of W floats, in four kernel sets: AVX-512 (W = 16, 32 zmm),
// AVX2 + FMA (W = 8, 16 ymm) and the SSE2 baseline (W = 4, 16 xmm), each with the register
// blocking of its register file, and AVX-512 with BF16, whose attention on bf16 q and K/V
// multiplies bf16 pairs (vdpbf16ps, Bf16Dot below) straight from the cache instead of widening
// the tiles to f32. The backend takes the best set the CPU has when it is created (or the one
// ATTNRT_CPU_ISA names), so the binary is not tied to the build machine's instruction set and no
// call re-decides. Results of different sets may differ in the last bits (different summation
// trees); each set is deterministic.
//
// Threads: a small std::thread pool owned by the backend; scratch is per worker, taken from the
// Runtime's workspace for the call. Determinism: every output element is computed by exactly one
// work item (or one merge) in a fixed order, so results do not depend on scheduling.
//
// Limits (reported by probe): host device only; head_dim and index_dim <= 256; G <= 64.
#include "backends/cpu/cpu_backend.h"
#include "core/cpu_dispatch.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <immintrin.h>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace attnrt {
namespace {

constexpr int kMaxDim = 256;
constexpr int kKeyTile = 64;  // keys per tile (a multiple of 16)
constexpr int kMaxRows = 64;  // query rows per work item (4 vectors of 16, 8 of 8, 16 of 4)
constexpr int kMaxG = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int32_t kMaskedPos = std::numeric_limits<int32_t>::max();  // padded key: never visible
// Below this many keys per split, split-KV costs more in merging than it gains.
constexpr int64_t kMinSplitKeys = 512;

#define ATTNRT_AI __attribute__((always_inline)) inline
#define ATTNRT_LAMBDA_AI __attribute__((always_inline))

// Vectors of W floats: W = 16 (zmm) for AVX-512, 8 (ymm) for AVX2, 4 (xmm) for the SSE2 baseline.
// Every kernel below is a template on W, always inlined into the entry points of one kernel set
// (the end of the kernel section), which carry that set's target.
template <int W>
struct Vec {
  typedef float f __attribute__((vector_size(4 * W)));
  typedef int32_t i __attribute__((vector_size(4 * W)));
};
template <int W>
using vf = typename Vec<W>::f;
template <int W>
using vi = typename Vec<W>::i;

template <int W>
ATTNRT_AI vf<W> loadv(const float* p) {
  vf<W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// W bf16 values as f32 (the 16 bits become the high half). With AVX2 / AVX-512, written lane by
// lane: GCC makes it one vpmovzxwd from memory and a shift, where __builtin_convertvector of a
// u16 vector gives two half-width conversions and an insert. SSE2 has no widening load, and the
// lane form goes through the stack there: the halves are interleaved with zeros (one punpcklwd).
template <int W>
ATTNRT_AI vf<W> load_bf16(const uint16_t* p) {
  vf<W> f;
  if constexpr (W == 4) {
    typedef uint16_t u16x4 __attribute__((vector_size(8)));
    u16x4 h;
    std::memcpy(&h, p, sizeof h);
    const auto w = __builtin_shufflevector(u16x4{}, h, 0, 4, 1, 5, 2, 6, 3, 7);
    std::memcpy(&f, &w, sizeof f);
  } else {
    vi<W> w;
    for (int i = 0; i < W; ++i) w[i] = static_cast<int32_t>(p[i]) << 16;
    std::memcpy(&f, &w, sizeof f);
  }
  return f;
}
template <class V>
ATTNRT_AI void storev(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
template <int W>
ATTNRT_AI vf<W> bcast(float x) {
  return vf<W>{} + x;
}
template <int W>
ATTNRT_AI vi<W> bcasti(int32_t x) {
  return vi<W>{} + x;
}
template <class V>
ATTNRT_AI V vmax(V a, V b) {
  return a > b ? a : b;
}

// 2^x for x <= 126, elementwise; exactly 0 for x < -126 (and for -inf). Round-to-nearest split
// x = n + f, |f| <= 1/2, degree-6 Taylor polynomial of 2^f (error ~1 ulp), exponent by integer
// add. A fixed sequence of operations: deterministic.
template <class V>
ATTNRT_AI V exp2v(V x) {
  using VI = decltype(x < x);  // the int32 vector of the same width
  const VI tiny = x < -126.0f;
  x = tiny ? V{} - 126.0f : x;
  x = x > 126.0f ? V{} + 126.0f : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V t = x + magic;
  const V n = t - magic;
  const V f = x - n;
  V p = V{} + 1.540353039338e-4f;
  p = p * f + 1.333355814643e-3f;
  p = p * f + 9.618129107629e-3f;
  p = p * f + 5.550410866482e-2f;
  p = p * f + 2.402265069591e-1f;
  p = p * f + 6.931471805599e-1f;
  p = p * f + 1.0f;
  VI ti;
  std::memcpy(&ti, &t, sizeof ti);
  const VI e = (ti - 0x4B400000 + 127) << 23;
  V scale;
  std::memcpy(&scale, &e, sizeof scale);
  const V r = p * scale;
  return tiny ? V{} : r;
}

// Sum of the W lanes, as a fixed tree (deterministic): halves added until 4 lanes are left.
template <int W>
ATTNRT_AI float hsum(vf<W> v) {
  if constexpr (W == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    vf<W / 2> lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    return hsum<W / 2>(lo + hi);
  }
}

class ThreadPool {
 public:
  explicit ThreadPool(int n) {
    if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
    size_ = n;
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return size_; }
  // Runs fn(i, worker) for i in [0, n) on the pool; worker in [0, size()) identifies the thread
  // (for per-worker scratch). The caller participates as worker 0. Serialised across callers.
  void parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn) {
    if (n <= 0) return;
    std::lock_guard<std::mutex> call_lock(call_mu_);
    if (workers_.empty() || n == 1) {
      for (int64_t i = 0; i < n; ++i) fn(i, 0);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      ++gen_;
    }
    cv_.notify_all();
    work(0);
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return active_ == 0; });
    fn_ = nullptr;
  }

 private:
  void work(int worker) {
    for (;;) {
      int64_t i = next_.fetch_add(1);
      if (i >= n_) break;
      (*fn_)(i, worker);
    }
  }
  void loop(int worker) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || gen_ != seen; });
        if (stop_) return;
        seen = gen_;
      }
      work(worker);
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (--active_ == 0) done_cv_.notify_all();
      }
    }
  }
  std::vector<std::thread> workers_;
  int size_ = 1;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int active_ = 0;
  uint64_t gen_ = 0;
  bool stop_ = false;
};

// ---- conversion of cache rows to f32 -------------------------------------------------------

__attribute__((target("avx,f16c"))) void f16_rows_f16c(const uint16_t* src, int64_t stride,
                                                      int rows, int D, float* dst,
                                                      int dst_stride) {
  for (int r = 0; r < rows; ++r) {
    const uint16_t* s = src + r * stride;
    float* o = dst + static_cast<int64_t>(r) * dst_stride;
    int x = 0;
    for (; x + 8 <= D; x += 8)
      _mm256_storeu_ps(o + x, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + x))));
    for (; x < D; ++x) o[x] = f16_to_f32(s[x]);
  }
}

bool has_f16c() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("f16c") != 0;
  }();
  return yes;
}

// rows consecutive cache rows (element stride `stride` between rows) -> dst rows of dst_stride.
template <int W>
ATTNRT_AI void convert_rows_impl(const void* src, DType t, int64_t stride, int rows, int D,
                                 float* dst, int dst_stride) {
  if (t == DType::f32) {
    const float* s = static_cast<const float*>(src);
    for (int r = 0; r < rows; ++r)
      std::memcpy(dst + static_cast<int64_t>(r) * dst_stride, s + r * stride, sizeof(float) * D);
  } else if (t == DType::bf16) {
    const uint16_t* s0 = static_cast<const uint16_t*>(src);
    for (int r = 0; r < rows; ++r) {
      const uint16_t* s = s0 + r * stride;
      float* o = dst + static_cast<int64_t>(r) * dst_stride;
      int x = 0;
      for (; x + W <= D; x += W) {
        storev(o + x, load_bf16<W>(s + x));
      }
      for (; x < D; ++x) {
        const uint32_t u = static_cast<uint32_t>(s[x]) << 16;
        std::memcpy(o + x, &u, 4);
      }
    }
  } else if (has_f16c()) {
    f16_rows_f16c(static_cast<const uint16_t*>(src), stride, rows, D, dst, dst_stride);
  } else {
    const uint16_t* s0 = static_cast<const uint16_t*>(src);
    for (int r = 0; r < rows; ++r)
      for (int x = 0; x < D; ++x)
        dst[static_cast<int64_t>(r) * dst_stride + x] = f16_to_f32(s0[r * stride + x]);
  }
}

// ---- the tile kernels ------------------------------------------------------------------------

// How the two products read their operands and multiply-add, by the element type of the tiles.
// A step of the reduction covers kPair elements of the broadcast operand (K or V) and kRow
// elements per row of the row operand (q or P). fma_at(acc, row, b) multiply-adds the operand at
// b broadcast; bcast(b) then fma(acc, row, B) do the same with the broadcast loaded once for
// several row vectors: a broadcast load per multiply-add would bound the loops by the load
// ports (about 1.3 broadcasts per cycle on Zen 5, against 2 multiply-adds).
//  F32Dot: f32 tiles; a step is one element (vector x broadcast scalar, FMA).
//  Bf16Dot: bf16 tiles; a step is two adjacent elements, multiplied and both products added
//   into an f32 lane by one vdpbf16ps (AVX512-BF16; 2x the f32 FMA rate on Zen 5). The reduced
//   dimension is stored in pairs: q as [D/2][rows][2], K as [keys][D] (D even), V as
//   [keys/2][D][2].
//   Products of bf16 values are exact in f32: the scores are those of F32Dot up to the
//   summation order.
//  Bf16SplitDot: P for Bf16Dot's V, as P = hi + lo with hi = bf16(P), lo = bf16(P - hi)
//   ([keys/2][row vector][hi, lo][W][2]), two vdpbf16ps per step. P rounded to bf16 alone
//   (GPU flash kernels do that) is off by up to 2^-9 relative, which moves a bf16 output across
//   a rounding boundary often enough to show; hi + lo is within 2^-17.
// The bf16 instructions are written as inline assembly: these templates carry no target
// attribute (the entry points of a kernel set do), and GCC refuses to inline a target intrinsic
// into a function without that target.
struct F32Dot {
  using T = float;
  static constexpr int kPair = 1, kRow = 1;
  template <int W>
  static ATTNRT_AI vf<W> row(const float* p) {
    return loadv<W>(p);
  }
  // vector * scalar, not ::bcast(): GCC then folds the broadcast into the FMA's memory operand
  // (vfmadd231ps m32{1to16} on AVX-512), where ::bcast() costs an add and a shuffle per FMA.
  template <int W>
  static ATTNRT_AI vf<W> fma_at(vf<W> acc, vf<W> a, const float* b) {
    return acc + a * *b;
  }
  template <int W>
  static ATTNRT_AI float bcast(const float* b) {
    return *b;
  }
  template <int W>
  static ATTNRT_AI vf<W> fma(vf<W> acc, vf<W> a, float b) {
    return acc + a * b;
  }
};

struct Bf16Dot {
  using T = uint16_t;
  static constexpr int kPair = 2, kRow = 2;
  typedef uint32_t u32_alias __attribute__((may_alias));
  typedef uint16_t u16x32 __attribute__((vector_size(64)));
  template <int W>
  static ATTNRT_AI vf<W> row(const uint16_t* p) {
    vf<W> v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  // acc[m] += a[2m] * b[0] + a[2m+1] * b[1], the bf16 pair at b broadcast from memory.
  template <int W>
  static ATTNRT_AI vf<W> fma_at(vf<W> acc, vf<W> a, const uint16_t* b) {
    static_assert(W == 16, "vdpbf16ps on zmm only");
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0"
            : "+v"(acc)
            : "v"(a), "m"(*reinterpret_cast<const u32_alias*>(b)));
    return acc;
  }
  // The bf16 pair at b in every 32-bit lane.
  template <int W>
  static ATTNRT_AI vf<W> bcast(const uint16_t* b) {
    static_assert(W == 16, "vpbroadcastd to zmm only");
    vf<W> r;
    __asm__("vpbroadcastd %1, %0" : "=v"(r) : "m"(*reinterpret_cast<const u32_alias*>(b)));
    return r;
  }
  // acc[m] += a[2m] * b[2m] + a[2m+1] * b[2m+1].
  template <int W>
  static ATTNRT_AI vf<W> fma(vf<W> acc, vf<W> a, vf<W> b) {
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
  }
  // bf16(a) in the low 16 u16 lanes, bf16(b) in the high 16, rounded to nearest even.
  static ATTNRT_AI u16x32 to_bf16(vf<16> a, vf<16> b) {
    vf<16> r;
    __asm__("vcvtne2ps2bf16 %2, %1, %0" : "=v"(r) : "v"(b), "v"(a));
    u16x32 h;
    std::memcpy(&h, &r, sizeof h);
    return h;
  }
  // dst[2m] = h[m], dst[2m+1] = h[16 + m].
  static ATTNRT_AI void store_interleaved(u16x32 h, uint16_t* dst) {
    const u16x32 o =
        __builtin_shufflevector(h, h, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24,
                                9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    std::memcpy(dst, &o, sizeof o);
  }
  // v2[n/2][d][2] = (v[n][d], v[n+1][d]) for the npad (even) rows v[n] of D elements.
  static ATTNRT_AI void pair_rows(const uint16_t* const* v, int npad, int D, uint16_t* v2) {
    for (int n = 0; n < npad; n += 2) {
      const uint16_t* a = v[n];
      const uint16_t* b = v[n + 1];
      uint16_t* o = v2 + static_cast<int64_t>(n) * D;
      int x = 0;
      for (; x + 32 <= D; x += 32) {
        u16x32 va, vb;
        std::memcpy(&va, a + x, sizeof va);
        std::memcpy(&vb, b + x, sizeof vb);
        const u16x32 lo =
            __builtin_shufflevector(va, vb, 0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47);
        const u16x32 hi = __builtin_shufflevector(va, vb, 16, 48, 17, 49, 18, 50, 19, 51, 20, 52,
                                                  21, 53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                  27, 59, 28, 60, 29, 61, 30, 62, 31, 63);
        std::memcpy(o + 2 * x, &lo, sizeof lo);
        std::memcpy(o + 2 * x + 32, &hi, sizeof hi);
      }
      for (; x < D; ++x) {
        o[2 * x] = a[x];
        o[2 * x + 1] = b[x];
      }
    }
  }
};

struct Bf16SplitDot : Bf16Dot {
  static constexpr int kRow = 4;
  struct Row {
    vf<16> hi, lo;
  };
  template <int W>
  static ATTNRT_AI Row row(const uint16_t* p) {
    return {Bf16Dot::row<W>(p), Bf16Dot::row<W>(p + 2 * W)};
  }
  template <int W>
  static ATTNRT_AI vf<W> fma(vf<W> acc, const Row& a, vf<W> b) {
    return Bf16Dot::fma<W>(Bf16Dot::fma<W>(acc, a.hi, b), a.lo, b);
  }
  template <int W>
  static ATTNRT_AI vf<W> fma_at(vf<W> acc, const Row& a, const uint16_t* b) {
    return fma<W>(acc, a, bcast<W>(b));
  }
  // The row operand of a step from the probabilities of its two keys: hi pairs at dst, lo pairs
  // at dst + 32.
  static ATTNRT_AI void pack_pair(vf<16> a, vf<16> b, uint16_t* dst) {
    typedef uint16_t u16x16 __attribute__((vector_size(32)));
    typedef uint32_t u32x16 __attribute__((vector_size(64)));
    const u16x32 hi = to_bf16(a, b);
    // hi widened back to f32: the 16 bits of a bf16 are the high half of its f32.
    auto widen = [](u16x16 h) {
      const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
      vf<16> f;
      std::memcpy(&f, &w, sizeof f);
      return f;
    };
    const vf<16> ha = widen(
        __builtin_shufflevector(hi, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const vf<16> hb = widen(__builtin_shufflevector(hi, hi, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,
                                                    26, 27, 28, 29, 30, 31));
    store_interleaved(hi, dst);
    store_interleaved(to_bf16(a - ha, b - hb), dst + 32);
  }
};

// Register blocking of the two products. A pass over the keys (or dims) holds MR row vectors x
// KB keys (or dims) of accumulators, the MR row operands and a broadcast:
//  W = 16, 32 zmm: one pass over all MV <= 4 row vectors, KB = 16, 8, 4, 4 (12-16 accumulators);
//  W = 8 and 4, 16 registers: passes of at most 2 row vectors, 12 accumulators (two rows x six
//  keys, or one row x 12): 15 registers, where the 16-wide blocking would need 20-64 and spill.
template <int W>
constexpr int kPassRows = W == 16 ? 4 : 2;
constexpr int pass_keys(int W, int MR) {
  if (W != 16) return 12 / MR;
  return MR == 1 ? 16 : (MR == 2 ? 8 : 4);
}
template <int W, int MR>
constexpr int kPassKeys = pass_keys(W, MR);

// acc[v] += Dot(rows[v], the operand at b broadcast) for MR row vectors: one row vector takes the
// broadcast from memory inside the multiply-add, several share one broadcast load.
template <int W, class Dot, int MR, class Row>
ATTNRT_AI void fma_rows(vf<W>* acc, const Row* rows, const typename Dot::T* b) {
  if constexpr (MR == 1) {
    acc[0] = Dot::template fma_at<W>(acc[0], rows[0], b);
  } else {
    const auto bb = Dot::template bcast<W>(b);
#pragma GCC unroll 4
    for (int v = 0; v < MR; ++v) acc[v] = Dot::template fma<W>(acc[v], rows[v], bb);
  }
}

// sT[n][m] = sum_s Dot(k[n][s], qT[s][m]) for KB keys at k (row stride Dk elements) and MR row
// vectors at qT (row stride Mp rows), over `steps` steps of the reduction.
template <int W, class Dot, int MR, int KB>
ATTNRT_AI void qk_block(const typename Dot::T* qT, int Mp, const typename Dot::T* k, int Dk,
                        int steps, float* sT) {
  constexpr int P = Dot::kPair;
  vf<W> acc[KB][MR];
  for (int i = 0; i < KB; ++i)
    for (int v = 0; v < MR; ++v) acc[i][v] = vf<W>{};
  for (int d = 0; d < steps; ++d) {
    vf<W> q[MR];
    for (int v = 0; v < MR; ++v) q[v] = Dot::template row<W>(qT + (d * Mp + v * W) * Dot::kRow);
#pragma GCC unroll 16
    for (int i = 0; i < KB; ++i) fma_rows<W, Dot, MR>(acc[i], q, k + i * Dk + d * P);
  }
  for (int i = 0; i < KB; ++i)
    for (int v = 0; v < MR; ++v) storev(sT + i * Mp + v * W, acc[i][v]);
}

// Keys n0, n0 + KB, ... while a whole block fits before npad; returns where it stopped.
template <int W, class Dot, int MR, int KB>
ATTNRT_AI int qk_blocks(const typename Dot::T* qT, int Mp, const typename Dot::T* k, int Dk,
                        int steps, int n0, int npad, float* sT) {
  for (; n0 + KB <= npad; n0 += KB)
    qk_block<W, Dot, MR, KB>(qT, Mp, k + static_cast<int64_t>(n0) * Dk, Dk, steps, sT + n0 * Mp);
  return n0;
}

// One pass of MR row vectors over the npad keys (a multiple of 16); a remainder KB does not
// divide goes in blocks of 4, 2 and 1.
template <int W, class Dot, int MR>
ATTNRT_AI void qk_pass(const typename Dot::T* qT, int Mp, const typename Dot::T* k, int Dk,
                       int steps, int npad, float* sT) {
  constexpr int KB = kPassKeys<W, MR>;
  int n0 = qk_blocks<W, Dot, MR, KB>(qT, Mp, k, Dk, steps, 0, npad, sT);
  if constexpr (KB > 4) n0 = qk_blocks<W, Dot, MR, 4>(qT, Mp, k, Dk, steps, n0, npad, sT);
  if constexpr (KB > 2) n0 = qk_blocks<W, Dot, MR, 2>(qT, Mp, k, Dk, steps, n0, npad, sT);
  if constexpr (KB > 1) qk_blocks<W, Dot, MR, 1>(qT, Mp, k, Dk, steps, n0, npad, sT);
}

// Whether one pass holds every row vector an item can have (AVX-512: 4 x 16 = kMaxRows). Then the
// products run one pass with the row stride a constant (W * MV): GCC keeps fewer integers live and
// does not park them in vector registers, which pushed row operands of the 16-accumulator loops
// to the stack.
template <int W>
constexpr bool kOnePass = W * kPassRows<W> >= kMaxRows;

// Runs pass.template operator()<MR>(u0, Mp) over an item's MV row vectors in passes of at most
// kPassRows<W>: u0 the pass's first row vector, Mp the row stride. When one pass holds them all
// (kOnePass), u0 = 0 and Mp = W * MV are constants of the instantiation.
template <int W, class Pass>
ATTNRT_AI void in_passes(int MV, Pass pass) {
  if constexpr (kOnePass<W>) {
    if (MV == 1) pass.template operator()<1>(0, W);
    if (MV == 2) pass.template operator()<2>(0, 2 * W);
    if (MV == 3) pass.template operator()<3>(0, 3 * W);
    if (MV == 4) pass.template operator()<4>(0, 4 * W);
    return;
  }
  const int Mp = W * MV;
  for (int u0 = 0; u0 < MV;) {
    const int mr = std::min(kPassRows<W>, MV - u0);
    if (mr == 1) pass.template operator()<1>(u0, Mp);
    if (mr == 2) pass.template operator()<2>(u0, Mp);
    if constexpr (kPassRows<W> >= 3)
      if (mr == 3) pass.template operator()<3>(u0, Mp);
    if constexpr (kPassRows<W> >= 4)
      if (mr == 4) pass.template operator()<4>(u0, Mp);
    u0 += mr;
  }
}

// sT[n][m] = sum_s Dot(k[n][s], qT[s][m]) for n < npad, the MV row vectors in passes.
template <int W, class Dot>
ATTNRT_AI void qk_tile(int MV, const typename Dot::T* qT, const typename Dot::T* k, int Dk,
                       int steps, int npad, float* sT) {
  in_passes<W>(MV, [&]<int MR>(int u0, int Mp) ATTNRT_LAMBDA_AI {
    qk_pass<W, Dot, MR>(qT + u0 * W * Dot::kRow, Mp, k, Dk, steps, npad, sT + u0 * W);
  });
}

// oT[d][m] = oT[d][m] * corr[m] + sum_s Dot(v[s][d], pT[s][m]) over `steps` steps of the keys, for
// DB dims at v and oT and MR row vectors at oT, pT and corr (row stride Mp). v: a step's row of
// D dims (of kPair elements each) every D * kPair elements.
template <int W, class Dot, int MR, int DB>
ATTNRT_AI void pv_block(float* oT, int Mp, const typename Dot::T* v, int D, int steps,
                        const typename Dot::T* pT, const float* corr) {
  constexpr int P = Dot::kPair;
  vf<W> acc[DB][MR];
  for (int i = 0; i < DB; ++i)
    for (int u = 0; u < MR; ++u) acc[i][u] = loadv<W>(oT + i * Mp + u * W) * loadv<W>(corr + u * W);
  for (int n = 0; n < steps; ++n) {
    decltype(Dot::template row<W>(pT)) p[MR];
    for (int u = 0; u < MR; ++u) p[u] = Dot::template row<W>(pT + (n * Mp + u * W) * Dot::kRow);
    const typename Dot::T* vr = v + static_cast<int64_t>(n) * D * P;
#pragma GCC unroll 16
    for (int i = 0; i < DB; ++i) fma_rows<W, Dot, MR>(acc[i], p, vr + i * P);
  }
  for (int i = 0; i < DB; ++i)
    for (int u = 0; u < MR; ++u) storev(oT + i * Mp + u * W, acc[i][u]);
}

template <int W, class Dot, int MR, int DB>
ATTNRT_AI int pv_blocks(float* oT, int Mp, const typename Dot::T* v, int D, int Dn, int d0,
                        int steps, const typename Dot::T* pT, const float* corr) {
  for (; d0 + DB <= Dn; d0 += DB)
    pv_block<W, Dot, MR, DB>(oT + d0 * Mp, Mp, v + d0 * Dot::kPair, D, steps, pT, corr);
  return d0;
}

// One pass of MR row vectors over the first Dn of the D dims of v's rows; a remainder DB does
// not divide goes in blocks of 4, 2 and 1.
template <int W, class Dot, int MR>
ATTNRT_AI void pv_pass(float* oT, int Mp, const typename Dot::T* v, int D, int Dn, int steps,
                       const typename Dot::T* pT, const float* corr) {
  constexpr int DB = kPassKeys<W, MR>;
  int d0 = pv_blocks<W, Dot, MR, DB>(oT, Mp, v, D, Dn, 0, steps, pT, corr);
  if constexpr (DB > 4) d0 = pv_blocks<W, Dot, MR, 4>(oT, Mp, v, D, Dn, d0, steps, pT, corr);
  if constexpr (DB > 2) d0 = pv_blocks<W, Dot, MR, 2>(oT, Mp, v, D, Dn, d0, steps, pT, corr);
  if constexpr (DB > 1) pv_blocks<W, Dot, MR, 1>(oT, Mp, v, D, Dn, d0, steps, pT, corr);
}

// oT = oT * corr + v^T pT over the MV row vectors, in passes, for the first Dn of the D dims.
template <int W, class Dot>
ATTNRT_AI void pv_tile(int MV, float* oT, const typename Dot::T* v, int D, int Dn, int steps,
                       const typename Dot::T* pT, const float* corr) {
  in_passes<W>(MV, [&]<int MR>(int u0, int Mp) ATTNRT_LAMBDA_AI {
    pv_pass<W, Dot, MR>(oT + u0 * W, Mp, v, D, Dn, steps, pT + u0 * W * Dot::kRow, corr + u0 * W);
  });
}

struct TileState {
  const void* qT;       // [D][Mp] f32, pre-scaled by sm_scale * log2(e); Bf16Dot: [D/2][Mp][2]
  float* oT;            // [D][Mp], unnormalised output
  float* m;             // [Mp] running max (log2 units)
  float* l;             // [Mp] running sum
  const int32_t* rowpos;  // [Mp] absolute position of each row (causal bound)
  int D;
  // Bf16Dot only: the factor that takes a score to log2 units (sm_scale * log2(e)), and scratch
  // for V in pairs ([kKeyTile][D] bf16) and P as Bf16SplitDot's hi, lo pairs ([kKeyTile][Mp][2]).
  float scale = 1.f;
  uint16_t* v2 = nullptr;
  uint16_t* p2 = nullptr;
};

// The cache lines of a tile, to be prefetched a share at a time between the parts of another
// tile's work: one burst of every line would stall the core while the line-fill buffers drain,
// so the DRAM reads would add to the compute instead of overlapping it.
struct TilePrefetch {
  std::array<const char*, 2 * kKeyTile> rows;
  int nrows = 0;
  int row_lines = 0;                                              // 64-byte lines per row
  int row = 0, line = 0;                                          // the next line to issue
  int lines() const { return (nrows - row) * row_lines - line; }  // still to issue
  ATTNRT_AI void issue(int n) {
    for (; n > 0 && row < nrows; --n) {
      __builtin_prefetch(rows[row] + line * 64);
      if (++line == row_lines) {
        line = 0;
        ++row;
      }
    }
  }
};

// A tile of a bf16 cache read where it lies (the Bf16Dot attend tile, head_dim even): K as page
// runs of consecutive rows (tile keys 0 .. n-1, in order), V row by row; padding keys point at a
// zero row.
struct CacheTile {
  struct Run {
    const uint16_t* k;  // first row
    int64_t stride;     // elements between rows
    int n0, len;        // tile keys n0 .. n0+len-1
  };
  std::array<Run, kKeyTile> runs;
  int nruns = 0;
  std::array<const uint16_t*, kKeyTile> v;
};

// The online-softmax step of a tile between the two products: masks sT (npad keys) by jpos,
// updates the running max and sum, writes corr[m] = exp2(m_old - m_new) and the probabilities,
// over sT (F32Dot) or in pairs to s.p2 (Bf16SplitDot, whose raw scores are scaled here: the max
// of the raw scores times the scale (> 0) is the max of the scaled ones).
template <int W, class Dot>
ATTNRT_AI void softmax_tile(int MV, const TileState& s, const int32_t* jpos, int npad, float* sT,
                            float* corr) {
  constexpr bool kPairs = Dot::kPair == 2;
  const int Mp = W * MV;
  const vf<W> ninf = bcast<W>(kNegInf);
  // Keys ascend in a tile and padding is last: no key is masked for any row when the last one
  // is visible to the first row (decode, every tile but a request's last).
  const bool masked = jpos[npad - 1] > s.rowpos[0];
  // Row vector by row vector: the running state of one vector stays in registers.
  for (int u = 0; u < MV; ++u) {
    float* su = sT + u * W;
    vi<W> rp;
    std::memcpy(&rp, s.rowpos + u * W, sizeof rp);
    vf<W> tmax = ninf;
    if (masked) {
      for (int n = 0; n < npad; ++n) {
        const vf<W> x = bcasti<W>(jpos[n]) > rp ? ninf : loadv<W>(su + n * Mp);
        storev(su + n * Mp, x);
        tmax = vmax(tmax, x);
      }
    } else {
      for (int n = 0; n < npad; ++n) tmax = vmax(tmax, loadv<W>(su + n * Mp));
    }
    if constexpr (kPairs) tmax *= s.scale;
    const vf<W> mold = loadv<W>(s.m + u * W);
    const vf<W> mnew = vmax(mold, tmax);
    const vf<W> shift = mnew == ninf ? vf<W>{} : mnew;
    const vf<W> c = exp2v(mold - shift);
    storev(s.m + u * W, mnew);
    vf<W> lsum{};
    if constexpr (kPairs) {
      for (int n = 0; n < npad; n += 2) {
        const vf<W> p0 = exp2v(loadv<W>(su + n * Mp) * s.scale - shift);
        const vf<W> p1 = exp2v(loadv<W>(su + (n + 1) * Mp) * s.scale - shift);
        Dot::pack_pair(p0, p1, s.p2 + (n / 2 * Mp + u * W) * Dot::kRow);
        lsum += p0;
        lsum += p1;
      }
    } else {
      for (int n = 0; n < npad; ++n) {
        const vf<W> p = exp2v(loadv<W>(su + n * Mp) - shift);
        storev(su + n * Mp, p);
        lsum += p;
      }
    }
    storev(s.l + u * W, loadv<W>(s.l + u * W) * c + lsum);
    storev(corr + u * W, c);
  }
}

// Items of one row vector (decode), whose tiles are short on compute for their bytes, run the
// products of a tile in slices of keys (QK) and dims (PV) of 16 (W = 16) or 24 (a multiple of
// every pass's block), and prefetch a share of the next tile's lines (pf) before each; larger
// items run them whole (slices would cut the passes' blocks) and prefetch the next tile first.
struct Slices {
  int keys, dims, share;
  Slices(int W, int MV, const TilePrefetch& pf, int npad, int D)
      : keys(MV == 1 ? (W == 16 ? 16 : 24) : npad),
        dims(MV == 1 ? keys : D),
        share(MV == 1 ? pf.lines() / ((npad + D) / keys + 1) + 1 : pf.lines()) {}
};

// One flash step of an attention item of MV row vectors over a tile of npad keys (k, v:
// [npad][D] f32; jpos[n]: absolute key position, kMaskedPos for padding).
template <int W>
ATTNRT_AI void attend_tile_impl(int MV, const TileState& s, const float* k, const float* v,
                                const int32_t* jpos, int npad, float* sT, TilePrefetch& pf) {
  const int D = s.D, Mp = W * MV;
  const Slices sl(W, MV, pf, npad, D);
  for (int n0 = 0; n0 < npad; n0 += sl.keys) {
    pf.issue(sl.share);
    qk_tile<W, F32Dot>(MV, static_cast<const float*>(s.qT), k + static_cast<int64_t>(n0) * D, D, D,
                       std::min(sl.keys, npad - n0), sT + n0 * Mp);
  }
  alignas(64) float corr[kMaxRows];
  softmax_tile<W, F32Dot>(MV, s, jpos, npad, sT, corr);
  for (int d0 = 0; d0 < D; d0 += sl.dims) {
    pf.issue(sl.share);
    pv_tile<W, F32Dot>(MV, s.oT + d0 * Mp, v + d0, D, std::min(sl.dims, D - d0), npad, sT, corr);
  }
  pf.issue(pf.lines());
}

// The same step with bf16 dot products, K and V read from the cache in place (t).
template <int W>
ATTNRT_AI void attend_tile_bf16_impl(int MV, const TileState& s, const CacheTile& t,
                                     const int32_t* jpos, int npad, float* sT, TilePrefetch& pf) {
  const int D = s.D, Mp = W * MV;
  const Slices sl(W, MV, pf, npad, D);
  const uint16_t* qT = static_cast<const uint16_t*>(s.qT);
  for (int r = 0; r < t.nruns; ++r) {
    const CacheTile::Run& run = t.runs[r];
    for (int o = 0; o < run.len; o += sl.keys) {
      pf.issue(sl.share);
      qk_tile<W, Bf16Dot>(MV, qT, run.k + o * run.stride, static_cast<int>(run.stride), D / 2,
                          std::min(sl.keys, run.len - o), sT + (run.n0 + o) * Mp);
    }
  }
  // Padding keys have no K row: zero scores (the mask discards them), not stale scratch.
  const int nvalid = t.nruns > 0 ? t.runs[t.nruns - 1].n0 + t.runs[t.nruns - 1].len : 0;
  std::fill(sT + nvalid * Mp, sT + npad * Mp, 0.f);
  alignas(64) float corr[kMaxRows];
  softmax_tile<W, Bf16SplitDot>(MV, s, jpos, npad, sT, corr);
  Bf16Dot::pair_rows(t.v.data(), npad, D, s.v2);
  for (int d0 = 0; d0 < D; d0 += sl.dims) {
    pf.issue(sl.share);
    pv_tile<W, Bf16SplitDot>(MV, s.oT + d0 * Mp, s.v2 + d0 * 2, D, std::min(sl.dims, D - d0),
                             npad / 2, s.p2, corr);
  }
  pf.issue(pf.lines());
}

// The single-row form of qk_tile (one query row: the decode indexer with one index head, where
// the row-vector form would waste W-1 of W lanes): sT[n][*] = dot(k[n], q), vectorised over d
// (D a multiple of W), the score broadcast over the row vector.
template <int W>
ATTNRT_AI void qk_row(const float* q, const float* k, int D, int npad, float* sT) {
  for (int n = 0; n < npad; n += 4) {
    vf<W> a[4] = {};
    const float* kr = k + static_cast<int64_t>(n) * D;
    for (int d = 0; d < D; d += W) {
      const vf<W> qv = loadv<W>(q + d);
      for (int i = 0; i < 4; ++i) a[i] += loadv<W>(kr + i * D + d) * qv;
    }
    for (int i = 0; i < 4; ++i) storev(sT + (n + i) * W, bcast<W>(hsum<W>(a[i])));
  }
}

// Indexer step over a tile: scores (natural-log units, q pre-scaled by index_scale) reduced
// into per-block statistics bm[c][m] (max) and, for lse, bsum[c][m] relative to bm. qrow: the
// single query row when there is one and D is a multiple of W (else nullptr).
template <int W>
ATTNRT_AI void index_tile_impl(int MV, const float* qT, const float* qrow, int D,
                               const int32_t* rowpos, const float* k, const int32_t* jpos, int npad,
                               int nvalid, float* sT, int B, bool lse, float* bm, float* bsum) {
  const int Mp = W * MV;
  if (MV == 1 && qrow != nullptr)
    qk_row<W>(qrow, k, D, npad, sT);
  else
    qk_tile<W, F32Dot>(MV, qT, k, D, D, npad, sT);
  const vf<W> ninf = bcast<W>(kNegInf);
  for (int u = 0; u < MV; ++u) {
    vi<W> rp;
    std::memcpy(&rp, rowpos + u * W, sizeof rp);
    for (int n = 0; n < nvalid; ++n) {
      const vf<W> x = loadv<W>(sT + n * Mp + u * W);
      storev(sT + n * Mp + u * W, bcasti<W>(jpos[n]) > rp ? ninf : x);
    }
  }
  // Keys of a tile are consecutive positions: walk block segments.
  for (int n0 = 0; n0 < nvalid;) {
    const int c = jpos[n0] / B;
    int n1 = n0 + 1;
    while (n1 < nvalid && jpos[n1] / B == c) ++n1;
    for (int u = 0; u < MV; ++u) {
      float* bmc = bm + static_cast<int64_t>(c) * Mp + u * W;
      vf<W> segmax = ninf;
      for (int n = n0; n < n1; ++n) segmax = vmax(segmax, loadv<W>(sT + n * Mp + u * W));
      const vf<W> mold = loadv<W>(bmc);
      const vf<W> mnew = vmax(mold, segmax);
      storev(bmc, mnew);
      if (lse) {
        float* bsc = bsum + static_cast<int64_t>(c) * Mp + u * W;
        const vf<W> shift = mnew == ninf ? vf<W>{} : mnew;
        vf<W> acc = loadv<W>(bsc) * exp2v((mold - shift) * kLog2e);
        for (int n = n0; n < n1; ++n)
          acc += exp2v((loadv<W>(sT + n * Mp + u * W) - shift) * kLog2e);
        storev(bsc, acc);
      }
    }
    n0 = n1;
  }
}

// ---- kernel sets -----------------------------------------------------------------------------

// The kernel templates of one vector width, inlined into entry points compiled for one target.
// Each set is complete; the backend picks one when it is created (core/cpu_dispatch.h).
struct KernelSet {
  CpuIsa isa;
  int W;  // floats per vector = query rows per row vector
  void (*convert_rows)(const void* src, DType t, int64_t stride, int rows, int D, float* dst,
                       int dst_stride);
  void (*attend_tile)(int MV, const TileState& s, const float* k, const float* v,
                      const int32_t* jpos, int npad, float* sT, TilePrefetch& pf);
  void (*index_tile)(int MV, const float* qT, const float* qrow, int D, const int32_t* rowpos,
                     const float* k, const int32_t* jpos, int npad, int nvalid, float* sT, int B,
                     bool lse, float* bm, float* bsum);
  void (*index_row_scores)(const float* q, int D, const TensorView& kc, const int32_t* pages,
                           int page_size, int64_t nkeys, int B, bool lse, float* bm, float* bsum,
                           int bstride);
  // attend_tile with bf16 dot products over a bf16 cache tile read in place (TileState's pair
  // fields set); nullptr in the sets without AVX512-BF16, which serve bf16 through f32 tiles.
  void (*attend_tile_bf16)(int MV, const TileState& s, const CacheTile& t, const int32_t* jpos,
                           int npad, float* sT, TilePrefetch& pf);
};

// ---- plan --------------------------------------------------------------------------------------

struct Item {
  int b = 0;        // request
  int g = 0;        // kv head (attend) or first index head (index)
  int nheads = 0;   // index heads in this item (index ops)
  int64_t row0 = 0;  // first packed query row
  int nrows = 0;     // query tokens
  int split = 0, nsplit = 1;
  int64_t partial = -1;  // partial-result slot (split decode), -1: writes the output directly
  int64_t cost = 0;      // estimated keys x rows, for ordering
};

struct Merge {
  int b, g;
  int64_t row, first;
  int n;
};

struct CpuPlan : BackendPlan {
  uint64_t fingerprint = 0;
  uint64_t problem_signature = 0;
  std::vector<Item> items;   // in processing order (most expensive first)
  std::vector<Merge> merges;
  int rows_per_item = 1;     // M = tokens x heads per item
  int W = 16;                // rows per row vector (the kernel set's vector width)
  int MV = 1;                // row vectors per item
  int max_blocks = 0;        // index: blocks of the longest request
  size_t scratch_floats = 0;  // per worker
  int64_t num_partials = 0;
  size_t partial_floats = 0;  // per partial slot
};

// sparse_decode: the plans of its two steps (index_step, attention_step), run in sequence.
struct SparseDecodePlan : BackendPlan {
  uint64_t problem_signature = 0;
  Problem index_problem, attention_problem;
  std::unique_ptr<BackendPlan> index, attention;
};

inline size_t round16(size_t n) { return (n + 15) / 16 * 16; }

inline const char* elem_ptr(const TensorView& t, int64_t elem_off) {
  return static_cast<const char*>(t.data) + elem_off * static_cast<int64_t>(dtype_size(t.dtype));
}

// Tile of keys from a list of [begin, end) position segments of one request, read page run by
// page run.
struct KeyCursor {
  const std::pair<int64_t, int64_t>* seg;
  int nseg;
  int si = 0;
  int64_t j = 0;
  KeyCursor(const std::pair<int64_t, int64_t>* s, int n) : seg(s), nseg(n) { skip_empty(); }
  bool done() const { return si >= nseg; }
  // Moves to the start of the first non-empty segment from si on.
  void skip_empty() {
    while (si < nseg && seg[si].first >= seg[si].second) ++si;
    if (si < nseg) j = seg[si].first;
  }
};

// Walks the page runs of the next tile (up to kKeyTile keys) from cur and advances it: calls
// run(n0, j, page, in_page, len) for tile keys n0 .. n0+len-1 at positions j .. j+len-1, rows
// in_page .. in_page+len-1 of physical page `page`. Returns the number of keys.
template <class Run>
int walk_tile(KeyCursor& cur, const BatchLayout& L, int b, Run run) {
  int n = 0;
  const int P = L.page_size;
  const int32_t* pages = L.page_ids.data() + L.page_indptr[b];
  while (n < kKeyTile && !cur.done()) {
    const int64_t end = cur.seg[cur.si].second;
    const int64_t in_page = cur.j % P;
    const int len = static_cast<int>(std::min<int64_t>({end - cur.j, kKeyTile - n, P - in_page}));
    run(n, cur.j, static_cast<int64_t>(pages[cur.j / P]), in_page, len);
    n += len;
    cur.j += len;
    if (cur.j >= end) {
      ++cur.si;
      cur.skip_empty();
    }
  }
  return n;
}

// Row `in_page` of page `page`, KV head g, of a cache view.
inline const char* cache_row(const TensorView& c, int64_t page, int64_t in_page, int g) {
  return elem_ptr(c, page * c.strides[0] + in_page * c.strides[1] + g * c.strides[2]);
}

// Fills up to kKeyTile keys: K (and V when vt) rows as f32, jpos; pads to a multiple of 16 with
// zero rows at kMaskedPos. Returns the number of valid keys; *npad gets the padded count.
int fill_tile(const KernelSet& ks, KeyCursor& cur, const TensorView& kc, const TensorView* vc,
              DType dt, const BatchLayout& L, int b, int g, int D, float* kt, float* vt,
              int32_t* jpos, int* npad) {
  const int n =
      walk_tile(cur, L, b, [&](int n0, int64_t j, int64_t page, int64_t in_page, int len) {
        const int64_t at = static_cast<int64_t>(n0) * D;
        ks.convert_rows(cache_row(kc, page, in_page, g), dt, kc.strides[1], len, D, kt + at, D);
        if (vt)
          ks.convert_rows(cache_row(*vc, page, in_page, g), dt, vc->strides[1], len, D, vt + at, D);
        for (int i = 0; i < len; ++i) jpos[n0 + i] = static_cast<int32_t>(j + i);
      });
  const int np = (n + 15) / 16 * 16;
  for (int i = n; i < np; ++i) {
    jpos[i] = kMaskedPos;
    std::memset(kt + static_cast<int64_t>(i) * D, 0, sizeof(float) * D);
    if (vt) std::memset(vt + static_cast<int64_t>(i) * D, 0, sizeof(float) * D);
  }
  *npad = np;
  return n;
}

// The next tile read in place from a bf16 cache (the Bf16Dot attend tile): K's page runs, V's
// rows, jpos; padded to a multiple of 16 keys with zero V rows at kMaskedPos (their K scores are
// not computed; the mask discards them). Returns the padded count.
int cache_tile(KeyCursor& cur, const TensorView& kc, const TensorView& vc, const BatchLayout& L,
               int b, int g, CacheTile& ct, int32_t* jpos) {
  static const uint16_t kZeroRow[kMaxDim] = {};
  ct.nruns = 0;
  const int n =
      walk_tile(cur, L, b, [&](int n0, int64_t j, int64_t page, int64_t in_page, int len) {
        ct.runs[ct.nruns++] = {reinterpret_cast<const uint16_t*>(cache_row(kc, page, in_page, g)),
                               kc.strides[1], n0, len};
        const auto* v0 = reinterpret_cast<const uint16_t*>(cache_row(vc, page, in_page, g));
        for (int i = 0; i < len; ++i) {
          ct.v[n0 + i] = v0 + i * vc.strides[1];
          jpos[n0 + i] = static_cast<int32_t>(j + i);
        }
      });
  const int np = (n + 15) / 16 * 16;
  for (int i = n; i < np; ++i) {
    jpos[i] = kMaskedPos;
    ct.v[i] = kZeroRow;
  }
  return np;
}

// The cache rows (K, and V when vc) of the next tile `cur` would produce (a copy of the cursor),
// for prefetching, so that DRAM reads overlap the current tile's compute; pages are scattered,
// so the hardware prefetcher restarts at every page.
TilePrefetch next_tile_rows(KeyCursor cur, const TensorView& kc, const TensorView* vc,
                            const BatchLayout& L, int b, int g, int D) {
  TilePrefetch pf;
  pf.row_lines = static_cast<int>((static_cast<int64_t>(D) * dtype_size(kc.dtype) + 63) / 64);
  walk_tile(cur, L, b, [&](int, int64_t, int64_t page, int64_t in_page, int len) {
    for (const TensorView* c : {&kc, vc}) {
      if (!c) continue;
      const char* base = cache_row(*c, page, in_page, g);
      const int64_t stride = c->strides[1] * static_cast<int64_t>(dtype_size(c->dtype));
      for (int i = 0; i < len; ++i) pf.rows[pf.nrows++] = base + i * stride;
    }
  });
  return pf;
}

// Keys the decode indexer prefetches ahead: 4-8 KB, about a DRAM latency at one thread's
// bandwidth.
constexpr int64_t kPrefetchKeys = 16;

// Block scores of ONE query row straight from the paged cache (the decode indexer with one index
// head): no f32 tile, no broadcast of each score over a row vector. Keys 0 .. nkeys-1 of the
// request, rows of bf16 or f32 converted in registers; q: [D] f32, pre-scaled, D a multiple of W.
// bm[c * bstride] = max over block c; with lse, bsum[c * bstride] = sum of exp(s - max).
// Four keys per step (independent accumulators); every dot product is reduced by the same
// fixed tree, so results do not depend on the page layout. One copy per dtype (BF16: bf16, else
// f32): with the dtype tested in the inner loop GCC neither unswitched nor unrolled it at W = 16.
template <int W, bool BF16>
ATTNRT_AI void index_row_scores_typed(const float* q, int D, const TensorView& kc,
                                      const int32_t* pages, int page_size, int64_t nkeys, int B,
                                      bool lse, float* bm, float* bsum, int bstride) {
  const int64_t es = BF16 ? 2 : 4;
  const char* base = static_cast<const char*>(kc.data);
  auto row = [&](int64_t j) {
    return base + (pages[j / page_size] * kc.strides[0] + (j % page_size) * kc.strides[1]) * es;
  };
  auto loadrow = [&](const char* r, int x) {
    if constexpr (BF16)
      return load_bf16<W>(reinterpret_cast<const uint16_t*>(r) + x);
    else
      return loadv<W>(reinterpret_cast<const float*>(r) + x);
  };
  float sc[4];
  for (int64_t c0 = 0; c0 < nkeys; c0 += B) {
    const int64_t c1 = std::min<int64_t>(c0 + B, nkeys);
    float mx = kNegInf, sum = 0.f;
    for (int64_t j = c0; j < c1; j += 4) {
      const int n = static_cast<int>(std::min<int64_t>(4, c1 - j));
      const char* r[4];
      for (int i = 0; i < 4; ++i) r[i] = row(j + std::min(i, n - 1));
      // The rows kPrefetchKeys ahead, every step: the hardware prefetcher alone restarts at
      // every page and leaves one thread latency-bound (~50% of the streaming bandwidth).
      for (int64_t jj = j + kPrefetchKeys; jj < std::min(j + kPrefetchKeys + 4, nkeys); ++jj)
        for (int64_t x = 0; x < D * es; x += 64) __builtin_prefetch(row(jj) + x);
      vf<W> a[4] = {};
      for (int x = 0; x < D; x += W) {
        const vf<W> qv = loadv<W>(q + x);
        // (Unrolled by hand: GCC's size estimate of the 16-lane bf16 widening kept this loop
        // rolled at W = 16, with the accumulators in memory.)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) a[i] += loadrow(r[i], x) * qv;
      }
      for (int i = 0; i < 4; ++i) sc[i] = hsum<W>(a[i]);
      float cm = kNegInf;
      for (int i = 0; i < n; ++i) cm = std::max(cm, sc[i]);
      if (lse) {
        const float mn = std::max(mx, cm);
        float add = 0.f;
        for (int i = 0; i < n; ++i) add += std::exp(sc[i] - mn);
        sum = (mx == kNegInf ? 0.f : sum * std::exp(mx - mn)) + add;
      }
      mx = std::max(mx, cm);
    }
    const int64_t c = c0 / B;
    bm[c * bstride] = mx;
    if (lse) bsum[c * bstride] = sum;
  }
}

// kc: bf16 or f32.
template <int W>
ATTNRT_AI void index_row_scores_impl(const float* q, int D, const TensorView& kc,
                                     const int32_t* pages, int page_size, int64_t nkeys, int B,
                                     bool lse, float* bm, float* bsum, int bstride) {
  if (kc.dtype == DType::bf16)
    index_row_scores_typed<W, true>(q, D, kc, pages, page_size, nkeys, B, lse, bm, bsum, bstride);
  else
    index_row_scores_typed<W, false>(q, D, kc, pages, page_size, nkeys, B, lse, bm, bsum, bstride);
}

// Defines the entry points of width W under TARGET and the set NAME that lists them.
#define ATTNRT_KERNEL_SET(NAME, ISA, W, TARGET)                                                  \
  TARGET void NAME##_convert_rows(const void* src, DType t, int64_t stride, int rows, int D,     \
                                  float* dst, int dst_stride) {                                  \
    convert_rows_impl<W>(src, t, stride, rows, D, dst, dst_stride);                              \
  }                                                                                              \
  TARGET void NAME##_attend_tile(int MV, const TileState& s, const float* k, const float* v,     \
                                 const int32_t* jpos, int npad, float* sT, TilePrefetch& pf) {   \
    attend_tile_impl<W>(MV, s, k, v, jpos, npad, sT, pf);                                        \
  }                                                                                              \
  TARGET void NAME##_index_tile(int MV, const float* qT, const float* qrow, int D,               \
                                const int32_t* rowpos, const float* k, const int32_t* jpos,      \
                                int npad, int nvalid, float* sT, int B, bool lse, float* bm,     \
                                float* bsum) {                                                   \
    index_tile_impl<W>(MV, qT, qrow, D, rowpos, k, jpos, npad, nvalid, sT, B, lse, bm, bsum);    \
  }                                                                                              \
  TARGET void NAME##_index_row_scores(const float* q, int D, const TensorView& kc,               \
                                      const int32_t* pages, int page_size, int64_t nkeys, int B, \
                                      bool lse, float* bm, float* bsum, int bstride) {           \
    index_row_scores_impl<W>(q, D, kc, pages, page_size, nkeys, B, lse, bm, bsum, bstride);      \
  }                                                                                              \
  constexpr KernelSet NAME = {ISA,                                                               \
                              W,                                                                 \
                              NAME##_convert_rows,                                               \
                              NAME##_attend_tile,                                                \
                              NAME##_index_tile,                                                 \
                              NAME##_index_row_scores,                                           \
                              nullptr};

ATTNRT_KERNEL_SET(kAvx512Kernels, CpuIsa::avx512, 16, ATTNRT_TARGET_AVX512)
ATTNRT_KERNEL_SET(kAvx2Kernels, CpuIsa::avx2, 8, ATTNRT_TARGET_AVX2)
ATTNRT_KERNEL_SET(kBaselineKernels, CpuIsa::baseline, 4, )
#undef ATTNRT_KERNEL_SET

// The AVX-512 set plus the bf16 dot-product tile for attention with bf16 q and K/V.
ATTNRT_TARGET_AVX512_BF16 void kAvx512Bf16_attend_tile_bf16(int MV, const TileState& s,
                                                            const CacheTile& t, const int32_t* jpos,
                                                            int npad, float* sT, TilePrefetch& pf) {
  attend_tile_bf16_impl<16>(MV, s, t, jpos, npad, sT, pf);
}
constexpr KernelSet kAvx512Bf16Kernels = {
    CpuIsa::avx512_bf16,         16,
    kAvx512Kernels.convert_rows, kAvx512Kernels.attend_tile,
    kAvx512Kernels.index_tile,   kAvx512Kernels.index_row_scores,
    kAvx512Bf16_attend_tile_bf16};

const KernelSet& kernels_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::avx512_bf16:
      return kAvx512Bf16Kernels;
    case CpuIsa::avx512:
      return kAvx512Kernels;
    case CpuIsa::avx2:
      return kAvx2Kernels;
    default:
      return kBaselineKernels;
  }
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, CpuIsa isa) : ks_(kernels_for(isa)), pool_(threads) {}
  const std::string& name() const override { return name_; }
  int priority() const override { return 100; }
  std::vector<Device> devices() const override { return {Device::cpu()}; }

  Availability probe(const Problem& p) const override {
    if (!p.device.is_host()) return Availability::no("cpu backend serves host memory only");
    auto fdt = [](DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; };
    if (!fdt(p.q_dtype) || !fdt(p.kv_dtype))
      return Availability::no("cpu backend supports f32/f16/bf16 q and kv only");
    if (reads_index_inputs(p.op) && p.index_dim > kMaxDim)
      return Availability::no("cpu backend: index_dim > 256");
    if (reads_attention_inputs(p.op)) {
      if (p.head_dim > kMaxDim) return Availability::no("cpu backend: head_dim > 256");
      if (p.num_kv_heads > 0 && p.num_q_heads / p.num_kv_heads > kMaxG)
        return Availability::no("cpu backend: more than 64 q heads per kv head");
    }
    return Availability::yes();
  }

  std::unique_ptr<BackendPlan> plan(const Problem& p, const BatchLayout& L,
                                    Workspace& ws) override {
    if (p.op == Op::sparse_decode) {
      // Composed of this backend's own two steps, so it equals their sequence bit for bit.
      auto sp = std::make_unique<SparseDecodePlan>();
      sp->problem_signature = p.signature();
      sp->index_problem = sp->attention_problem = p;
      sp->index_problem.op = index_step(p.op);
      sp->attention_problem.op = attention_step(p.op);
      sp->index = plan(sp->index_problem, L, ws);
      sp->attention = plan(sp->attention_problem, L, ws);
      return sp;
    }
    auto pl = std::make_unique<CpuPlan>();
    pl->fingerprint = L.fingerprint();
    pl->problem_signature = p.signature();
    if (reads_index_inputs(p.op))
      plan_index(p, L, *pl);
    else
      plan_attend(p, L, *pl);
    // Most expensive items first: better balance under dynamic scheduling.
    std::stable_sort(pl->items.begin(), pl->items.end(),
                     [](const Item& a, const Item& b) { return a.cost > b.cost; });
    return pl;
  }

  void run(const BackendPlan& plan, const Problem& p, const BatchLayout& L, const Tensors& t,
           Workspace& ws) override {
    if (p.op == Op::sparse_decode) {
      const auto* sp = dynamic_cast<const SparseDecodePlan*>(&plan);
      if (!sp || sp->problem_signature != p.signature())
        throw InvalidArgument("cpu backend: plan was built for a different problem");
      // The indexer writes t.topk; sparse attention then reads it. Each step checks its plan
      // against the layout.
      run(*sp->index, sp->index_problem, L, t, ws);
      run(*sp->attention, sp->attention_problem, L, t, ws);
      return;
    }
    const auto* cp = dynamic_cast<const CpuPlan*>(&plan);
    if (!cp || cp->fingerprint != L.fingerprint() || cp->problem_signature != p.signature())
      throw InvalidArgument("cpu backend: plan was built for a different problem or batch layout");
    const size_t per_worker = round16(cp->scratch_floats);
    const size_t total =
        per_worker * pool_.size() + round16(cp->partial_floats) * cp->num_partials;
    Workspace::Lease lease = ws.acquire(total * sizeof(float));
    float* scratch = lease.as<float>();
    float* partials = scratch + per_worker * pool_.size();
    if (reads_index_inputs(p.op)) {
      pool_.parallel_for(static_cast<int64_t>(cp->items.size()), [&](int64_t i, int w) {
        index_item(*cp, p, L, t, cp->items[i], scratch + per_worker * w);
      });
      return;
    }
    pool_.parallel_for(static_cast<int64_t>(cp->items.size()), [&](int64_t i, int w) {
      attend_item(*cp, p, L, t, cp->items[i], scratch + per_worker * w, partials);
    });
    if (!cp->merges.empty())
      pool_.parallel_for(static_cast<int64_t>(cp->merges.size()), [&](int64_t i, int) {
        merge_splits(*cp, p, t, cp->merges[i], partials);
      });
  }

 private:
  void plan_attend(const Problem& p, const BatchLayout& L, CpuPlan& pl) const {
    const int Hkv = p.num_kv_heads, G = p.num_q_heads / Hkv, D = p.head_dim;
    const bool sparse = attends_selected_blocks(p.op);
    // Extend: QT consecutive tokens per item (they share keys; sparse ones when their
    // selections agree). Decode: one token per request.
    const int QT = is_decode(p.op) ? 1 : std::max(1, kMaxRows / G);
    pl.rows_per_item = QT * G;
    pl.W = ks_.W;
    pl.MV = (pl.rows_per_item + pl.W - 1) / pl.W;
    const int Mp = pl.W * pl.MV;
    const int nreq = L.num_requests();
    const int64_t sparse_keys =
        sparse ? static_cast<int64_t>(p.num_index_heads / Hkv) * p.topk * p.block_size : 0;
    auto keys_of = [&](int b, int64_t pos) {
      const int64_t vis = std::min<int64_t>(pos + 1, L.kv_len[b]);
      return sparse ? std::min(vis, sparse_keys) : vis;
    };
    // Split-KV for decode: enough items for every thread (x4 for balance), >= kMinSplitKeys each.
    int want_splits = 1;
    if (is_decode(p.op)) {
      const int64_t base = static_cast<int64_t>(nreq) * Hkv;
      const int64_t target = 4 * static_cast<int64_t>(pool_.size());
      if (base < target) want_splits = static_cast<int>((target + base - 1) / base);
    }
    pl.partial_floats = 2 * static_cast<size_t>(Mp) + static_cast<size_t>(D) * Mp;
    for (int b = 0; b < nreq; ++b) {
      const int64_t r0 = L.q_indptr[b], r1 = L.q_indptr[b + 1];
      const int64_t first_pos = L.kv_len[b] - L.q_len[b];
      for (int g = 0; g < Hkv; ++g)
        for (int64_t r = r0; r < r1; r += QT) {
          const int nr = static_cast<int>(std::min<int64_t>(QT, r1 - r));
          const int64_t keys = keys_of(b, first_pos + (r - r0) + nr - 1);
          int ns = 1;
          if (want_splits > 1)
            ns = static_cast<int>(std::clamp<int64_t>(keys / kMinSplitKeys, 1, want_splits));
          const int64_t first = pl.num_partials;
          for (int s = 0; s < ns; ++s) {
            Item it;
            it.b = b;
            it.g = g;
            it.row0 = r;
            it.nrows = nr;
            it.split = s;
            it.nsplit = ns;
            it.cost = keys * nr / ns;
            if (ns > 1) it.partial = pl.num_partials++;
            pl.items.push_back(it);
          }
          if (ns > 1) pl.merges.push_back({b, g, r, first, ns});
        }
    }
    pl.scratch_floats = 2 * static_cast<size_t>(D) * Mp          // qT, oT
                        + 2 * static_cast<size_t>(kKeyTile) * D  // K, V tiles
                        + static_cast<size_t>(kKeyTile) * Mp     // sT
                        + 4 * static_cast<size_t>(Mp)            // m, l, rowpos, spare
                        + kKeyTile + 64                          // jpos
                        + static_cast<size_t>(kKeyTile) * Mp;    // P as bf16 hi, lo pairs
  }

  void plan_index(const Problem& p, const BatchLayout& L, CpuPlan& pl) const {
    const int H = p.num_index_heads, Di = p.index_dim, B = p.block_size;
    const int hc = std::min(H, kMaxRows);  // heads per item
    int max_blocks = 1;
    for (int b = 0; b < L.num_requests(); ++b)
      max_blocks = std::max<int>(max_blocks, static_cast<int>((L.kv_len[b] + B - 1) / B));
    pl.max_blocks = max_blocks;
    // Tokens per item: up to 64 rows, no more tokens than a request has (decode: one, so the
    // row vectors are not mostly padding), fewer when the per-block score buffer would be large.
    int max_q = 1;
    for (int b = 0; b < L.num_requests(); ++b) max_q = std::max(max_q, L.q_len[b]);
    int QT = std::min(max_q, std::max(1, kMaxRows / hc));
    const int lse = p.score_type == ScoreType::lse ? 2 : 1;
    while (QT > 1 && static_cast<size_t>(max_blocks) * round16(QT * hc) * lse > (size_t(1) << 20))
      QT /= 2;
    pl.rows_per_item = QT * hc;
    pl.W = ks_.W;
    pl.MV = (pl.rows_per_item + pl.W - 1) / pl.W;
    const int Mp = pl.W * pl.MV;
    for (int b = 0; b < L.num_requests(); ++b) {
      const int64_t r0 = L.q_indptr[b], r1 = L.q_indptr[b + 1];
      for (int h0 = 0; h0 < H; h0 += hc)
        for (int64_t r = r0; r < r1; r += QT) {
          Item it;
          it.b = b;
          it.g = h0;
          it.nheads = std::min(hc, H - h0);
          it.row0 = r;
          it.nrows = static_cast<int>(std::min<int64_t>(QT, r1 - r));
          it.cost = (L.kv_len[b] - L.q_len[b] + (r - r0) + it.nrows) * it.nrows;
          pl.items.push_back(it);
        }
    }
    pl.scratch_floats = static_cast<size_t>(Di) * Mp + static_cast<size_t>(kKeyTile) * Di +
                        static_cast<size_t>(kKeyTile) * Mp +
                        static_cast<size_t>(max_blocks) * Mp * lse  // block stats
                        + 2 * static_cast<size_t>(max_blocks)       // one row's scores and ids
                        + Mp + kKeyTile + 64;
  }

  // One attention work item. Sparse rows of the item are processed in runs of consecutive
  // tokens with the same selection (tokens of one block usually select the same blocks), so such
  // a run shares every K/V tile like dense extend does.
  void attend_item(const CpuPlan& cp, const Problem& p, const BatchLayout& L, const Tensors& t,
                   const Item& it, float* scratch, float* partials) const {
    if (!attends_selected_blocks(p.op)) {
      attend_rows(cp, p, L, t, it, it.row0, it.nrows, {}, scratch, partials);
      return;
    }
    const int R = p.num_index_heads / p.num_kv_heads, K = p.topk;
    auto selection = [&](int64_t row, std::vector<int32_t>& sel) {
      sel.clear();
      for (int i = 0; i < R; ++i) {
        const int32_t* ids =
            t.topk.ptr<int32_t>() + (it.g * R + i) * t.topk.strides[0] + row * t.topk.strides[1];
        for (int k = 0; k < K; ++k) {
          const int32_t c = ids[k * t.topk.strides[2]];
          if (c >= 0) sel.push_back(c);
        }
      }
      std::sort(sel.begin(), sel.end());
      sel.erase(std::unique(sel.begin(), sel.end()), sel.end());
    };
    std::vector<int32_t> sel, next;
    sel.reserve(static_cast<size_t>(R) * K);
    next.reserve(static_cast<size_t>(R) * K);
    selection(it.row0, sel);
    int tok0 = 0;
    while (tok0 < it.nrows) {
      int tok1 = tok0 + 1;
      for (; tok1 < it.nrows; ++tok1) {
        selection(it.row0 + tok1, next);
        if (next != sel) break;
      }
      attend_rows(cp, p, L, t, it, it.row0 + tok0, tok1 - tok0, sel, scratch, partials);
      sel.swap(next);
      tok0 = tok1;
    }
  }

  // Rows row0 .. row0+nrows-1 of an item against their keys (their split of them, for split
  // decode); sparse rows all use the selection `sel` (ascending unique block ids).
  void attend_rows(const CpuPlan& cp, const Problem& p, const BatchLayout& L, const Tensors& t,
                   const Item& it, int64_t row0, int nrows, const std::vector<int32_t>& sel,
                   float* scratch, float* partials) const {
    const int Hkv = p.num_kv_heads, G = p.num_q_heads / Hkv, D = p.head_dim;
    const int MV = (nrows * G + cp.W - 1) / cp.W, Mp = cp.W * MV;  // <= cp.MV
    const int M = nrows * G;
    const int b = it.b, g = it.g;
    float* qT = scratch;
    float* oT = qT + static_cast<size_t>(D) * Mp;
    float* kt = oT + static_cast<size_t>(D) * Mp;
    float* vt = kt + static_cast<size_t>(kKeyTile) * D;
    float* sT = vt + static_cast<size_t>(kKeyTile) * D;
    float* m = sT + static_cast<size_t>(kKeyTile) * Mp;
    float* l = m + Mp;
    int32_t* rowpos = reinterpret_cast<int32_t*>(l + Mp);
    int32_t* jpos = rowpos + Mp;
    // bf16 q and K/V, even head_dim, on a set with bf16 dot products: K and V are read from the
    // cache as they are (Bf16Dot); q and V in pairs take the places of qT and vt.
    const bool pairs =
        ks_.attend_tile_bf16 && p.q_dtype == DType::bf16 && p.kv_dtype == DType::bf16 && D % 2 == 0;
    uint16_t* q2 = reinterpret_cast<uint16_t*>(qT);
    uint16_t* v2 = reinterpret_cast<uint16_t*>(vt);
    uint16_t* p2 = reinterpret_cast<uint16_t*>(jpos + kKeyTile + 64);

    const int64_t first_pos = L.kv_len[b] - L.q_len[b] + (row0 - L.q_indptr[b]);
    const float qscale = p.effective_sm_scale() * kLog2e;
    std::fill(qT, qT + static_cast<size_t>(D) * Mp, 0.f);
    std::fill(oT, oT + static_cast<size_t>(D) * Mp, 0.f);
    for (int r = 0; r < Mp; ++r) {
      const int tok = std::min(r / G, nrows - 1);
      rowpos[r] = static_cast<int32_t>(first_pos + tok);
      m[r] = kNegInf;
      l[r] = 0.f;
    }
    for (int r = 0; r < M; ++r) {
      const int tok = r / G, h = r % G;
      const int64_t off = (row0 + tok) * t.q.strides[0] + (g * G + h) * t.q.strides[1];
      if (pairs) {  // q as it is (the scale goes to the scores): q2[x / 2][r][x % 2]
        const uint16_t* qr = static_cast<const uint16_t*>(t.q.data) + off;
        for (int x = 0; x < D; ++x) q2[(x / 2 * Mp + r) * 2 + x % 2] = qr[x];
      } else {
        for (int x = 0; x < D; ++x)
          qT[x * Mp + r] = load_as_f32(t.q.data, p.q_dtype, off + x) * qscale;
      }
    }
    const int64_t last = std::min<int64_t>(first_pos + nrows - 1, L.kv_len[b] - 1);

    // Key segments of this item.
    std::vector<std::pair<int64_t, int64_t>> segs;
    if (!attends_selected_blocks(p.op)) {
      segs.emplace_back(0, last + 1);
    } else {
      const int B = p.block_size;
      for (int32_t c : sel) {
        const int64_t j0 = static_cast<int64_t>(c) * B;
        const int64_t j1 = std::min<int64_t>(j0 + B, last + 1);
        if (j0 < j1) {
          if (!segs.empty() && segs.back().second == j0)
            segs.back().second = j1;  // adjacent blocks: one segment
          else
            segs.emplace_back(j0, j1);
        }
      }
    }
    if (it.nsplit > 1) {
      // This split's share of the key list, by key count.
      int64_t total = 0;
      for (auto& s : segs) total += s.second - s.first;
      const int64_t k0 = total * it.split / it.nsplit, k1 = total * (it.split + 1) / it.nsplit;
      std::vector<std::pair<int64_t, int64_t>> mine;
      int64_t at = 0;
      for (auto& s : segs) {
        const int64_t len = s.second - s.first;
        const int64_t a = std::max(at, k0), e = std::min(at + len, k1);
        if (a < e) mine.emplace_back(s.first + (a - at), s.first + (e - at));
        at += len;
      }
      segs.swap(mine);
    }

    TileState st{qT, oT, m, l, rowpos, D};
    KeyCursor cur(segs.data(), static_cast<int>(segs.size()));
    if (pairs) {
      st.scale = qscale;
      st.v2 = v2;
      st.p2 = p2;
      CacheTile ct;
      while (!cur.done()) {
        const int npad = cache_tile(cur, t.k_cache, t.v_cache, L, b, g, ct, jpos);
        TilePrefetch pf = next_tile_rows(cur, t.k_cache, &t.v_cache, L, b, g, D);
        ks_.attend_tile_bf16(MV, st, ct, jpos, npad, sT, pf);
      }
    }
    while (!cur.done()) {
      int npad = 0;
      fill_tile(ks_, cur, t.k_cache, &t.v_cache, p.kv_dtype, L, b, g, D, kt, vt, jpos, &npad);
      TilePrefetch pf = next_tile_rows(cur, t.k_cache, &t.v_cache, L, b, g, D);
      ks_.attend_tile(MV, st, kt, vt, jpos, npad, sT, pf);
    }
    if (it.partial >= 0) {
      float* slot = partials + round16(cp.partial_floats) * it.partial;
      std::memcpy(slot, m, sizeof(float) * Mp);
      std::memcpy(slot + Mp, l, sizeof(float) * Mp);
      std::memcpy(slot + 2 * Mp, oT, sizeof(float) * D * Mp);
      return;
    }
    for (int r = 0; r < M; ++r) finalize_row(p, t, row0 + r / G, g * G + r % G, m[r], l[r], oT + r, Mp);
  }

  // Sink, normalisation, output and lse of one (row, q head); o[x * stride] is unnormalised.
  static void finalize_row(const Problem& p, const Tensors& t, int64_t row, int hq, float mm,
                           float ll, const float* o, int stride) {
    const int D = p.head_dim;
    float c = 1.f;
    if (p.has_sink) {
      const float sk = t.sink.ptr<float>()[hq * t.sink.strides[0]] * kLog2e;
      const float m2 = std::max(mm, sk);
      c = (mm == kNegInf) ? 0.f : std::exp2(mm - m2);
      ll = ll * c + std::exp2(sk - m2);
      mm = m2;
    }
    const float inv = ll > 0.f ? c / ll : 0.f;
    const int64_t off = row * t.out.strides[0] + hq * t.out.strides[1];
    if (t.out.dtype == DType::f32) {
      float* out = t.out.ptr<float>() + off;
      for (int x = 0; x < D; ++x) out[x] = o[x * stride] * inv;
    } else {
      for (int x = 0; x < D; ++x) store_from_f32(t.out.data, t.out.dtype, off + x, o[x * stride] * inv);
    }
    if (p.write_lse)
      t.lse.ptr<float>()[row * t.lse.strides[0] + hq * t.lse.strides[1]] =
          ll > 0.f ? (mm + std::log2(ll)) * kLn2 : kNegInf;
  }

  // Combines the splits of one (request, kv head) in split order.
  void merge_splits(const CpuPlan& cp, const Problem& p, const Tensors& t, const Merge& mg,
                    const float* partials) const {
    const int G = p.num_q_heads / p.num_kv_heads, D = p.head_dim, Mp = cp.W * cp.MV;
    const size_t slot = round16(cp.partial_floats);
    std::vector<float> o(D);
    for (int r = 0; r < G; ++r) {
      float mx = kNegInf;
      for (int s = 0; s < mg.n; ++s) mx = std::max(mx, partials[slot * (mg.first + s) + r]);
      float ll = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      if (mx != kNegInf) {
        for (int s = 0; s < mg.n; ++s) {
          const float* ps = partials + slot * (mg.first + s);
          const float w = std::exp2(ps[r] - mx);  // empty split: exp2(-inf) = 0
          ll += ps[Mp + r] * w;
          const float* os = ps + 2 * Mp + r;
          for (int x = 0; x < D; ++x) o[x] += os[x * Mp] * w;
        }
      }
      finalize_row(p, t, mg.row, mg.g * G + r, mx, ll, o.data(), 1);
    }
  }

  void index_item(const CpuPlan& cp, const Problem& p, const BatchLayout& L, const Tensors& t,
                  const Item& it, float* scratch) const {
    const int Di = p.index_dim, B = p.block_size, K = p.topk;
    const int MV = cp.MV, Mp = cp.W * MV, hc = it.nheads;
    const int M = it.nrows * hc;
    const bool lse = p.score_type == ScoreType::lse;
    const int b = it.b;
    const int64_t first_pos = L.kv_len[b] - L.q_len[b] + (it.row0 - L.q_indptr[b]);
    const int64_t last = std::min<int64_t>(first_pos + it.nrows - 1, L.kv_len[b] - 1);
    const int nblk = static_cast<int>(last / B + 1);
    float* qT = scratch;
    float* kt = qT + static_cast<size_t>(Di) * Mp;
    float* sT = kt + static_cast<size_t>(kKeyTile) * Di;
    float* bm = sT + static_cast<size_t>(kKeyTile) * Mp;
    float* bsum = bm + static_cast<size_t>(cp.max_blocks) * Mp;  // lse only
    float* row_scores = bsum + (lse ? static_cast<size_t>(cp.max_blocks) * Mp : 0);
    int32_t* ids = reinterpret_cast<int32_t*>(row_scores + cp.max_blocks);
    int32_t* rowpos = ids + cp.max_blocks;
    int32_t* jpos = rowpos + Mp;

    const float s = p.effective_index_scale();
    std::fill(qT, qT + static_cast<size_t>(Di) * Mp, 0.f);
    std::fill(bm, bm + static_cast<size_t>(nblk) * Mp, kNegInf);
    if (lse) std::fill(bsum, bsum + static_cast<size_t>(nblk) * Mp, 0.f);
    for (int r = 0; r < Mp; ++r)
      rowpos[r] = static_cast<int32_t>(first_pos + std::min(r / hc, it.nrows - 1));
    for (int r = 0; r < M; ++r) {
      const int tok = r / hc, h = it.g + r % hc;
      const int64_t off = (it.row0 + tok) * t.index_q.strides[0] + h * t.index_q.strides[1];
      for (int x = 0; x < Di; ++x) qT[x * Mp + r] = load_as_f32(t.index_q.data, p.q_dtype, off + x) * s;
    }
    // One row (decode, one index head): the dot-product form of the scores.
    std::array<float, 256> qrow_buf;
    const float* qrow = nullptr;
    if (M == 1 && Di % cp.W == 0 && Di <= 256) {
      for (int x = 0; x < Di; ++x) qrow_buf[x] = qT[x * Mp];
      qrow = qrow_buf.data();
    }
    if (qrow && (p.kv_dtype == DType::bf16 || p.kv_dtype == DType::f32) &&
        t.index_k_cache.strides[3] == 1) {
      // One row (qrow implies M == 1): scored straight from the cache.
      ks_.index_row_scores(qrow, Di, t.index_k_cache, L.page_ids.data() + L.page_indptr[b],
                           L.page_size, last + 1, B, lse, bm, bsum, Mp);
    } else {
      const std::pair<int64_t, int64_t> seg{0, last + 1};
      KeyCursor cur(&seg, 1);
      while (!cur.done()) {
        int npad = 0;
        const int n = fill_tile(ks_, cur, t.index_k_cache, nullptr, p.kv_dtype, L, b, 0, Di, kt,
                                nullptr, jpos, &npad);
        TilePrefetch pf = next_tile_rows(cur, t.index_k_cache, nullptr, L, b, 0, Di);
        pf.issue(pf.lines());
        ks_.index_tile(MV, qT, qrow, Di, rowpos, kt, jpos, npad, n, sT, B, lse, bm, bsum);
      }
    }
    for (int r = 0; r < M; ++r) {
      const int tok = r / hc, h = it.g + r % hc;
      const int64_t pos = first_pos + tok;
      const int nvis = static_cast<int>(pos / B + 1);
      float* S = row_scores;
      for (int c = 0; c < nvis; ++c) {
        float v = bm[static_cast<size_t>(c) * Mp + r];
        if (lse && v != kNegInf) v += std::log(bsum[static_cast<size_t>(c) * Mp + r]);
        if (std::isnan(v)) v = -1e30f;
        if (c < p.init_blocks) v = 1e30f;
        if (c >= nvis - p.local_blocks) v = 1e29f;
        S[c] = v;
        ids[c] = c;
      }
      const int keff = std::min(K, nvis);
      // Descending score, ties to the smaller id: a total order, so deterministic.
      auto better = [S](int32_t a, int32_t bb) { return S[a] > S[bb] || (S[a] == S[bb] && a < bb); };
      if (keff < nvis) std::nth_element(ids, ids + keff, ids + nvis, better);
      std::sort(ids, ids + keff);
      int32_t* o = t.topk.ptr<int32_t>() + h * t.topk.strides[0] + (it.row0 + tok) * t.topk.strides[1];
      for (int k = 0; k < K; ++k) o[k * t.topk.strides[2]] = k < keff ? ids[k] : -1;
    }
  }

  std::string name_ = "cpu";
  const KernelSet& ks_;
  ThreadPool pool_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int num_threads, CpuIsa isa) {
  if (!cpu_supports(isa))
    throw InvalidArgument(std::string("cpu backend: this CPU lacks the ") + cpu_isa_name(isa) +
                          " instruction set (it has " + cpu_isa_name(supported_cpu_isa()) + ")");
  return std::make_unique<CpuBackend>(num_threads, isa);
}

}  // namespace attnrt
