// Model presets and config.json schedules (design.md §7): each of the three schedule forms,
// their precedence, conflicts, token-count fallbacks and field errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "support.h"

namespace attnrt {
namespace {

using ::testing::HasSubstr;

std::vector<bool> schedule(std::initializer_list<int> s) {
  std::vector<bool> v;
  for (int x : s) v.push_back(x != 0);
  return v;
}

// A sparse config of `layers` layers; `extra` is spliced into the top-level object.
std::string sparse_json(int layers, const std::string& extra, const std::string& sac_extra = "") {
  return "{\"num_hidden_layers\": " + std::to_string(layers) +
         ", \"num_attention_heads\": 8, \"num_key_value_heads\": 2, \"head_dim\": 64, "
         "\"sparse_attention_config\": {\"use_sparse_attention\": true, \"sparse_num_index_heads\": 2, "
         "\"sparse_index_dim\": 32, \"sparse_block_size\": 64, \"sparse_topk_blocks\": 8" +
         sac_extra + "}" + extra + "}";
}

std::string error_of(const std::string& json) {
  try {
    parse_model_config(json, "cfg.json");
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Model, PresetsHaveTheDocumentedShapes) {
  const ModelConfig m3 = preset("minimax-m3");
  EXPECT_EQ(m3.num_layers, 60);
  EXPECT_EQ(m3.num_q_heads, 64);
  EXPECT_EQ(m3.num_kv_heads, 4);
  EXPECT_EQ(m3.head_dim, 128);
  EXPECT_TRUE(m3.use_sparse);
  EXPECT_EQ(m3.sparse.num_index_heads, 4);
  EXPECT_EQ(m3.sparse.index_dim, 128);
  EXPECT_EQ(m3.sparse.block_size, 128);
  EXPECT_EQ(m3.sparse.topk, 16);
  EXPECT_EQ(m3.sparse.score_type, ScoreType::max);
  EXPECT_EQ(m3.sparse.init_blocks, 0);
  EXPECT_EQ(m3.sparse.local_blocks, 1);
  ASSERT_EQ(m3.layer_sparse.size(), 60u);
  for (int l = 0; l < 60; ++l) EXPECT_EQ(m3.layer_sparse[l], l >= 3) << l;
  EXPECT_EQ(m3.num_sparse_layers(), 57);

  const ModelConfig tp4 = preset("minimax-m3-tp4");
  EXPECT_EQ(tp4.num_q_heads, 16);
  EXPECT_EQ(tp4.num_kv_heads, 1);
  EXPECT_EQ(tp4.sparse.num_index_heads, 1);
  EXPECT_EQ(tp4.layer_sparse, m3.layer_sparse);

  const ModelConfig tiny = preset("tiny");
  EXPECT_TRUE(tiny.use_sparse);
  EXPECT_LT(tiny.num_layers, 10);
  EXPECT_EQ(tiny.sparse.num_index_heads % tiny.num_kv_heads, 0);
  EXPECT_THAT(tiny.describe(), HasSubstr("tiny"));
  EXPECT_THAT(m3.describe(), HasSubstr("DDDSSS"));
}

TEST(Model, UnknownPresetListsTheKnownOnes) {
  try {
    resolve_model("no-such-model");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("no-such-model"));
    for (const auto& n : preset_names()) EXPECT_THAT(e.what(), HasSubstr(n));
  }
}

TEST(Model, PerLayerArray) {
  const ModelConfig m = parse_model_config(sparse_json(4, "", ", \"sparse_attention_freq\": [0, 1, 0, 1]"));
  EXPECT_EQ(m.layer_sparse, schedule({0, 1, 0, 1}));
  EXPECT_EQ(m.sparse.init_blocks, 0);
  EXPECT_EQ(m.sparse.local_blocks, 1);
}

TEST(Model, FirstKDenseReplace) {
  const ModelConfig m = parse_model_config(sparse_json(5, ", \"first_k_dense_replace\": 2"));
  EXPECT_EQ(m.layer_sparse, schedule({0, 0, 1, 1, 1}));
}

TEST(Model, FullAttentionInterval) {
  const ModelConfig m = parse_model_config(sparse_json(8, ", \"full_attention_interval\": 4"));
  EXPECT_EQ(m.layer_sparse, schedule({1, 1, 1, 0, 1, 1, 1, 0}));
}

TEST(Model, AgreeingFormsAreAccepted) {
  const ModelConfig m = parse_model_config(
      sparse_json(4, ", \"first_k_dense_replace\": 1", ", \"sparse_attention_freq\": [0, 1, 1, 1]"));
  EXPECT_EQ(m.layer_sparse, schedule({0, 1, 1, 1}));
}

TEST(Model, ConflictingFormsNameBothFields) {
  const std::string e =
      error_of(sparse_json(4, ", \"first_k_dense_replace\": 2", ", \"sparse_attention_freq\": [0, 1, 1, 1]"));
  EXPECT_THAT(e, HasSubstr("conflicting"));
  EXPECT_THAT(e, HasSubstr("sparse_attention_freq"));
  EXPECT_THAT(e, HasSubstr("first_k_dense_replace"));
  const std::string e2 = error_of(sparse_json(4, ", \"first_k_dense_replace\": 1, \"full_attention_interval\": 2"));
  EXPECT_THAT(e2, HasSubstr("first_k_dense_replace"));
  EXPECT_THAT(e2, HasSubstr("full_attention_interval"));
}

TEST(Model, SparseModelWithoutScheduleIsRejected) {
  const std::string e = error_of(sparse_json(4, ""));
  EXPECT_THAT(e, HasSubstr("no layer schedule"));
  EXPECT_THAT(e, HasSubstr("sparse_attention_freq"));
}

TEST(Model, TopLevelFieldsAndConflictsWithTheSparseObject) {
  // A flattened port: the sparse fields at the top level.
  const ModelConfig m = parse_model_config(
      "{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 256, \"use_sparse_attention\": true,"
      " \"sparse_num_index_heads\": 4, \"sparse_index_dim\": 16, \"sparse_block_size\": 32,"
      " \"sparse_topk_blocks\": 4, \"sparse_score_type\": \"lse\", \"sparse_attention_freq\": [1, 1]}");
  EXPECT_EQ(m.num_kv_heads, 4);  // defaults to the q heads
  EXPECT_EQ(m.head_dim, 64);     // hidden_size / heads
  EXPECT_EQ(m.sparse.score_type, ScoreType::lse);
  EXPECT_EQ(m.layer_sparse, schedule({1, 1}));
  const std::string e = error_of(sparse_json(2, ", \"sparse_topk_blocks\": 4, \"first_k_dense_replace\": 1"));
  EXPECT_THAT(e, HasSubstr("conflicting values for 'sparse_topk_blocks'"));
}

TEST(Model, TokenCountFallbacks) {
  // init = ceil(100/64) = 2, local = ceil(65/64) + 1 = 3.
  const ModelConfig m = parse_model_config(sparse_json(
      2, ", \"first_k_dense_replace\": 0", ", \"sparse_init_tokens\": 100, \"sparse_local_tokens\": 65"));
  EXPECT_EQ(m.sparse.init_blocks, 2);
  EXPECT_EQ(m.sparse.local_blocks, 3);
  // Block counts win over token counts.
  const ModelConfig b = parse_model_config(sparse_json(
      2, ", \"first_k_dense_replace\": 0", ", \"sparse_init_tokens\": 100, \"sparse_init_block\": 0"));
  EXPECT_EQ(b.sparse.init_blocks, 0);
}

TEST(Model, FieldErrorsNameFieldAndValue) {
  EXPECT_THAT(error_of("{\"num_attention_heads\": 4}"), HasSubstr("'num_hidden_layers' is missing"));
  EXPECT_THAT(error_of("{\"num_hidden_layers\": -3, \"num_attention_heads\": 4, \"head_dim\": 8}"),
              HasSubstr("'num_hidden_layers' is -3"));
  EXPECT_THAT(error_of("{\"num_hidden_layers\": \"six\", \"num_attention_heads\": 4}"),
              HasSubstr("'num_hidden_layers' is \"six\", expected an integer"));
  EXPECT_THAT(error_of("{\"num_hidden_layers\": 2, \"num_attention_heads\": 6, \"num_key_value_heads\": 4,"
                       " \"head_dim\": 8}"),
              HasSubstr("num_attention_heads 6 is not a multiple of num_key_value_heads 4"));
  EXPECT_THAT(error_of("{not json"), HasSubstr("cfg.json: not valid JSON"));
  EXPECT_THAT(error_of("[1, 2]"), HasSubstr("expected a JSON object"));
  EXPECT_THAT(error_of(sparse_json(3, ", \"first_k_dense_replace\": 1", ", \"sparse_score_type\": \"mean\"")),
              HasSubstr("'sparse_score_type' is \"mean\""));
  EXPECT_THAT(error_of(sparse_json(3, "", ", \"sparse_attention_freq\": [0, 1]")),
              HasSubstr("has 2 entries, expected num_hidden_layers = 3"));
  EXPECT_THAT(error_of(sparse_json(2, "", ", \"sparse_attention_freq\": [0, 2]")),
              HasSubstr("sparse_attention_freq[1] is 2"));
  EXPECT_THAT(error_of(sparse_json(2, ", \"first_k_dense_replace\": 5")), HasSubstr("'first_k_dense_replace' is 5"));
  EXPECT_THAT(error_of(sparse_json(2, ", \"full_attention_interval\": 0")),
              HasSubstr("'full_attention_interval' is 0"));
  EXPECT_THAT(error_of(sparse_json(2, ", \"first_k_dense_replace\": 0",
                                   ", \"sparse_init_block\": 5, \"sparse_local_block\": 4")),
              HasSubstr("sparse_init_block 5 + sparse_local_block 4 exceeds sparse_topk_blocks 8"));
  EXPECT_THAT(error_of("{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"head_dim\": 8,"
                       " \"sparse_attention_config\": {\"use_sparse_attention\": true}, \"first_k_dense_replace\": 1}"),
              HasSubstr("'sparse_num_index_heads' is missing"));
}

TEST(Model, DenseModelIgnoresScheduleFields) {
  // first_k_dense_replace also describes MoE layers; without sparse attention it is not ours.
  const ModelConfig m = parse_model_config(
      "{\"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"head_dim\": 8, \"first_k_dense_replace\": 1}");
  EXPECT_FALSE(m.use_sparse);
  EXPECT_EQ(m.layer_sparse, schedule({0, 0, 0}));
  EXPECT_THAT(m.describe(), HasSubstr("all layers dense"));
}

TEST(Model, LoadsFromFileAndDirectory) {
  const auto dir = std::filesystem::temp_directory_path() / ("attnrt_model_" + std::to_string(test::fresh_seed()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir / "config.json");
    f << sparse_json(3, ", \"first_k_dense_replace\": 1");
  }
  EXPECT_EQ(resolve_model((dir / "config.json").string()).layer_sparse, schedule({0, 1, 1}));
  EXPECT_EQ(resolve_model(dir.string()).layer_sparse, schedule({0, 1, 1}));
  {
    std::ofstream f(dir / "bad.json");
    f << "{\"num_hidden_layers\": 0}";
  }
  try {
    resolve_model((dir / "bad.json").string());
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("bad.json"));
  }
  std::filesystem::remove_all(dir);
}

// A model path that is a pipe, a device or far too large for a config is refused by name, before
// anything reads it (a pipe would block, /dev/zero would never end).
TEST(Model, OnlyRegularFilesOfConfigSizeAreRead) {
  const auto dir = std::filesystem::temp_directory_path() / ("attnrt_model_" + std::to_string(test::fresh_seed()));
  std::filesystem::create_directories(dir);
  const std::string fifo = (dir / "pipe.json").string(), big = (dir / "big.json").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::ofstream(big).put('{');
  std::filesystem::resize_file(big, (16u << 20) + 1);  // sparse: no 16 MiB written
  const std::pair<std::string, std::string> cases[] = {
      {fifo, "is not a regular file"}, {"/dev/zero", "is not a regular file"},
      {big, "has 16777217 bytes (expected a config.json of at most 16 MiB)"}};
  for (const auto& [path, why] : cases) {
    try {
      load_model_config(path);
      ADD_FAILURE() << path << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("'" + path + "' " + why));
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace attnrt
