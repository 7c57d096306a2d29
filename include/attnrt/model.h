// Model description and per-layer attention schedule (design.md §7).
//
// A ModelConfig comes from a built-in preset or a Hugging Face style config.json. Which layers
// are sparse is decided, in this precedence, by: per-layer arrays
// (sparse_attention_config.sparse_attention_freq), first_k_dense_replace, full_attention_interval.
// A sparse model that sets none of them, or sets contradictory ones, is rejected with a message
// naming the fields.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "attnrt/problem.h"

namespace attnrt {

struct SparseConfig {
  int num_index_heads = 0;
  int index_dim = 0;
  int block_size = 0;
  int topk = 0;
  ScoreType score_type = ScoreType::max;
  int init_blocks = 0;
  int local_blocks = 0;
};

struct ModelConfig {
  std::string name;
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  bool use_sparse = false;
  SparseConfig sparse;
  std::vector<bool> layer_sparse;  // size num_layers

  int num_sparse_layers() const;
  std::string describe() const;
};

// Built-in presets: "minimax-m3", "minimax-m3-tp4", "tiny".
std::vector<std::string> preset_names();
// Throws InvalidArgument listing the presets when `name` is unknown.
ModelConfig preset(std::string_view name);
// Parses config.json text. `origin` names the source in error messages.
ModelConfig parse_model_config(std::string_view json_text, std::string_view origin = "config.json");
// Reads and parses a file.
ModelConfig load_model_config(const std::string& path);
// A preset name or a path to a config.json.
ModelConfig resolve_model(const std::string& name_or_path);

}  // namespace attnrt
