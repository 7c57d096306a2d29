#include <nlohmann/json.hpp>
#include <sstream>

#include "attnrt/runtime.h"

namespace attnrt {

std::string Report::to_string() const {
  std::ostringstream os;
  for (const auto& o : ops) {
    os << op_name(o.op) << " on " << o.device.str() << ": " << (o.chosen.empty() ? "-" : o.chosen)
       << " (" << o.calls << " calls";
    if (o.fallbacks) os << ", " << o.fallbacks << " fallbacks";
    if (o.degraded_runs > 0) os << ", " << o.degraded_runs << " degraded: " << o.degraded_note;
    if (o.degraded_runs < 0) os << ", degraded runs " << o.degraded_note;
    os << ")";
    for (const auto& s : o.skipped) os << "\n    skipped " << s.backend << ": " << s.reason;
    os << "\n";
  }
  for (const auto& p : plugins)
    if (!p.loaded) os << "plugin " << p.path << " not loaded: " << p.reason << "\n";
  for (const auto& w : warnings) os << "warning: " << w << "\n";
  return os.str();
}

std::string Report::to_json() const {
  nlohmann::json j;
  j["ops"] = nlohmann::json::array();
  for (const auto& o : ops) {
    nlohmann::json s = nlohmann::json::array();
    for (const auto& k : o.skipped) s.push_back({{"backend", k.backend}, {"reason", k.reason}});
    j["ops"].push_back({{"op", op_name(o.op)}, {"device", o.device.str()}, {"chosen", o.chosen},
                        {"calls", o.calls}, {"fallbacks", o.fallbacks},
                        {"degraded_runs", o.degraded_runs}, {"degraded_note", o.degraded_note},
                        {"skipped", s}});
  }
  j["plugins"] = nlohmann::json::array();
  for (const auto& p : plugins)
    j["plugins"].push_back({{"path", p.path}, {"name", p.name}, {"loaded", p.loaded}, {"reason", p.reason}});
  j["plugin_search_path"] = plugin_search_path;
  j["warnings"] = warnings;
  j["plan_cache"] = {{"hits", plan_cache_hits}, {"misses", plan_cache_misses}};
  return j.dump(2);
}

}  // namespace attnrt
