// Shared pieces of the attnrt command-line program.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "attnrt/model.h"
#include "attnrt/problem.h"
#include "attnrt/types.h"

namespace CLI {
class App;
}

namespace attnrt_cli {

// Thrown by a subcommand for a failure that is not bad input (exit code 1).
class Failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Fills n values of type t at data with approximately N(0,1) numbers (a sum of four uniforms
// from a xorshift generator started at `seed`): fast enough for caches of gigabytes, never all
// zeros (zeros hide unwritten outputs), the same values for the same seed.
void fill_normal(void* data, attnrt::DType t, int64_t n, uint64_t seed);

// Makes every integer option of `cmd` read plain decimal only: CLI11 alone takes "0512" as
// octal, "0x10" as hex and an empty value as 0. Call once its options are added.
void read_integers_as_decimal(CLI::App& cmd);

// The problem of `op` in model `m` on `dev`: the model's heads and dims, and on sparse ops its
// sparse parameters (the forced blocks where the op reads the index inputs).
attnrt::Problem model_problem(attnrt::Op op, const attnrt::ModelConfig& m, const attnrt::Device& dev,
                              attnrt::DType dt, int page_size);

void add_run_command(CLI::App& app);
void add_doctor_command(CLI::App& app);

}  // namespace attnrt_cli
