#include "attnrt/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace attnrt {
namespace {

const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::debug: return "debug";
    case LogLevel::info: return "info";
    case LogLevel::warn: return "warning";
    case LogLevel::error: return "error";
    case LogLevel::off: return "off";
  }
  return "?";
}

LogLevel level_from_env() {
  const char* e = std::getenv("ATTNRT_LOG");
  if (!e) return LogLevel::warn;
  std::string s(e);
  if (s == "debug") return LogLevel::debug;
  if (s == "info") return LogLevel::info;
  if (s == "warn" || s == "warning") return LogLevel::warn;
  if (s == "error") return LogLevel::error;
  if (s == "off" || s == "none") return LogLevel::off;
  std::fprintf(stderr, "attnrt: warning: ATTNRT_LOG='%s' is not a level "
               "(debug, info, warn, error, off); using warn\n", e);
  return LogLevel::warn;
}

struct LogState {
  std::mutex mu;
  LogSink sink;
  std::atomic<int> level{static_cast<int>(level_from_env())};
};

LogState& state() {
  static LogState s;
  return s;
}

}  // namespace

void set_log_sink(LogSink sink) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().sink = std::move(sink);
}

void set_log_level(LogLevel level) { state().level.store(static_cast<int>(level)); }

LogLevel log_level() { return static_cast<LogLevel>(state().level.load()); }

void log(LogLevel level, std::string_view message) {
  LogState& s = state();
  if (static_cast<int>(level) < s.level.load() || level == LogLevel::off) return;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.sink) {
    s.sink(level, message);
    return;
  }
  std::fprintf(stderr, "attnrt: %s: %.*s\n", level_name(level), static_cast<int>(message.size()),
               message.data());
}

}  // namespace attnrt
