// Shared harness of the GPU test binaries: loads the CUDA plugin through its C ABI (dlopen, as the
// host does), skips every test with the plugin's own reason when no device is usable, and gives
// device buffers, tensor descriptors and 16-bit float conversions (round to nearest even).
// The plugin is found via ATTNRT_CUDA_PLUGIN (full path) or ../lib/<file> beside the binary.
// open_plugin() loads a second plugin the same way (a binary comparing two of them).
#pragma once

#include <attnrt/plugin.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

namespace gpu_test {

inline const attnrt_plugin_v1* g_plugin = nullptr;
inline std::string g_skip;

// Path of a plugin file: ../lib/<file> beside this binary.
inline std::string plugin_file_path(const std::string& file) {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  std::string exe = n > 0 ? std::string(buf, n) : std::string("./x");
  return exe.substr(0, exe.rfind('/')) + "/../lib/" + file;
}

inline std::string plugin_path() {
  if (const char* e = std::getenv("ATTNRT_CUDA_PLUGIN")) return e;
  return plugin_file_path(ATTNRT_CUDA_PLUGIN_FILE);
}

// Loads and initialises a plugin whose devices include a CUDA device; nullptr (reason in *why)
// otherwise.
inline const attnrt_plugin_v1* open_plugin(const std::string& path, std::string* why) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    *why = std::string("cannot load ") + path + ": " + dlerror();
    return nullptr;
  }
  auto get = reinterpret_cast<attnrt_plugin_get_fn>(dlsym(h, ATTNRT_PLUGIN_ENTRY_SYMBOL));
  if (!get) {
    *why = "no entry symbol in " + path;
    return nullptr;
  }
  const attnrt_plugin_v1* p = get();
  if (p->init() != ATTNRT_OK) {
    *why = std::string(p->name) + " plugin unavailable: " + p->last_error();
    return nullptr;
  }
  int32_t count = 0;
  p->device_count(ATTNRT_DEVICE_CUDA, &count);
  if (count == 0) {
    *why = "no CUDA device";
    return nullptr;
  }
  return p;
}

// The initialised plugin when a CUDA device is usable; nullptr (reason in g_skip) otherwise.
inline const attnrt_plugin_v1* plugin() {
  static bool done = false;
  if (done) return g_plugin;
  done = true;
  g_plugin = open_plugin(plugin_path(), &g_skip);
  return g_plugin;
}

#define REQUIRE_GPU()                                          \
  do {                                                         \
    if (!::gpu_test::plugin()) GTEST_SKIP() << ::gpu_test::g_skip; \
  } while (0)

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t to_f16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
inline float from_f16(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}

// Device buffer on cuda:0 through the plugin's memory entry points.
struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t b) : bytes(std::max<size_t>(b, 16)) {
    if (g_plugin->mem_alloc({ATTNRT_DEVICE_CUDA, 0}, bytes, &p) != ATTNRT_OK) p = nullptr;
  }
  ~Dev() {
    if (p) g_plugin->mem_free({ATTNRT_DEVICE_CUDA, 0}, p);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void up(const void* src, size_t n) { g_plugin->copy_to_device({ATTNRT_DEVICE_CUDA, 0}, p, src, n); }
  void down(void* dst, size_t n) const {
    g_plugin->copy_to_host({ATTNRT_DEVICE_CUDA, 0}, dst, p, n);
  }
};

// Contiguous tensor descriptor on cuda:0.
inline attnrt_tensor tensor(void* data, int dtype, int rank, std::initializer_list<int64_t> shape) {
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

}  // namespace gpu_test
