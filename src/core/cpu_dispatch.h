// Run-time ISA dispatch for hot CPU loops: GCC target_clones builds one version per listed
// target and an ifunc picks the best at load time, so a binary is not tied to the build
// machine's instruction set. ThreadSanitizer builds get the baseline version only: their ifunc
// resolvers are instrumented, run before the sanitizer runtime is up, and crash at load.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define ATTNRT_TARGET_CLONES(...)
#else
#define ATTNRT_TARGET_CLONES(...) __attribute__((target_clones(__VA_ARGS__)))
#endif
