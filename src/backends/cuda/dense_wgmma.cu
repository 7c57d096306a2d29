// Hopper dense_extend (sm_90a, head_dim 128, bf16/f16): warpgroup MMA (wgmma).
//
// A CTA of two warpgroups owns 128 query rows of one request and one query head (64 rows per
// warpgroup) and walks the key tiles [0, last visible key] in steps of 128 keys:
//   S = Q K^T   wgmma m64n128k16, Q and K read by the tensor cores from shared memory;
//   online softmax on the S accumulators (log2 domain, causal mask only on tiles that cross it);
//   O += P V    wgmma m64n128k16 with P in registers (the accumulator layout of S is the
//               register layout of an A operand) and V read from shared memory as N-major B.
// The two products are software-pipelined: step i issues S of tile i and P V of tile i - 1 back
// to back, so the tensor cores run P V while the warpgroup computes the softmax of tile i. K and
// V have two stages each. Shared-memory tiles use the 128-byte swizzle of the wgmma descriptors:
// a [rows][128] tile is two 64-column panels of 128-byte rows whose 16-byte chunks are XOR-ed
// with (row & 7); K and V share the layout (K is read K-major, V N-major).
//
// Two ways to fill the K/V stages, chosen per run on the host:
//   * copy engine (kTma), when a page run of B = gcd(page_size, 128) >= 8 rows is one box of a
//     4-d tensor map over the cache ([pages][rows][heads][128 dims]): a producer warp (a third
//     warpgroup that hands most of its registers to the consumers) copies K of tile t and V of
//     tile t - 1 as soon as the consumers released the stage, one box (one page run, one
//     64-column panel) per lane; mbarriers count the bytes in and the consumer warps out, so
//     the loop has no CTA barrier. The two consumer warpgroups take turns issuing their
//     products (ping-pong), so one's softmax overlaps the other's tensor-core work. Rows past
//     the last key are not copied; the last V tile's rows from there on are zeroed, so P = 0
//     never meets stale or unwritten values (0 * NaN is NaN).
//   * cp.async (any page size, any strides): every thread gathers 16-byte chunks of 8 rows (zero-
//     fill past the end), one CTA barrier per step; K of tile i + 1 and V of tile i are in flight
//     during step i.
// Finished rows go out through shared memory (the warpgroup's Q panels) in 16-byte chunks.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <numeric>
#include <type_traits>

#include "cuda_common/kernel_attr.h"
#include "cuda_common/mbarrier.cuh"
#include "cuda_common/mma_sm80.cuh"
#include "dense_args.h"

namespace attnrt_cuda_dense {
namespace {

using namespace attnrt_cuda_common;

constexpr int kD = 128;
constexpr int kBQ = kWgmmaTileRows;  // query rows per CTA: 2 warpgroups x 64
constexpr int kBK = 128;             // keys per step
constexpr int kThreads = 256;       // the two consumer warpgroups
// The copy-engine kernel adds a producer warpgroup (one working warp): registers are allocated
// per warpgroup, so the producer gives most of its share to the consumers (setmaxnreg).
constexpr int threads_of(bool tma) { return tma ? kThreads + 128 : kThreads; }
constexpr uint32_t kQBytes = kBQ * kD * 2;
constexpr uint32_t kTileBytes = kBK * kD * 2;  // one K or V stage
constexpr uint32_t kPanel = kBK * 128;         // one 64-column panel of a K/V stage
constexpr int kStages = 2;                     // K and V stages each
constexpr size_t kSmemBytes = kQBytes + 2 * kStages * kTileBytes + 1024;  // + alignment slack

// The copy-engine maps of the K and V caches (unused by the cp.async kernel) and their box rows.
struct CacheMaps {
  CUtensorMap k, v;
  int box_rows;
  int staged_out;  // out rows written through shared memory in 16-byte chunks (aligned output)
};

// The 64 f32 accumulators of an m64n128 wgmma: operands %0..%63 of its asm and their constraints.
#define ATTNRT_WGMMA_D_OPERANDS \
  "{%0, %1, %2, %3, %4, %5, %6, %7," \
  " %8, %9, %10, %11, %12, %13, %14, %15," \
  " %16, %17, %18, %19, %20, %21, %22, %23," \
  " %24, %25, %26, %27, %28, %29, %30, %31," \
  " %32, %33, %34, %35, %36, %37, %38, %39," \
  " %40, %41, %42, %43, %44, %45, %46, %47," \
  " %48, %49, %50, %51, %52, %53, %54, %55," \
  " %56, %57, %58, %59, %60, %61, %62, %63}, "
#define ATTNRT_WGMMA_D_CONSTRAINTS \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), \
  "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
  "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), \
  "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
  "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
  "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), \
  "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), \
  "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
  "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// The two m64n128k16 forms the kernel issues, for one 16-bit input type TY (".bf16", ".f16").
#define ATTNRT_WGMMA_M64N128K16(TY)                                                              \
  /* d (+)= A B, A 64 x 16 and B (K tile rows) 16 x 128 both K-major in shared memory; */        \
  /* acc = 0 overwrites d. */                                                                    \
  static __device__ __forceinline__ void ss(float (&d)[64], uint64_t da, uint64_t db, int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                    \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32" TY TY " " ATTNRT_WGMMA_D_OPERANDS \
                 "%64, %65, p, 1, 1, 0, 0;\n}\n"                                                 \
                 : ATTNRT_WGMMA_D_CONSTRAINTS                                                    \
                 : "l"(da), "l"(db), "r"(acc));                                                  \
  }                                                                                              \
  /* d += A B, A 64 x 16 in registers (each warp's 16 rows as the mma.sync A fragment), */       \
  /* B (V tile rows: keys x head dims) 16 x 128 N-major in shared memory. */                     \
  static __device__ __forceinline__ void rs(float (&d)[64], const uint32_t* a, uint64_t db) {    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                    \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32" TY TY " " ATTNRT_WGMMA_D_OPERANDS \
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                   \
                 : ATTNRT_WGMMA_D_CONSTRAINTS                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));                 \
  }

template <typename T>
struct Wgmma;
template <>
struct Wgmma<__nv_bfloat16> {
  ATTNRT_WGMMA_M64N128K16(".bf16")
};
template <>
struct Wgmma<__half> {
  ATTNRT_WGMMA_M64N128K16(".f16")
};

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N of this warpgroup's committed wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma.
__device__ __forceinline__ void pin(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Makes this thread's completed cp.async writes visible to the tensor cores' (async proxy) reads.
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Shared-memory matrix descriptor, 128-byte swizzle (the tile starts on a 1024-byte boundary).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}
// Byte offset of 16-byte chunk c (0..15) of row r in a swizzled tile of 64-column panels.
__device__ __forceinline__ uint32_t chunk_off(int r, int c, uint32_t panel_bytes) {
  return (c >> 3) * panel_bytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

template <typename T, bool kTma>
__global__ void __launch_bounds__(threads_of(kTma), 1)
    extend_wgmma_kernel(const Args a, const __grid_constant__ CacheMaps maps) {
  constexpr int S = kStages;
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  __shared__ uint64_t full_k[S], full_v[S];    // kTma: copies of a stage landed
  __shared__ uint64_t empty_k[S], empty_v[S];  // kTma: all 8 consumer warps done with a stage
  __shared__ uint64_t last_v;                  // kTma: last V tile landed and its tail zeroed
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sQ = base, sK = base + kQBytes, sV = sK + S * kTileBytes;
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;

  int h;
  const int2 tile = extend_block(a, h);
  const int b = tile.x, qs = tile.y, kvh = h / a.group;
  const int kv = a.kv_len[b], ql = a.q_len[b];
  const int rows_valid = min(kBQ, ql - qs);
  const int tok0 = a.q_start[b] + qs;
  const int key_end = min(kv, kv - ql + qs + kBQ);
  const int n_tiles = (key_end + kBK - 1) / kBK;
  const T* __restrict__ q = static_cast<const T*>(a.q);
  const int32_t* __restrict__ pages = a.page_ids + a.page_indptr[b];

  if (kTma && tid == 0) {
#pragma unroll
    for (int i = 0; i < S; ++i) {
      bar_init(&full_k[i], 1), bar_init(&full_v[i], 1);
      bar_init(&empty_k[i], kThreads / 32), bar_init(&empty_v[i], kThreads / 32);
    }
    bar_init(&last_v, 1);
    bar_init_fence();
  }
  // Q by cp.async: consumer thread owns 16-byte column chunk lc of rows lr0 + 16 i (i < 8).
  const int lc = tid & 15, lr0 = tid >> 4;
  if (tid < kThreads) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = lr0 + 16 * i;
      const bool valid = r < rows_valid;
      const T* src = valid ? q + static_cast<int64_t>(tok0 + r) * a.q_s0 + h * a.q_s1 + lc * 8 : q;
      // warpgroup r / 64 owns rows [64 wg, 64 wg + 64): its own two 8 KB panels
      cp_async16(sQ + (r >> 6) * (kQBytes / 2) + chunk_off(r & 63, lc, kQBytes / 4), src, valid);
    }
  }

  // ---- cp.async path: every consumer thread gathers K/V rows between CTA barriers.
  // Key rows t * 128 + lr0 + 16 i (i < 8) of tile t: their K and V addresses in the paged cache.
  // Rows 16 apart share a page unless the second starts one, so a thread reads a page id only
  // at its first row and where a page begins. K and V share the page table.
  const T* __restrict__ kc = static_cast<const T*>(a.kc);
  const T* __restrict__ vc = static_cast<const T*>(a.vc);
  const T* __restrict__ kb = kc + kvh * a.k_s2 + lc * 8;
  const T* __restrict__ vb = vc + kvh * a.v_s2 + lc * 8;
  auto row_ptrs = [&](int t, const T* (&kp)[8], const T* (&vp)[8]) {
    int64_t page = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int j = t * kBK + lr0 + 16 * i;
      kp[i] = kc;
      vp[i] = vc;
      if (j < key_end) {
        int pg, row;
        key_page(a, j, pg, row);
        if (i == 0 || row < 16) page = pages[pg];
        kp[i] = kb + page * a.k_s0 + row * a.k_s1;
        vp[i] = vb + page * a.v_s0 + row * a.v_s1;
      }
    }
  };
  // cp.async of the 8 rows of tile t into a stage (zero-fill past the end).
  auto issue_rows = [&](const T* const (&ptr)[8], int t, uint32_t dst) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = lr0 + 16 * i;
      cp_async16(dst + chunk_off(r, lc, kPanel), ptr[i], t * kBK + r < key_end);
    }
  };
  const T* vsave[8];  // V rows of the last tile whose K was started
  auto load_k = [&](int t) {
    if (t >= n_tiles) return;
    const T* kp[8];
    row_ptrs(t, kp, vsave);
    issue_rows(kp, t, sK + (t % S) * kTileBytes);
  };
  auto load_v = [&](int t) {  // after load_k(t)
    if (t >= 0 && t < n_tiles) issue_rows(vsave, t, sV + (t % S) * kTileBytes);
  };

  // ---- copy-engine path: the producer warp (warp 8) copies K of tile t, then V of tile t - 1
  // (the order the steps consume them), each once the 8 consumer warps released the stage's
  // previous tile. Lane 2 r + p copies page run r (rows [r B, r B + B) of a tile), panel p.
  if constexpr (kTma) {
    __syncthreads();  // barrier inits
    // (the warpgroup index made visibly warp-uniform, as setmaxnreg needs)
    if (__shfl_sync(0xffffffffu, tid / 128, 0) == kThreads / 128) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
      if (tid >= kThreads + 32) return;
      const int box = maps.box_rows, run = lane >> 1, panel = lane & 1;
      const bool copier = lane < 2 * (kBK / box);
      auto run_page = [&](int t) {  // page id of this lane's run of tile t; -1: none
        const int j = t * kBK + run * box;
        if (!copier || t >= n_tiles || j >= key_end) return -1;
        int pg, row;
        key_page(a, j, pg, row);
        return static_cast<int>(pages[pg]);
      };
      // Tile t into stage `dst`: whole boxes up to key_end, their bytes announced first.
      auto copy_tile = [&](const CUtensorMap* map, int t, uint32_t dst, uint64_t* bar, int page) {
        if (lane == 0) {
          const int boxes = min(kBK / box, (key_end - t * kBK + box - 1) / box);
          bar_expect_tx(bar, static_cast<uint32_t>(boxes * 2 * box * 128));
        }
        __syncwarp();
        if (page >= 0) {
          int pg, row;
          key_page(a, t * kBK + run * box, pg, row);
          tma_load_4d(dst + panel * kPanel + run * box * 128, map, panel * 64, kvh, row, page, bar);
        }
      };
      // A fresh barrier's parity-1 wait returns at once: the first two tiles do not wait.
      int prev = -1;
      for (int t = 0; t <= n_tiles; ++t) {
        const int page = run_page(t);
        if (t < n_tiles) {
          bar_wait(&empty_k[t % S], ((t / S) & 1) ^ 1);
          copy_tile(&maps.k, t, sK + (t % S) * kTileBytes, &full_k[t % S], page);
        }
        if (t > 0) {
          const int u = t - 1;
          bar_wait(&empty_v[u % S], ((u / S) & 1) ^ 1);
          copy_tile(&maps.v, u, sV + (u % S) * kTileBytes, &full_v[u % S], prev);
        }
        prev = page;
      }
      if (n_tiles > 0) {
        // V rows of the last tile from key_end on were not copied (or came from past the end of
        // the context): zero them, since P = 0 times a NaN there would still be NaN.
        const int u = n_tiles - 1;
        bar_wait(&full_v[u % S], (u / S) & 1);
        const uint32_t v_st = sV + (u % S) * kTileBytes;
        for (int i = (key_end - u * kBK) * 16 + lane; i < kBK * 16; i += 32)
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(
                           v_st + chunk_off(i >> 4, i & 15, kPanel)),
                       "r"(0)
                       : "memory");
        fence_async_smem();
        __syncwarp();
        if (lane == 0) bar_arrive(&last_v);
      }
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    cp_commit();  // Q
  } else {
    // Copy groups: group j = {V of tile j - 1, K of tile j} (group 0 adds Q). Groups 0 .. S - 2
    // start here; step i waits for group i, then starts group i + S - 1.
#pragma unroll
    for (int j = 0; j < S - 1; ++j) {
      load_v(j - 1);
      load_k(j);
      cp_commit();
    }
  }

  // Rows of this thread in the CTA tile: r0 (accumulator elements 0, 1 of each 8-column group)
  // and r0 + 8 (elements 2, 3).
  const int r0 = 64 * wg + 16 * ((tid >> 5) & 3) + g;
  const int lim0 = min(kv, kv - ql + qs + r0 + 1), lim1 = min(kv, kv - ql + qs + r0 + 9);
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t p[32];  // P as A fragments: 16 keys per 4 registers
  const uint32_t q_wg = sQ + wg * (kQBytes / 2);

  // Start of step it: K of tile it and V of tile it - 1 have landed. cp.async: after the barrier
  // every thread has finished step it - 1, whose wgmmas were the last readers of the stages the
  // next group overwrites, so one CTA barrier per step suffices.
  auto wait_tile = [&](int it) {
    if constexpr (kTma) {
      if (it == 0) {
        cp_wait<0>();  // Q, then every consumer's share of it
        fence_async_smem();
        asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
      }
      if (it < n_tiles) bar_wait(&full_k[it % S], (it / S) & 1);
      if (it == n_tiles)
        bar_wait(&last_v, 0);
      else if (it > 0)
        bar_wait(&full_v[(it - 1) % S], ((it - 1) / S) & 1);
    } else {
      cp_wait<S - 2>();
      fence_async_smem();
      __syncthreads();
      load_v(it + S - 2);
      load_k(it + S - 1);
      cp_commit();
    }
  };
  // kTma: a consumer warp hands a stage back once its wgmmas that read it completed.
  auto release = [&](uint64_t* bar) {
    if constexpr (kTma)
      if (lane == 0) bar_arrive(bar);
  };
  // Ping-pong (kTma): the warpgroups take turns issuing their products (named barriers 2 + wg),
  // so one's softmax runs while the tensor cores serve the other's products. (Measured on the
  // H200, 4k x 4 causal: 1.04 -> 1.02 ms; with the staged output 0.98.)
  constexpr bool pingpong = kTma;
  auto turn_wait = [&] {
    if (pingpong) asm volatile("bar.sync %0, %1;" ::"r"(2 + wg), "n"(kThreads) : "memory");
  };
  auto turn_pass = [&] {
    if (pingpong) asm volatile("bar.arrive %0, %1;" ::"r"(3 - wg), "n"(kThreads) : "memory");
  };
  // S = Q K^T of tile it (head dim in 8 steps of 16: 4 per 64-column panel, 32 bytes apart); the
  // first step overwrites S, so it needs no zeroing.
  auto issue_s = [&](int it, float(&s)[64]) {
    const uint32_t k_st = sK + (it % S) * kTileBytes;
    pin(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const uint32_t koff = (kk & 3) * 32u;
      Wgmma<T>::ss(s, sw128_desc(q_wg + (kk >> 2) * (kQBytes / 4) + koff, 16, 1024),
                   sw128_desc(k_st + (kk >> 2) * kPanel + koff, 16, 1024), kk > 0);
    }
    wgmma_commit();
  };
  // O += P V of tile t (keys in 8 steps of 16 = 2 groups of 8 rows, 2048 bytes apart; the two
  // 64-column panels of V are the N-major repeats, kPanel apart).
  auto issue_pv = [&](int t) {
    const uint32_t v_st = sV + (t % S) * kTileBytes;
    pin(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      Wgmma<T>::rs(o, p + 4 * kk, sw128_desc(v_st + kk * 2048, kPanel, 1024));
    wgmma_commit();
  };
  // Mask and online softmax of tile it in place (log2 domain, scores scaled by
  // sm_scale * log2 e); corr: the factor the running O must take before P V of this tile is
  // added.
  auto softmax = [&](int it, float(&s)[64], float(&corr)[2]) {
    const int j0 = it * kBK;
    if (j0 + kBK > min(lim0, lim1)) {  // tiles that cross the diagonal or the end only
#pragma unroll
      for (int nt = 0; nt < 16; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = j0 + nt * 8 + 2 * t4 + (e & 1);
          if (j >= ((e & 2) ? lim1 : lim0)) s[nt * 4 + e] = -INFINITY;
        }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt)
        mx = fmaxf(mx, fmaxf(s[nt * 4 + 2 * hr], s[nt * 4 + 2 * hr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = fmaxf(m[hr], mx * a.scale_log2);
      const float bias = mn == -INFINITY ? 0.f : mn;
      corr[hr] = fast_exp2(m[hr] - bias);  // m = -inf -> 0
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        const float p0 = fast_exp2(fmaf(s[nt * 4 + 2 * hr], a.scale_log2, -bias));
        const float p1 = fast_exp2(fmaf(s[nt * 4 + 2 * hr + 1], a.scale_log2, -bias));
        s[nt * 4 + 2 * hr] = p0;
        s[nt * 4 + 2 * hr + 1] = p1;
        sum += p0 + p1;
      }
      l[hr] = l[hr] * corr[hr] + sum;
      m[hr] = mn;
    }
  };
  auto pack_p = [&](const float(&s)[64]) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      p[4 * kk + 0] = Mma<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
      p[4 * kk + 1] = Mma<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
      p[4 * kk + 2] = Mma<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
      p[4 * kk + 3] = Mma<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  auto rescale_o = [&](const float(&corr)[2]) {
#pragma unroll
    for (int dt = 0; dt < 16; ++dt) {
      o[dt * 4 + 0] *= corr[0];
      o[dt * 4 + 1] *= corr[0];
      o[dt * 4 + 2] *= corr[1];
      o[dt * 4 + 3] *= corr[1];
    }
  };

  if (n_tiles > 0) {
    // Step it computes S of tile it while the tensor cores run P V of tile it - 1; once that
    // P V completed, O takes the rescale for tile it and P is packed. The first step has no
    // P V, the last (it = n_tiles) no S: no branch between a wgmma and its wait.
    if (pingpong && wg == 1) turn_pass();  // warpgroup 0 goes first
    float corr[2];
    {
      wait_tile(0);
      float s[64];
      turn_wait();
      issue_s(0, s);
      turn_pass();
      wgmma_wait<0>();
      release(&empty_k[0]);
      pin(s);
      softmax(0, s, corr);
      pack_p(s);  // (O is zero: no rescale)
    }
    for (int it = 1; it < n_tiles; ++it) {
      wait_tile(it);
      float s[64];
      turn_wait();
      issue_s(it, s);
      issue_pv(it - 1);
      turn_pass();
      wgmma_wait<1>();  // S done, P V may still run
      release(&empty_k[it % S]);
      pin(s);
      softmax(it, s, corr);
      wgmma_wait<0>();  // P V done before P is overwritten
      release(&empty_v[(it - 1) % S]);
      pin(o);
      rescale_o(corr);
      pack_p(s);
    }
    wait_tile(n_tiles);
    turn_wait();
    issue_pv(n_tiles - 1);
    if (wg == 0) turn_pass();  // (warpgroup 0 takes no further turn)
    wgmma_wait<0>();
    pin(o);
  }
  cp_wait<0>();  // (no tiles: the Q copy)

#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
    l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
  }
  if (maps.staged_out) {
    // The warpgroup's Q panels (its S products have all completed) take its 64 finished rows in
    // the swizzled layout (conflict-free 4-byte writes), then each thread stores whole 16-byte
    // chunks: a row's 256 bytes go out in one coalesced burst.
    const uint32_t o_wg = sQ + wg * (kQBytes / 2);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = r0 + 8 * hr;
      const float c = a.sink != nullptr ? fold_sink(m[hr], l[hr], a.sink[h]) : 1.f;
      const float inv = l[hr] > 0.f ? c / l[hr] : 0.f;
#pragma unroll
      for (int dt = 0; dt < 16; ++dt)
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(o_wg + chunk_off(row & 63, dt, kQBytes / 4) +
                                                      4 * t4),
                     "r"(Mma<T>::pack(o[dt * 4 + 2 * hr] * inv, o[dt * 4 + 2 * hr + 1] * inv))
                     : "memory");
      if (a.lse != nullptr && t4 == 0 && row < rows_valid)
        a.lse[(tok0 + row) * a.lse_s0 + h] = natural_lse(m[hr], l[hr]);
    }
    asm volatile("bar.sync %0, 128;" ::"r"(4 + wg) : "memory");
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int idx = (tid & 127) + 128 * i, rl = idx >> 4, c = idx & 15, row = 64 * wg + rl;
      if (row < rows_valid) {
        uint32_t v0, v1, v2, v3;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                     : "r"(o_wg + chunk_off(rl, c, kQBytes / 4)));
        *reinterpret_cast<uint4*>(static_cast<T*>(a.out) + (tok0 + row) * a.o_s0 + h * a.o_s1 +
                                  c * 8) = make_uint4(v0, v1, v2, v3);
      }
    }
  } else {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = r0 + 8 * hr;
      if (row < rows_valid)
        store_extend_row<T, 16>(a, tok0 + row, h, t4, m[hr], l[hr], [&](int dt) {
          return make_float2(o[dt * 4 + 2 * hr], o[dt * 4 + 2 * hr + 1]);
        });
    }
  }
#endif
}

// The driver's tensor-map encoder, looked up once through the runtime (the plugin does not link
// the driver library); null when the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    cudaGetLastError();
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A 4-d map over one cache, [pages][rows][heads][128 dims] by its strides, whose box is one page
// run of `box` rows of one head and 64 dims (128 bytes, the swizzle span). False when the cache
// cannot be described (strides not multiples of 16 bytes, unaligned base, no encoder).
template <typename T>
bool encode_cache_map(CUtensorMap* map, const void* base, const CacheExtent& e, int page_size,
                      int64_t s0, int64_t s1, int64_t s2, int box) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || e.pages <= 0 || e.kv_heads <= 0) return false;
  const uint64_t es = sizeof(T);
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(kD), static_cast<cuuint64_t>(e.kv_heads),
                              static_cast<cuuint64_t>(page_size), static_cast<cuuint64_t>(e.pages)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(s2) * es, static_cast<cuuint64_t>(s1) * es,
                                 static_cast<cuuint64_t>(s0) * es};
  for (cuuint64_t st : strides)
    if (st == 0 || st % 16 != 0 || st >= (1ull << 40)) return false;
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  const cuuint32_t boxes[4] = {64, 1, static_cast<cuuint32_t>(box), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUtensorMapDataType ty = std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                           : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return encode(map, ty, 4, const_cast<void*>(base), dims, strides, boxes, unit,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

cudaError_t load_extend_wgmma_kernels() {
  using attnrt_cuda_common::raise_smem_limit;
  using B = __nv_bfloat16;
  using H = __half;
  constexpr int smem = static_cast<int>(kSmemBytes);
  cudaError_t e = attnrt_cuda_common::load_kernels<
      extend_wgmma_kernel<B, false>, extend_wgmma_kernel<B, true>, extend_wgmma_kernel<H, false>,
      extend_wgmma_kernel<H, true>>();
  if (e == cudaSuccess) e = raise_smem_limit<extend_wgmma_kernel<B, false>>(smem);
  if (e == cudaSuccess) e = raise_smem_limit<extend_wgmma_kernel<B, true>>(smem);
  if (e == cudaSuccess) e = raise_smem_limit<extend_wgmma_kernel<H, false>>(smem);
  if (e == cudaSuccess) e = raise_smem_limit<extend_wgmma_kernel<H, true>>(smem);
  return e;
}

template <typename T>
cudaError_t launch_extend_wgmma(const Args& a, const CacheExtent& k, const CacheExtent& v,
                                cudaStream_t st) {
  CacheMaps maps{};
  maps.box_rows = std::gcd(a.page_size, kBK);
  // Page runs of fewer than 8 rows would need more copies per tile than warp 0 has lanes (and
  // break the 1024-byte swizzle atoms): those caches take cp.async.
  const bool tma = maps.box_rows >= 8 &&
                   encode_cache_map<T>(&maps.k, a.kc, k, a.page_size, a.k_s0, a.k_s1, a.k_s2,
                                       maps.box_rows) &&
                   encode_cache_map<T>(&maps.v, a.vc, v, a.page_size, a.v_s0, a.v_s1, a.v_s2,
                                       maps.box_rows);
  maps.staged_out =
      reinterpret_cast<uintptr_t>(a.out) % 16 == 0 && a.o_s0 % 8 == 0 && a.o_s1 % 8 == 0;
  if (tma)
    extend_wgmma_kernel<T, true><<<a.num_tiles * a.hq, threads_of(true), kSmemBytes, st>>>(a, maps);
  else
    extend_wgmma_kernel<T, false><<<a.num_tiles * a.hq, kThreads, kSmemBytes, st>>>(a, maps);
  return cudaGetLastError();
}

template cudaError_t launch_extend_wgmma<__nv_bfloat16>(const Args&, const CacheExtent&,
                                                        const CacheExtent&, cudaStream_t);
template cudaError_t launch_extend_wgmma<__half>(const Args&, const CacheExtent&,
                                                 const CacheExtent&, cudaStream_t);

}  // namespace attnrt_cuda_dense
