// attnrt logging. One process-wide sink that the embedding program may replace; the default
// writes "attnrt: <level>: <message>" lines to stderr at or above the level named by ATTNRT_LOG
// (debug, info, warn, error, off; default warn).
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace attnrt {

enum class LogLevel : int { debug = 0, info = 1, warn = 2, error = 3, off = 4 };

using LogSink = std::function<void(LogLevel, std::string_view)>;

// Replaces the sink (nullptr restores the default). Thread-safe.
void set_log_sink(LogSink sink);
// Messages below `level` are dropped before reaching the sink.
void set_log_level(LogLevel level);
LogLevel log_level();
void log(LogLevel level, std::string_view message);

}  // namespace attnrt
