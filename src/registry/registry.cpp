#include "registry/registry.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "attnrt/errors.h"
#include "attnrt/log.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/reference/reference_backend.h"
#include "registry/plugin_backend.h"

namespace attnrt {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// An on/off variable: unset or empty is off; anything but the usual spellings is an error, since
// guessing wrong would silently turn a switch like ATTNRT_STRICT the other way.
bool env_flag(const char* name) {
  std::string v = env(name);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v.empty() || v == "0" || v == "false" || v == "off" || v == "no") return false;
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  throw InvalidArgument(std::string(name) + ": '" + env(name) +
                        "' is not on or off (expected 1, true, on, yes or 0, false, off, no)");
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, ',')) {
    cur.erase(0, cur.find_first_not_of(" \t"));
    cur.erase(cur.find_last_not_of(" \t") + 1);
    if (!cur.empty()) out.push_back(cur);
  }
  return out;
}

int parse_threads(const std::string& s) {
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end || v < 1 || v > 4096)
    throw InvalidArgument("ATTNRT_NUM_THREADS: '" + s + "' is not a thread count (expected 1..4096)");
  return static_cast<int>(v);
}

CpuIsa parse_isa(const std::string& s) {
  const std::optional<CpuIsa> isa = parse_cpu_isa(s);
  if (!isa)
    throw InvalidArgument(
        "ATTNRT_CPU_ISA: '" + s +
        "' is not a cpu kernel set (expected avx512bf16, avx512, avx2 or baseline)");
  if (!cpu_supports(*isa))
    throw InvalidArgument("ATTNRT_CPU_ISA: this CPU lacks " + s + " (the best it supports is " +
                          cpu_isa_name(supported_cpu_isa()) + ")");
  return *isa;
}

}  // namespace

Registry::Registry(const RuntimeOptions& o) {
  log_level();  // reads ATTNRT_LOG now, so that a bad value is reported when the runtime starts
  options_.strict = o.strict.value_or(env_flag("ATTNRT_STRICT"));
  options_.force_replan = o.force_replan.value_or(env_flag("ATTNRT_FORCE_REPLAN"));
  options_.canary = o.canary;
  options_.plan_cache_capacity = std::max<size_t>(1, o.plan_cache_capacity);
  if (o.num_threads) {
    if (*o.num_threads < 0)
      throw InvalidArgument("num_threads: " + std::to_string(*o.num_threads) + " (expected >= 0)");
    options_.num_threads = *o.num_threads;
  } else if (!env("ATTNRT_NUM_THREADS").empty()) {
    options_.num_threads = parse_threads(env("ATTNRT_NUM_THREADS"));
  }
  if (options_.num_threads == 0)
    options_.num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  const std::string isa = o.cpu_isa.value_or(env("ATTNRT_CPU_ISA"));
  options_.cpu_isa = isa.empty() ? best_cpu_isa() : parse_isa(isa);

  backends_.push_back(make_cpu_backend(options_.num_threads, options_.cpu_isa));
  backends_.push_back(make_reference_backend());
  std::set<std::string> taken;
  for (const auto& b : backends_) taken.insert(b->name());

  // Known before loading so that a disabled plugin is never initialised; the names are
  // checked below, once every plugin's name is known.
  const std::vector<std::string> disable =
      o.disable ? *o.disable : split_list(env("ATTNRT_DISABLE"));
  const std::set<std::string> disable_set(disable.begin(), disable.end());
  search_path_ = plugin_search_path(o.plugin_path.value_or(env("ATTNRT_PLUGIN_PATH")),
                                    o.search_library_dir);
  LoadedPlugins loaded = load_plugins(search_path_, taken, disable_set);
  records_ = std::move(loaded.records);
  for (auto& b : loaded.backends) {
    plugins_.insert(b.get());
    backends_.push_back(std::move(b));
  }
  std::stable_sort(backends_.begin(), backends_.end(),
                   [](const auto& a, const auto& b) { return a->priority() > b->priority(); });

  // Names a user may mention: every backend plus every plugin file that failed to load.
  std::set<std::string> known = taken;
  for (const auto& r : records_)
    if (!r.name.empty()) known.insert(r.name);
  auto known_list = [&] {
    std::string s;
    for (const auto& n : known) s += (s.empty() ? "" : ", ") + n;
    return s;
  };
  for (const auto& n : disable) {
    if (!known.count(n))
      throw InvalidArgument("ATTNRT_DISABLE: unknown backend '" + n + "' (known: " + known_list() + ")");
    options_.disabled.insert(n);
  }
  options_.forced = o.force_backend.value_or(env("ATTNRT_BACKEND"));
  if (!options_.forced.empty() && !known.count(options_.forced))
    throw InvalidArgument("ATTNRT_BACKEND: unknown backend '" + options_.forced +
                          "' (known: " + known_list() + ")");
  if (!options_.forced.empty() && options_.disabled.count(options_.forced))
    throw InvalidArgument("ATTNRT_BACKEND: backend '" + options_.forced +
                          "' is also listed in ATTNRT_DISABLE");
}

Backend* Registry::find(const std::string& name) const {
  for (const auto& b : backends_)
    if (b->name() == name) return b.get();
  return nullptr;
}

std::vector<Backend*> Registry::candidates(const Device& device) const {
  std::vector<Backend*> out;
  for (const auto& b : backends_) {
    if (!options_.forced.empty() && b->name() != options_.forced) continue;
    if (options_.disabled.count(b->name())) continue;
    auto devs = b->devices();
    if (std::find(devs.begin(), devs.end(), device) == devs.end()) continue;
    out.push_back(b.get());
  }
  return out;
}

std::string Registry::load_failure(const std::string& name) const {
  for (const auto& r : records_)
    if (r.name == name && !r.loaded) return r.path + ": " + r.reason;
  return {};
}

bool Registry::is_plugin(const Backend* b) const { return plugins_.count(b) > 0; }

}  // namespace attnrt
