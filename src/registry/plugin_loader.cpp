#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <sstream>

#include "attnrt/log.h"
#include "attnrt/plugin.h"
#include "registry/plugin_backend.h"

namespace attnrt {
namespace {

attnrt_device to_c(const Device& d) { return {static_cast<int32_t>(d.kind), d.index}; }

attnrt_tensor to_c(const TensorView& t) {
  attnrt_tensor c{};
  c.data = t.data;
  c.dtype = static_cast<int32_t>(t.dtype);
  c.device = to_c(t.device);
  c.rank = t.rank;
  for (int i = 0; i < kMaxRank; ++i) {
    c.shape[i] = t.shape[i];
    c.strides[i] = t.strides[i];
  }
  return c;
}

attnrt_problem to_c(const Problem& p) {
  attnrt_problem c{};
  c.op = static_cast<int32_t>(p.op);
  c.device = to_c(p.device);
  c.q_dtype = static_cast<int32_t>(p.q_dtype);
  c.kv_dtype = static_cast<int32_t>(p.kv_dtype);
  c.page_size = p.page_size;
  c.num_q_heads = p.num_q_heads;
  c.num_kv_heads = p.num_kv_heads;
  c.head_dim = p.head_dim;
  c.sm_scale = reads_attention_inputs(p.op) ? p.effective_sm_scale() : 0.0f;
  c.has_sink = p.has_sink;
  c.write_lse = p.write_lse;
  c.num_index_heads = p.num_index_heads;
  c.index_dim = p.index_dim;
  c.block_size = p.block_size;
  c.topk = p.topk;
  c.init_blocks = p.init_blocks;
  c.local_blocks = p.local_blocks;
  c.score_type = static_cast<int32_t>(p.score_type);
  c.index_scale = reads_index_inputs(p.op) ? p.effective_index_scale() : 0.0f;
  return c;
}

// The ABI minor version that added `op` (plugin.h lists them).
uint32_t abi_minor_of(Op op) {
  return op == Op::sparse_decode ? 1u : 0u;
}

attnrt_layout to_c(const BatchLayout& l) {
  attnrt_layout c{};
  c.num_requests = l.num_requests();
  c.page_size = l.page_size;
  c.q_len = l.q_len.data();
  c.kv_len = l.kv_len.data();
  c.q_indptr = l.q_indptr.data();
  c.page_indptr = l.page_indptr.data();
  c.page_ids = l.page_ids.data();
  c.fingerprint = l.fingerprint();
  return c;
}

// Shared by the backend and every object (plans, memory) that calls into the library, so the
// library stays loaded while any of them lives.
struct PluginLibrary {
  void* handle = nullptr;
  const attnrt_plugin_v1* table = nullptr;
  std::string path;
  ~PluginLibrary() {
    if (handle) dlclose(handle);
  }
  std::string error() const {
    const char* e = table->last_error ? table->last_error() : nullptr;
    return e && *e ? e : "no message";
  }
};

class PluginPlan : public BackendPlan {
 public:
  PluginPlan(std::shared_ptr<PluginLibrary> lib, attnrt_plan p) : lib_(std::move(lib)), plan_(p) {}
  ~PluginPlan() override { lib_->table->destroy_plan(plan_); }
  attnrt_plan handle() const { return plan_; }
  // Held while one run of this plan is enqueued on a device (see run below).
  std::mutex& launch_mutex() const { return launch_mu_; }

 private:
  std::shared_ptr<PluginLibrary> lib_;
  attnrt_plan plan_;
  mutable std::mutex launch_mu_;
};

class PluginMemory : public DeviceMemory {
 public:
  PluginMemory(std::shared_ptr<PluginLibrary> lib, Device d) : lib_(std::move(lib)), device_(d) {}
  void* alloc(size_t bytes) override {
    void* p = nullptr;
    if (lib_->table->mem_alloc(to_c(device_), bytes, &p) != ATTNRT_OK || !p)
      throw Error("plugin '" + std::string(lib_->table->name) + "': allocating " +
                  std::to_string(bytes) + " bytes on " + device_.str() + " failed: " +
                  lib_->error());
    return p;
  }
  void free(void* p) noexcept override { lib_->table->mem_free(to_c(device_), p); }

 private:
  std::shared_ptr<PluginLibrary> lib_;
  Device device_;
};

class PluginBackend : public Backend {
 public:
  explicit PluginBackend(std::shared_ptr<PluginLibrary> lib)
      : lib_(std::move(lib)),
        name_(lib_->table->name),
        abi_minor_(lib_->table->abi_version & 0xffffu) {
    const auto* t = lib_->table;
    for (auto kind : {DeviceKind::cpu, DeviceKind::cuda}) {
      int32_t n = 0;
      if (t->device_count(static_cast<int32_t>(kind), &n) == ATTNRT_OK)
        for (int i = 0; i < n; ++i) devices_.push_back({kind, i});
    }
  }

  const std::string& name() const override { return name_; }
  int priority() const override { return lib_->table->priority; }
  std::vector<Device> devices() const override { return devices_; }

  Availability probe(const Problem& p) const override {
    if (std::string why = predates(p.op); !why.empty()) return Availability::no(why);
    attnrt_problem c = to_c(p);
    int32_t s = lib_->table->probe(&c);
    if (s == ATTNRT_OK) return Availability::yes();
    return Availability::no(lib_->error());
  }

  std::unique_ptr<BackendPlan> plan(const Problem& p, const BatchLayout& l, Workspace&) override {
    // Callers probe first; this keeps an op the plugin cannot know from ever reaching it.
    if (std::string why = predates(p.op); !why.empty())
      throw BackendUnavailable(name_, op_name(p.op), p.device.str(), why);
    attnrt_problem c = to_c(p);
    attnrt_layout cl = to_c(l);
    attnrt_plan out = nullptr;
    int32_t s = lib_->table->plan(&c, &cl, &out);
    if (s != ATTNRT_OK) fail(s, "plan", p);
    return std::make_unique<PluginPlan>(lib_, out);
  }

  void run(const BackendPlan& plan, const Problem& p, const BatchLayout&, const Tensors& t,
           Workspace&) override {
    attnrt_tensors c{to_c(t.q),     to_c(t.k_cache), to_c(t.v_cache),
                     to_c(t.out),   to_c(t.lse),     to_c(t.sink),
                     to_c(t.index_q), to_c(t.index_k_cache), to_c(t.topk)};
    const auto& pp = static_cast<const PluginPlan&>(plan);
    int32_t s;
    if (p.device.is_host()) {
      s = lib_->table->run(pp.handle(), &c, nullptr);
    } else {
      // A device plan may keep scratch on the device (split partials, scores, counters) that
      // each run reuses. Runs go to the device's default stream in enqueue order, so enqueuing
      // one run's launches at a time keeps two threads' runs of one plan from interleaving.
      std::lock_guard lock(pp.launch_mutex());
      s = lib_->table->run(pp.handle(), &c, nullptr);
    }
    if (s != ATTNRT_OK) fail(s, "run", p);
  }

  bool update_plan(BackendPlan& plan, const Problem&, const BatchLayout& l) override {
    if (!lib_->table->update_plan) return false;
    attnrt_layout cl = to_c(l);
    return lib_->table->update_plan(static_cast<PluginPlan&>(plan).handle(), &cl) == ATTNRT_OK;
  }

  BackendPreferences preferences(const Device& d) const override {
    BackendPreferences prefs;
    int32_t ps = 0;
    if (lib_->table->preferred_page_size &&
        lib_->table->preferred_page_size(to_c(d), &ps) == ATTNRT_OK)
      prefs.page_size = ps;
    return prefs;
  }

  DegradedRuns degraded_runs(const Device& d, Op op) const override {
    // A 1.0 or 1.1 table ends before the field (checked at load: a 1.2 one covers it).
    if (abi_minor_ < 2 || !lib_->table->degraded_runs) return {};
    uint64_t n = 0;
    char note[256] = {0};
    if (lib_->table->degraded_runs(to_c(d), static_cast<int32_t>(op), &n, note,
                                   sizeof note) != ATTNRT_OK)
      return {-1, "unknown: degraded_runs failed: " + lib_->error()};
    note[sizeof note - 1] = '\0';
    return {static_cast<int64_t>(std::min<uint64_t>(n, INT64_MAX)), note};
  }

  std::shared_ptr<DeviceMemory> device_memory(const Device& d) override {
    if (d.is_host() || !lib_->table->mem_alloc) return nullptr;
    return std::make_shared<PluginMemory>(lib_, d);
  }
  void copy_to_device(const Device& d, void* dst, const void* src, size_t n) override {
    check(lib_->table->copy_to_device &&
              lib_->table->copy_to_device(to_c(d), dst, src, n) == ATTNRT_OK,
          "copy to " + d.str());
  }
  void copy_to_host(const Device& d, void* dst, const void* src, size_t n) override {
    check(lib_->table->copy_to_host &&
              lib_->table->copy_to_host(to_c(d), dst, src, n) == ATTNRT_OK,
          "copy from " + d.str());
  }
  void synchronize(const Device& d) override {
    if (lib_->table->synchronize) check(lib_->table->synchronize(to_c(d)) == ATTNRT_OK, "synchronize " + d.str());
  }
  std::string describe_device(const Device& d) const override {
    char buf[256] = {0};
    if (lib_->table->describe_device &&
        lib_->table->describe_device(to_c(d), buf, sizeof buf) == ATTNRT_OK && buf[0])
      return buf;
    return name_ + " device (the plugin does not describe it)";
  }

 private:
  // Why `op` is not served because the plugin's ABI minor version predates it ("" when it does
  // not). Worded as plugin.h asks for an op a plugin never serves.
  std::string predates(Op op) const {
    const uint32_t needed = abi_minor_of(op);
    if (abi_minor_ >= needed) return {};
    return "op not served: plugin ABI " + std::to_string(ATTNRT_PLUGIN_ABI_MAJOR) + "." +
           std::to_string(abi_minor_) + " predates " + op_name(op) + " (" +
           std::to_string(ATTNRT_PLUGIN_ABI_MAJOR) + "." + std::to_string(needed) + ")";
  }
  [[noreturn]] void fail(int32_t status, const char* what, const Problem& p) const {
    std::string msg = std::string(what) + " failed: " + lib_->error();
    if (status == ATTNRT_UNAVAILABLE) throw BackendUnavailable(name_, op_name(p.op), p.device.str(), msg);
    // A plugin that reports invalid input for input the Runtime validated, or an internal
    // failure, cannot serve this call: treat both as unavailable so the user still gets a
    // result, and say which it was.
    throw BackendUnavailable(name_, op_name(p.op), p.device.str(),
                             std::string(status == ATTNRT_INVALID ? "plugin rejected validated input: "
                                                                  : "plugin internal error: ") + msg);
  }
  void check(bool ok, const std::string& what) const {
    if (!ok) throw Error("plugin '" + name_ + "': " + what + " failed: " + lib_->error());
  }

  std::shared_ptr<PluginLibrary> lib_;
  std::string name_;
  uint32_t abi_minor_;  // the plugin's, which may be below or above the host's
  std::vector<Device> devices_;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, sep))
    if (!cur.empty()) out.push_back(cur);
  return out;
}

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool valid_name(const char* n) {
  if (!n || !*n) return false;
  for (const char* c = n; *c; ++c)
    if (!((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_')) return false;
  return true;
}

// Files of one directory that look like plugins, sorted for a stable order.
std::vector<std::string> plugin_files(const std::string& dir) {
  std::vector<std::string> files;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n.rfind("libattnrt_", 0) == 0 && n.size() > 13 && n.substr(n.size() - 3) == ".so")
        files.push_back(dir + "/" + n);
    }
    ::closedir(d);
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Loads one file; on success appends a backend. Always fills `rec`.
void load_one(const std::string& path, std::set<std::string>& taken,
              const std::set<std::string>& disabled, LoadedPlugins& out) {
  PluginLoadRecord rec;
  rec.path = path;
  rec.name = plugin_name_from_path(path);
  auto reject = [&](std::string why, bool expected = false) {
    rec.reason = std::move(why);
    rec.expected = expected;
    log(LogLevel::info, "plugin " + path + " not used: " + rec.reason);
    out.records.push_back(rec);
  };
  // dlopen of a pipe or a device blocks or reads without end: only regular files are opened.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    return reject(std::string("cannot read it: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return reject("not a regular file");
  dlerror();
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    return reject(std::string("dlopen failed: ") + (e ? e : "unknown error"));
  }
  auto lib = std::make_shared<PluginLibrary>();
  lib->handle = h;
  lib->path = path;
  dlerror();
  const auto* version = static_cast<const uint32_t*>(::dlsym(h, ATTNRT_PLUGIN_VERSION_SYMBOL));
  if (!version) {
    const char* e = dlerror();
    return reject(std::string("missing symbol ") + ATTNRT_PLUGIN_VERSION_SYMBOL + ": " +
                  (e ? e : "not found"));
  }
  if ((*version >> 16) != ATTNRT_PLUGIN_ABI_MAJOR) {
    return reject("plugin ABI version " + std::to_string(*version >> 16) + "." +
                  std::to_string(*version & 0xffff) + ", host needs major " +
                  std::to_string(ATTNRT_PLUGIN_ABI_MAJOR));
  }
  dlerror();
  auto get = reinterpret_cast<attnrt_plugin_get_fn>(::dlsym(h, ATTNRT_PLUGIN_ENTRY_SYMBOL));
  if (!get) {
    const char* e = dlerror();
    return reject(std::string("missing symbol ") + ATTNRT_PLUGIN_ENTRY_SYMBOL + ": " +
                  (e ? e : "not found"));
  }
  const attnrt_plugin_v1* t = get();
  if (!t) return reject(std::string(ATTNRT_PLUGIN_ENTRY_SYMBOL) + "() returned NULL");
  if (t->abi_version != *version)
    return reject("table abi_version " + std::to_string(t->abi_version) +
                  " differs from exported " + ATTNRT_PLUGIN_VERSION_SYMBOL + " " +
                  std::to_string(*version));
  // Each minor version's table ends where its last field does (plugin.h).
  const uint32_t minor = t->abi_version & 0xffffu;
  const size_t needed = minor >= 2 ? sizeof(attnrt_plugin_v1) : ATTNRT_PLUGIN_V1_1_SIZE;
  if (t->struct_size < needed)
    return reject("table struct_size " + std::to_string(t->struct_size) + " < " +
                  std::to_string(needed) + " required by ABI 1." +
                  std::to_string(std::min<uint32_t>(minor, 2)));
  if (!valid_name(t->name))
    return reject(std::string("invalid plugin name '") + (t->name ? t->name : "(null)") +
                  "' (expected non-empty [a-z0-9_]+)");
  rec.name = t->name;
  std::vector<std::string> missing;
  if (!t->init) missing.push_back("init");
  if (!t->device_count) missing.push_back("device_count");
  if (!t->probe) missing.push_back("probe");
  if (!t->plan) missing.push_back("plan");
  if (!t->run) missing.push_back("run");
  if (!t->destroy_plan) missing.push_back("destroy_plan");
  if (!t->last_error) missing.push_back("last_error");
  bool any_mem = t->mem_alloc || t->mem_free || t->copy_to_device || t->copy_to_host;
  bool all_mem = t->mem_alloc && t->mem_free && t->copy_to_device && t->copy_to_host;
  if (any_mem && !all_mem) missing.push_back("mem_alloc/mem_free/copy_to_device/copy_to_host (all or none)");
  if (!missing.empty()) {
    std::string m;
    for (const auto& s : missing) m += (m.empty() ? "" : ", ") + s;
    return reject("required entry point is null: " + m);
  }
  if (taken.count(t->name)) return reject(std::string("duplicate backend name '") + t->name + "'");
  // Checked like any other, but a disabled plugin's init (a driver, a device) never runs.
  if (disabled.count(t->name)) return reject("disabled by ATTNRT_DISABLE (not initialised)", true);
  lib->table = t;
  // UNAVAILABLE from init means its runtime, driver or hardware is absent: normal on machines
  // without that hardware, unlike any other failure.
  if (int32_t st = t->init(); st != ATTNRT_OK)
    return reject("init failed: " + lib->error(), st == ATTNRT_UNAVAILABLE);
  auto backend = std::make_unique<PluginBackend>(lib);
  taken.insert(t->name);
  rec.loaded = true;
  out.records.push_back(rec);
  out.backends.push_back(std::move(backend));
  log(LogLevel::info, "loaded plugin '" + std::string(t->name) + "' from " + path);
}

}  // namespace

std::string plugin_name_from_path(const std::string& path) {
  std::string base = path.substr(path.find_last_of('/') + 1);
  if (base.rfind("libattnrt_", 0) == 0) base = base.substr(10);
  auto dot = base.find(".so");
  if (dot != std::string::npos) base = base.substr(0, dot);
  return base;
}

std::vector<std::string> plugin_search_path(const std::string& plugin_path, bool library_dir) {
  std::vector<std::string> out = split(plugin_path, ':');
  if (library_dir) {
    Dl_info info{};
    if (::dladdr(reinterpret_cast<void*>(&plugin_search_path), &info) && info.dli_fname) {
      std::string lib = info.dli_fname;
      auto slash = lib.find_last_of('/');
      std::string dir = slash == std::string::npos ? "." : lib.substr(0, slash);
      // The static library puts attnrt inside the executable: search the executable's
      // directory and its ../lib.
      if (lib.find("libattnrt") == std::string::npos) {
        out.push_back(dir);
        out.push_back(dir + "/../lib");
      } else {
        out.push_back(dir);
      }
    }
  }
  return out;
}

LoadedPlugins load_plugins(const std::vector<std::string>& search_path,
                           std::set<std::string>& taken, const std::set<std::string>& disabled) {
  LoadedPlugins out;
  std::set<std::string> seen_files;
  for (const std::string& entry : search_path) {
    std::vector<std::string> files = is_dir(entry) ? plugin_files(entry) : std::vector<std::string>{entry};
    for (const std::string& f : files) {
      char real[4096];
      std::string key = ::realpath(f.c_str(), real) ? std::string(real) : f;
      if (!seen_files.insert(key).second) continue;  // same file via two path entries
      // A later directory holding a plugin of a name already loaded is a duplicate: it is
      // recorded, not loaded (the first on the search path wins).
      load_one(f, taken, disabled, out);
    }
  }
  return out;
}

}  // namespace attnrt
