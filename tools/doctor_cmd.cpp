// `attnrt doctor`: what this machine can run and why.
//
// Prints devices, the plugin search path and every plugin file tried, each backend's probe
// answer for a representative problem of every op (built from --model, bf16, the preferred
// page size), the backend the Runtime would choose, and the ATTNRT_* variables in force.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include "attnrt/errors.h"
#include "attnrt/kv_cache.h"
#include "attnrt/model.h"
#include "attnrt/runtime.h"
#include "cli_common.h"

namespace attnrt_cli {
namespace {

using nlohmann::json;

const char* const kEnvVars[] = {"ATTNRT_PLUGIN_PATH", "ATTNRT_DISABLE",      "ATTNRT_BACKEND",
                                "ATTNRT_STRICT",      "ATTNRT_FORCE_REPLAN", "ATTNRT_NUM_THREADS",
                                "ATTNRT_CPU_ISA",     "ATTNRT_LOG",          "ATTNRT_CUDA_WGMMA"};

// A small layout (one request, prompt of a few pages) for probing the choice.
attnrt::BatchLayout probe_layout(attnrt::Op op, int page_size) {
  const int kv = 4 * page_size;
  const int q = attnrt::is_decode(op) ? 1 : kv;
  std::vector<int32_t> pages;
  for (int i = 0; i < 4; ++i) pages.push_back(i);
  return attnrt::BatchLayout::make(page_size, {q}, {kv}, {pages});
}

// The ATTNRT_* variables as set, one a line (stderr when the runtime refused them).
void print_environment(std::FILE* f) {
  for (const char* v : kEnvVars) {
    const char* val = std::getenv(v);
    std::fprintf(f, "  %s=%s\n", v, val ? val : "(unset)");
  }
}

void doctor(const std::string& model_name, bool as_json) {
  const attnrt::ModelConfig m = attnrt::resolve_model(model_name);
  std::unique_ptr<attnrt::Runtime> runtime;
  try {
    runtime = std::make_unique<attnrt::Runtime>();
  } catch (const attnrt::InvalidArgument&) {
    // A variable the runtime refuses: show the whole environment beside the error.
    std::fprintf(stderr, "attnrt doctor: the runtime refused this environment:\n");
    print_environment(stderr);
    throw;
  }
  attnrt::Runtime& rt = *runtime;
  json j;
  j["model"] = m.name;
  for (const auto& d : rt.devices()) {
    j["devices"].push_back({{"device", d.str()},
                            {"description", rt.describe_device(d)},
                            {"preferred_page_size", rt.preferred_page_size(d)}});
  }
  j["backends"] = rt.backend_names();
  for (const char* v : kEnvVars) {
    const char* val = std::getenv(v);
    if (val != nullptr) j["env"][v] = val;
  }
  if (!j.contains("env")) j["env"] = json::object();

  for (const auto& d : rt.devices()) {
    int ps = rt.preferred_page_size(d);
    if (ps <= 0) ps = m.use_sparse ? 128 : 16;
    for (int o = 0; o < attnrt::kNumOps; ++o) {
      const auto op = static_cast<attnrt::Op>(o);
      if (!m.use_sparse && !attnrt::is_dense(op)) continue;
      const attnrt::Problem p = model_problem(op, m, d, attnrt::DType::bf16, ps);
      json e;
      e["op"] = attnrt::op_name(op);
      e["device"] = d.str();
      e["problem"] = p.describe();
      for (const auto& s : rt.diagnose(p)) {
        e["backends"].push_back(
            {{"backend", s.backend}, {"available", s.available}, {"reason", s.reason}});
      }
      try {
        auto plan = rt.plan(p, probe_layout(op, ps));
        e["chosen"] = plan->backend();
      } catch (const std::exception& ex) {
        e["chosen"] = nullptr;
        e["error"] = ex.what();
      }
      j["ops"].push_back(e);
    }
  }
  const attnrt::Report r = rt.report();
  j["plugin_search_path"] = r.plugin_search_path;
  j["plugins"] = json::array();
  for (const auto& p : r.plugins) {
    j["plugins"].push_back(
        {{"path", p.path}, {"name", p.name}, {"loaded", p.loaded}, {"reason", p.reason}});
  }
  j["warnings"] = r.warnings;

  if (as_json) {
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::cout << "model: " << m.describe() << "\n\ndevices:\n";
  for (const auto& d : j["devices"]) {
    const int ps = d["preferred_page_size"].get<int>();
    std::cout << "  " << d["device"].get<std::string>() << ": "
              << d["description"].get<std::string>() << " (preferred page size "
              << (ps > 0 ? std::to_string(ps) : std::string("any")) << ")\n";
  }
  std::cout << "\nbackends (priority order):";
  for (const auto& b : j["backends"]) std::cout << " " << b.get<std::string>();
  std::cout << "\n\nplugin search path:\n";
  for (const auto& s : r.plugin_search_path) std::cout << "  " << s << "\n";
  std::cout << "plugin files tried:\n";
  if (r.plugins.empty()) std::cout << "  (none)\n";
  for (const auto& p : r.plugins) {
    std::cout << "  " << p.path << ": " << (p.loaded ? "loaded " + p.name : "not loaded: " + p.reason)
              << "\n";
  }
  std::cout << "\nops:\n";
  for (const auto& e : j["ops"]) {
    std::cout << "  " << e["op"].get<std::string>() << " on " << e["device"].get<std::string>()
              << " -> " << (e["chosen"].is_null() ? std::string("none") : e["chosen"].get<std::string>())
              << "\n";
    if (e.contains("error")) std::cout << "      error: " << e["error"].get<std::string>() << "\n";
    if (e.contains("backends")) {
      for (const auto& b : e["backends"]) {
        std::cout << "      " << b["backend"].get<std::string>() << ": "
                  << (b["available"].get<bool>() ? std::string("available")
                                                 : "unavailable: " + b["reason"].get<std::string>())
                  << "\n";
      }
    }
  }
  std::cout << "\nenvironment:\n";
  print_environment(stdout);
  for (const auto& w : r.warnings) std::cout << "warning: " << w << "\n";
}

}  // namespace

void add_doctor_command(CLI::App& app) {
  auto* sub = app.add_subcommand("doctor", "Devices, plugins, backends per op and why");
  auto model = std::make_shared<std::string>("minimax-m3-tp4");
  auto as_json = std::make_shared<bool>(false);
  sub->add_option("--model", *model, "Preset name or config.json path")->capture_default_str();
  sub->add_flag("--json", *as_json, "Print JSON");
  sub->callback([model, as_json] { doctor(*model, *as_json); });
}

}  // namespace attnrt_cli
