// Loading backend plugins (shared libraries speaking the C ABI of attnrt/plugin.h) and the
// Backend adapter over a loaded plugin's table.
//
// Every way a plugin can be broken (not loadable, a missing symbol, another ABI, a null
// required pointer, an empty or duplicate name, init failing) ends as a PluginLoadRecord with
// the reason and the loader's text; nothing of the plugin is used afterwards. A plugin whose init
// reports its runtime absent, or that ATTNRT_DISABLE names, is recorded as `expected`.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "attnrt/runtime.h"
#include "core/backend.h"

namespace attnrt {

struct LoadedPlugins {
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<PluginLoadRecord> records;  // every file tried, in order
};

// The directories and files searched, in order: each entry of `plugin_path` (a directory, or a
// file), then the directory holding the attnrt library when `library_dir` is true.
std::vector<std::string> plugin_search_path(const std::string& plugin_path, bool library_dir);

// Loads every libattnrt_*.so found on `search_path`. `taken` holds names already in use
// (built-in backends); loaded plugins' names are added. A plugin named in `disabled` is checked
// like any other but never initialised, and recorded as disabled.
LoadedPlugins load_plugins(const std::vector<std::string>& search_path,
                           std::set<std::string>& taken, const std::set<std::string>& disabled);

// "libattnrt_cuda.so" -> "cuda": the name a plugin file is known by before it is loaded.
std::string plugin_name_from_path(const std::string& path);

// Runs `backend` on a tiny problem with `problem`'s static parameters on problem.device and
// compares with the reference backend. Returns an empty string on success, else the reason
// ("canary mismatch (max err 0.31 > tol 0.02 in out)", or the failure it raised).
std::string run_canary(Backend& backend, const Problem& problem, Workspace& workspace);

}  // namespace attnrt
