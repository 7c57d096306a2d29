// Shared pieces of the attnrt command-line program (cli_common.h).
#include "cli_common.h"

namespace attnrt_cli {

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
