// Shared pieces of the attnrt command-line program (cli_common.h).
#include "cli_common.h"

#include <CLI/CLI.hpp>

#include <charconv>

namespace attnrt_cli {

namespace {
// The value as a plain decimal T, rewritten without leading zeros; else why not.
template <typename T>
std::string as_decimal(std::string& s) {
  T v{};
  const char* end = s.data() + s.size();
  const auto [p, ec] = std::from_chars(s.data(), end, v);
  if (s.empty()) return "empty value (expected a decimal integer)";
  if (ec == std::errc::result_out_of_range) return "'" + s + "' is out of range";
  if (ec != std::errc() || p != end)
    return "'" + s + "' is not a decimal integer" +
           (std::is_unsigned_v<T> && s[0] == '-' ? " >= 0" : "");
  s = std::to_string(v);
  return {};
}
}  // namespace

void read_integers_as_decimal(CLI::App& cmd) {
  for (CLI::Option* opt : cmd.get_options()) {
    const std::string type = opt->get_type_name();
    if (type == "INT") opt->transform(CLI::Validator(as_decimal<int64_t>, ""));
    if (type == "UINT") opt->transform(CLI::Validator(as_decimal<uint64_t>, ""));
  }
}

attnrt::Problem model_problem(attnrt::Op op, const attnrt::ModelConfig& m, const attnrt::Device& dev,
                              attnrt::DType dt, int page_size) {
  attnrt::Problem p;
  p.op = op;
  p.device = dev;
  p.q_dtype = p.kv_dtype = dt;
  p.page_size = page_size;
  p.num_q_heads = m.num_q_heads;
  p.num_kv_heads = m.num_kv_heads;
  p.head_dim = m.head_dim;
  if (!attnrt::is_dense(op)) {
    p.num_index_heads = m.sparse.num_index_heads;
    p.index_dim = m.sparse.index_dim;
    p.block_size = m.sparse.block_size;
    p.topk = m.sparse.topk;
    p.score_type = m.sparse.score_type;
    if (attnrt::reads_index_inputs(op)) {
      p.init_blocks = m.sparse.init_blocks;
      p.local_blocks = m.sparse.local_blocks;
    }
  }
  return p;
}

void fill_normal(void* data, attnrt::DType t, int64_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull | 1;
  for (int64_t i = 0; i < n; ++i) {
    float sum = 0;
    for (int k = 0; k < 4; ++k) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      sum += static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
    }
    attnrt::store_from_f32(data, t, i, (sum - 2.0f) * 1.7320508f);
  }
}

}  // namespace attnrt_cli
