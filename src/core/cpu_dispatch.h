// Run-time ISA dispatch for hot CPU loops, two ways:
//  * ATTNRT_TARGET_CLONES: GCC target_clones builds one version per listed target and an ifunc
//    picks the best at load time, so a binary is not tied to the build machine's instruction
//    set. For loops whose best code is the same source at every width. ThreadSanitizer builds
//    get the baseline version only: their ifunc resolvers are instrumented, run before the
//    sanitizer runtime is up, and crash at load.
//  * CpuIsa levels with ATTNRT_TARGET_AVX512(_BF16) / ATTNRT_TARGET_AVX2: for kernels written
//    per level (vector width, register blocking); the caller picks a level once, e.g. at init,
//    from best_cpu_isa() or a forced choice (parse_cpu_isa, cpu_supports).
#pragma once

#include <optional>
#include <string_view>

#if defined(__SANITIZE_THREAD__)
#define ATTNRT_TARGET_CLONES(...)
#else
#define ATTNRT_TARGET_CLONES(...) __attribute__((target_clones(__VA_ARGS__)))
#endif

#define ATTNRT_TARGET_AVX512 __attribute__((target("arch=x86-64-v4")))
#define ATTNRT_TARGET_AVX512_BF16 __attribute__((target("arch=x86-64-v4,avx512bf16")))
#define ATTNRT_TARGET_AVX2 __attribute__((target("arch=x86-64-v3")))

namespace attnrt {

// Instruction-set levels, in increasing order: the x86-64 baseline (SSE2, 16 xmm), x86-64-v3
// (AVX2 + FMA + F16C, 16 ymm), x86-64-v4 (AVX-512 F/BW/CD/DQ/VL, 32 zmm) and x86-64-v4 with
// AVX512-BF16 (bf16 dot products: Zen 4 and later, Cooper Lake, Sapphire Rapids and later).
enum class CpuIsa { baseline, avx2, avx512, avx512_bf16 };

// The highest level this CPU (and OS: register state saved) supports; cpuid is read once.
inline CpuIsa supported_cpu_isa() {
  static const CpuIsa top = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4"))
      return __builtin_cpu_supports("avx512bf16") ? CpuIsa::avx512_bf16 : CpuIsa::avx512;
    if (__builtin_cpu_supports("x86-64-v3")) return CpuIsa::avx2;
    return CpuIsa::baseline;
  }();
  return top;
}

inline bool cpu_supports(CpuIsa isa) {
  return isa <= supported_cpu_isa();
}

// The level the cpu backend takes by default: the highest supported, but AVX512-BF16 only on
// AMD CPUs. There (Zen 5, measured) vdpbf16ps runs at twice the FMA peak in FLOP/s (848 against
// 425 GFLOP/s on 2 threads); on Intel's (a Sapphire Rapids class Xeon, measured) at half of it
// (161 against 328), and the bf16 set ran attention 1.4-1.9x slower than the AVX-512 set.
inline CpuIsa best_cpu_isa() {
  static const CpuIsa best = [] {
    const CpuIsa top = supported_cpu_isa();
    if (top == CpuIsa::avx512_bf16 && !__builtin_cpu_is("amd")) return CpuIsa::avx512;
    return top;
  }();
  return best;
}

inline const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::avx512_bf16:
      return "avx512bf16";
    case CpuIsa::avx512:
      return "avx512";
    case CpuIsa::avx2:
      return "avx2";
    default:
      return "baseline";
  }
}

// "avx512bf16", "avx512", "avx2" or "baseline"; nullopt for anything else.
inline std::optional<CpuIsa> parse_cpu_isa(std::string_view s) {
  for (CpuIsa isa : {CpuIsa::baseline, CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512_bf16})
    if (s == cpu_isa_name(isa)) return isa;
  return std::nullopt;
}

}  // namespace attnrt
