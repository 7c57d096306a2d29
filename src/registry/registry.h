// The registry: every backend this Runtime knows (built-ins and loaded plugins), in priority
// order, and the selection options resolved from RuntimeOptions and the environment.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "attnrt/runtime.h"
#include "core/backend.h"
#include "core/cpu_dispatch.h"

namespace attnrt {

struct SelectionOptions {
  std::set<std::string> disabled;
  std::string forced;  // empty: automatic
  bool strict = false;
  bool force_replan = false;
  int num_threads = 0;
  CpuIsa cpu_isa = CpuIsa::baseline;
  bool canary = true;
  size_t plan_cache_capacity = 256;
};

class Registry {
 public:
  // Builds the built-in backends, loads plugins and resolves the options. Throws
  // InvalidArgument for unknown names in disable / force_backend (listing the known ones).
  explicit Registry(const RuntimeOptions& options);

  const SelectionOptions& options() const { return options_; }
  // Every backend, highest priority first.
  const std::vector<std::unique_ptr<Backend>>& backends() const { return backends_; }
  Backend* find(const std::string& name) const;
  // Backends that serve `device`, not disabled, in priority order; only the forced one when a
  // backend is forced. The reference backend comes last and only in automatic mode or forced.
  std::vector<Backend*> candidates(const Device& device) const;
  const std::vector<PluginLoadRecord>& plugin_records() const { return records_; }
  const std::vector<std::string>& search_path() const { return search_path_; }
  // Why a forced backend that failed to load is not there ("" if it never was a plugin file).
  std::string load_failure(const std::string& name) const;
  bool is_plugin(const Backend* b) const;

 private:
  SelectionOptions options_;
  std::vector<std::unique_ptr<Backend>> backends_;
  std::set<const Backend*> plugins_;
  std::vector<PluginLoadRecord> records_;
  std::vector<std::string> search_path_;
};

}  // namespace attnrt
