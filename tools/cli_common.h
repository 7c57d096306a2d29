// Shared pieces of the attnrt command-line program.
#pragma once

#include <stdexcept>
#include <string>

namespace CLI {
class App;
}

namespace attnrt_cli {

// Thrown by a subcommand for a failure that is not bad input (exit code 1).
class Failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void add_run_command(CLI::App& app);
void add_doctor_command(CLI::App& app);

}  // namespace attnrt_cli
