// attnrt: command-line front end (run, doctor, bench).
//
// Exit codes: 0 success; 2 bad input (InvalidArgument, CLI parse error, bad config) with one
// line "attnrt: error: <message>"; 1 any other failure (backend unavailable in forced mode,
// --check mismatch, internal error). Every exception is caught here so the program never aborts.
#include <CLI/CLI.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <new>
#include <string>

#include "attnrt/errors.h"
#include "cli_common.h"

// Provided by tools/bench_cmd.cpp. Weak so the program still links while that file is absent.
__attribute__((weak)) void add_bench_command(CLI::App& app);

int main(int argc, char** argv) {
  CLI::App app{"attnrt: attention runtime for paged KV caches"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  app.set_version_flag("--version", "attnrt " ATTNRT_VERSION_STRING);
  try {
    attnrt_cli::add_run_command(app);
    attnrt_cli::add_doctor_command(app);
    if (&add_bench_command != nullptr) add_bench_command(app);
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // CLI11 reads an unknown first word as a missing subcommand; say which word it was.
    std::string names;
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
      names += (names.empty() ? "" : ", ") + sub->get_name();
    if (argc > 1 && argv[1][0] != '-' && app.get_subcommands().empty())
      std::fprintf(stderr, "attnrt: error: unknown subcommand '%s' (expected one of: %s)\n",
                   argv[1], names.c_str());
    else
      std::fprintf(stderr, "attnrt: error: %s\n", e.what());
    return 2;
  } catch (const attnrt::InvalidArgument& e) {
    std::fprintf(stderr, "attnrt: error: %s\n", e.what());
    return 2;
  } catch (const attnrt::BackendUnavailable& e) {
    std::fprintf(stderr, "attnrt: error: backend %s unavailable for %s on %s: %s\n",
                 e.backend().c_str(), e.op().c_str(), e.device().c_str(), e.reason().c_str());
    return 1;
  } catch (const std::bad_alloc&) {
    if (app.got_subcommand("bench"))
      std::fprintf(stderr, "attnrt: error: out of memory: the buffers of this case do not fit; "
                           "reduce --batch or --kv-len\n");
    else
      std::fprintf(stderr, "attnrt: error: out of memory: the caches and activations of this run "
                           "do not fit; reduce --batch, --prompt-len or --layers\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attnrt: error: %s\n", e.what());
    return 1;
  } catch (...) {
    std::fprintf(stderr, "attnrt: error: unknown failure\n");
    return 1;
  }
  // Output that never arrived (a full disk, a closed pipe) is a failure, not a success.
  std::cout.flush();
  if (!std::cout || std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "attnrt: error: writing the output failed: %s\n", std::strerror(errno));
    return 1;
  }
  return 0;
}
