// Model presets and config.json parsing (design.md §7).
#include "attnrt/model.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "attnrt/errors.h"

namespace attnrt {
namespace {

using nlohmann::json;

ModelConfig make_sparse_preset(std::string name, int layers, int hq, int hkv, int d, SparseConfig s,
                               int first_dense) {
  ModelConfig m;
  m.name = std::move(name);
  m.num_layers = layers;
  m.num_q_heads = hq;
  m.num_kv_heads = hkv;
  m.head_dim = d;
  m.use_sparse = true;
  m.sparse = s;
  m.layer_sparse.assign(layers, true);
  for (int l = 0; l < first_dense && l < layers; ++l) m.layer_sparse[l] = false;
  return m;
}

// Reads an integer field, throwing a message that names the origin, the field and the value.
std::optional<int64_t> get_int(const json& obj, const char* key, std::string_view origin) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return std::nullopt;
  if (it->is_boolean()) return it->get<bool>() ? 1 : 0;
  if (!it->is_number_integer() && !(it->is_number_float() && it->get<double>() == static_cast<int64_t>(it->get<double>())))
    throw InvalidArgument(std::string(origin) + ": field '" + key + "' is " + it->dump() + ", expected an integer");
  return it->is_number_integer() ? it->get<int64_t>() : static_cast<int64_t>(it->get<double>());
}

int require_positive(const json& obj, const char* key, std::string_view origin,
                     std::optional<int> fallback = std::nullopt) {
  std::optional<int64_t> v = get_int(obj, key, origin);
  if (!v) {
    if (fallback) return *fallback;
    throw InvalidArgument(std::string(origin) + ": field '" + key + "' is missing, expected a positive integer");
  }
  if (*v <= 0 || *v > (1 << 30))
    throw InvalidArgument(std::string(origin) + ": field '" + key + "' is " + std::to_string(*v) +
                          ", expected a positive integer");
  return static_cast<int>(*v);
}

std::string schedule_string(const std::vector<bool>& s) {
  std::string out;
  for (bool b : s) out += b ? 'S' : 'D';
  return out;
}

// Sparse fields are read from sparse_attention_config, or from the top level where a port
// flattened them; a field given in both places with different values is a conflict.
const json* sparse_field(const json& root, const json* sac, const char* key, std::string_view origin) {
  const json* in_sac = (sac && sac->contains(key)) ? &(*sac)[key] : nullptr;
  const json* top = root.contains(key) ? &root[key] : nullptr;
  if (in_sac && top && *in_sac != *top)
    throw InvalidArgument(std::string(origin) + ": conflicting values for '" + key +
                          "': sparse_attention_config." + key + " = " + in_sac->dump() + " but top-level " + key +
                          " = " + top->dump());
  return in_sac ? in_sac : top;
}

}  // namespace

int ModelConfig::num_sparse_layers() const {
  return static_cast<int>(std::count(layer_sparse.begin(), layer_sparse.end(), true));
}

std::string ModelConfig::describe() const {
  std::ostringstream o;
  o << name << ": " << num_layers << " layers, " << num_q_heads << " q heads, " << num_kv_heads << " kv heads, D="
    << head_dim;
  if (use_sparse) {
    o << "; sparse layers " << num_sparse_layers() << "/" << num_layers << " (index heads " << sparse.num_index_heads
      << ", index dim " << sparse.index_dim << ", block " << sparse.block_size << ", top-" << sparse.topk << ", "
      << score_type_name(sparse.score_type) << ", init " << sparse.init_blocks << ", local " << sparse.local_blocks
      << "); schedule " << schedule_string(layer_sparse);
  } else {
    o << "; all layers dense";
  }
  return o.str();
}

std::vector<std::string> preset_names() { return {"minimax-m3", "minimax-m3-tp4", "tiny"}; }

ModelConfig preset(std::string_view name) {
  const SparseConfig m3{4, 128, 128, 16, ScoreType::max, 0, 1};
  if (name == "minimax-m3") return make_sparse_preset("minimax-m3", 60, 64, 4, 128, m3, 3);
  if (name == "minimax-m3-tp4") {
    SparseConfig s = m3;
    s.num_index_heads = 1;
    return make_sparse_preset("minimax-m3-tp4", 60, 16, 1, 128, s, 3);
  }
  if (name == "tiny") {
    // Small enough for a checked run in seconds; GQA 4:1, two index heads (union reduction),
    // both forced-block kinds, one dense layer.
    const SparseConfig s{2, 32, 16, 4, ScoreType::max, 1, 1};
    return make_sparse_preset("tiny", 4, 8, 2, 64, s, 1);
  }
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw InvalidArgument("model: unknown preset '" + std::string(name) + "', expected one of: " + known +
                        " (or a path to a config.json)");
}

ModelConfig parse_model_config(std::string_view json_text, std::string_view origin) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    throw InvalidArgument(std::string(origin) + ": not valid JSON: " + e.what());
  }
  if (!root.is_object()) throw InvalidArgument(std::string(origin) + ": expected a JSON object at the top level");

  ModelConfig m;
  if (root.contains("_name_or_path") && root["_name_or_path"].is_string())
    m.name = root["_name_or_path"].get<std::string>();
  else if (root.contains("model_type") && root["model_type"].is_string())
    m.name = root["model_type"].get<std::string>();
  else
    m.name = std::string(origin);
  m.num_layers = require_positive(root, "num_hidden_layers", origin);
  m.num_q_heads = require_positive(root, "num_attention_heads", origin);
  m.num_kv_heads = require_positive(root, "num_key_value_heads", origin, m.num_q_heads);
  std::optional<int> d_from_hidden;
  if (auto hs = get_int(root, "hidden_size", origin); hs && *hs > 0 && *hs % m.num_q_heads == 0)
    d_from_hidden = static_cast<int>(*hs / m.num_q_heads);
  m.head_dim = require_positive(root, "head_dim", origin, d_from_hidden);
  if (m.num_q_heads % m.num_kv_heads != 0)
    throw InvalidArgument(std::string(origin) + ": num_attention_heads " + std::to_string(m.num_q_heads) +
                          " is not a multiple of num_key_value_heads " + std::to_string(m.num_kv_heads));

  const json* sac = nullptr;
  if (root.contains("sparse_attention_config")) {
    sac = &root["sparse_attention_config"];
    if (!sac->is_object())
      throw InvalidArgument(std::string(origin) + ": field 'sparse_attention_config' is " + sac->dump() +
                            ", expected an object");
  }
  const json* use = sparse_field(root, sac, "use_sparse_attention", origin);
  if (use && !use->is_boolean())
    throw InvalidArgument(std::string(origin) + ": field 'use_sparse_attention' is " + use->dump() +
                          ", expected true or false");
  m.use_sparse = use ? use->get<bool>() : (sac != nullptr);
  m.layer_sparse.assign(m.num_layers, false);
  if (!m.use_sparse) return m;

  // Sparse parameters, read through one merged object so every message names the field.
  json sp = json::object();
  for (const char* k : {"sparse_num_index_heads", "sparse_index_dim", "sparse_block_size", "sparse_topk_blocks",
                        "sparse_score_type", "sparse_init_block", "sparse_local_block", "sparse_init_tokens",
                        "sparse_local_tokens", "sparse_attention_freq"}) {
    if (const json* f = sparse_field(root, sac, k, origin)) sp[k] = *f;
  }
  SparseConfig& s = m.sparse;
  s.num_index_heads = require_positive(sp, "sparse_num_index_heads", origin);
  s.index_dim = require_positive(sp, "sparse_index_dim", origin);
  s.block_size = require_positive(sp, "sparse_block_size", origin);
  s.topk = require_positive(sp, "sparse_topk_blocks", origin);
  if (sp.contains("sparse_score_type")) {
    const json& st = sp["sparse_score_type"];
    if (st == "max")
      s.score_type = ScoreType::max;
    else if (st == "lse")
      s.score_type = ScoreType::lse;
    else
      throw InvalidArgument(std::string(origin) + ": field 'sparse_score_type' is " + st.dump() +
                            ", expected \"max\" or \"lse\"");
  }
  auto nonneg = [&](const char* key) -> std::optional<int> {
    auto v = get_int(sp, key, origin);
    if (!v) return std::nullopt;
    if (*v < 0 || *v > (1 << 30))
      throw InvalidArgument(std::string(origin) + ": field '" + key + "' is " + std::to_string(*v) +
                            ", expected an integer >= 0");
    return static_cast<int>(*v);
  };
  const int B = s.block_size;
  // Block counts win; token counts are the fallback (spec §1).
  if (auto v = nonneg("sparse_init_block"))
    s.init_blocks = *v;
  else if (auto t = nonneg("sparse_init_tokens"))
    s.init_blocks = (*t + B - 1) / B;
  else
    s.init_blocks = 0;
  if (auto v = nonneg("sparse_local_block"))
    s.local_blocks = *v;
  else if (auto t = nonneg("sparse_local_tokens"))
    s.local_blocks = (*t + B - 1) / B + 1;
  else
    s.local_blocks = 1;
  if (s.init_blocks + s.local_blocks > s.topk)
    throw InvalidArgument(std::string(origin) + ": sparse_init_block " + std::to_string(s.init_blocks) +
                          " + sparse_local_block " + std::to_string(s.local_blocks) +
                          " exceeds sparse_topk_blocks " + std::to_string(s.topk));
  if (s.num_index_heads % m.num_kv_heads != 0)
    throw InvalidArgument(std::string(origin) + ": sparse_num_index_heads " + std::to_string(s.num_index_heads) +
                          " is not a multiple of num_key_value_heads " + std::to_string(m.num_kv_heads));

  // The schedule: each form that is present gives one answer; they must agree, and the
  // highest-precedence one is used.
  struct Source {
    std::string field;
    std::vector<bool> schedule;
  };
  std::vector<Source> sources;
  if (sp.contains("sparse_attention_freq")) {
    const json& f = sp["sparse_attention_freq"];
    if (!f.is_array())
      throw InvalidArgument(std::string(origin) + ": field 'sparse_attention_freq' is " + f.dump() +
                            ", expected an array of 0/1 per layer");
    if (static_cast<int>(f.size()) != m.num_layers)
      throw InvalidArgument(std::string(origin) + ": field 'sparse_attention_freq' has " + std::to_string(f.size()) +
                            " entries, expected num_hidden_layers = " + std::to_string(m.num_layers));
    std::vector<bool> sched(m.num_layers);
    for (int l = 0; l < m.num_layers; ++l) {
      const json& e = f[l];
      if (!(e == 0 || e == 1 || e.is_boolean()))
        throw InvalidArgument(std::string(origin) + ": sparse_attention_freq[" + std::to_string(l) + "] is " +
                              e.dump() + ", expected 0 or 1");
      sched[l] = e.is_boolean() ? e.get<bool>() : e.get<int>() == 1;
    }
    sources.push_back({"sparse_attention_freq", sched});
  }
  if (auto k = get_int(root, "first_k_dense_replace", origin)) {
    if (*k < 0 || *k > m.num_layers)
      throw InvalidArgument(std::string(origin) + ": field 'first_k_dense_replace' is " + std::to_string(*k) +
                            ", expected 0.." + std::to_string(m.num_layers));
    std::vector<bool> sched(m.num_layers);
    for (int l = 0; l < m.num_layers; ++l) sched[l] = l >= *k;
    sources.push_back({"first_k_dense_replace", sched});
  }
  if (auto n = get_int(root, "full_attention_interval", origin)) {
    if (*n <= 0)
      throw InvalidArgument(std::string(origin) + ": field 'full_attention_interval' is " + std::to_string(*n) +
                            ", expected a positive integer");
    // Every n-th layer (1-based) is full attention: layers n-1, 2n-1, ...
    std::vector<bool> sched(m.num_layers);
    for (int l = 0; l < m.num_layers; ++l) sched[l] = (l + 1) % *n != 0;
    sources.push_back({"full_attention_interval", sched});
  }
  if (sources.empty())
    throw InvalidArgument(std::string(origin) +
                          ": sparse attention is on but no layer schedule is given; expected one of "
                          "sparse_attention_config.sparse_attention_freq, first_k_dense_replace, "
                          "full_attention_interval");
  for (size_t i = 1; i < sources.size(); ++i) {
    if (sources[i].schedule != sources[0].schedule)
      throw InvalidArgument(std::string(origin) + ": conflicting layer schedules: " + sources[0].field + " gives " +
                            schedule_string(sources[0].schedule) + " but " + sources[i].field + " gives " +
                            schedule_string(sources[i].schedule) + " (D = dense, S = sparse)");
  }
  m.layer_sparse = sources[0].schedule;
  return m;
}

ModelConfig load_model_config(const std::string& path) {
  // A pipe or a device would block or never end: only a regular file of config size is read.
  constexpr std::uintmax_t kMaxConfigBytes = 16u << 20;
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec) throw InvalidArgument("model: cannot open '" + path + "': " + ec.message());
  if (!std::filesystem::is_regular_file(status))
    throw InvalidArgument("model: '" + path + "' is not a regular file (expected a config.json)");
  const std::uintmax_t bytes = std::filesystem::file_size(path, ec);
  if (!ec && bytes > kMaxConfigBytes)
    throw InvalidArgument("model: '" + path + "' has " + std::to_string(bytes) +
                          " bytes (expected a config.json of at most 16 MiB)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument("model: cannot open '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_model_config(ss.str(), path);
}

ModelConfig resolve_model(const std::string& name_or_path) {
  for (const auto& n : preset_names())
    if (n == name_or_path) return preset(n);
  std::error_code ec;
  if (std::filesystem::is_directory(name_or_path, ec))
    return load_model_config((std::filesystem::path(name_or_path) / "config.json").string());
  if (std::filesystem::exists(name_or_path, ec)) return load_model_config(name_or_path);
  return preset(name_or_path);  // throws, listing the presets
}

}  // namespace attnrt
