#include "runtime/logging.h"

#include <spdlog/sinks/null_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <mutex>

#include "runtime/env_knobs.h"
#include "runtime/error.h"

namespace remat {
namespace {

struct LogState {
  std::mutex mutex;
  int rank = 0;
  int world_size = 1;
  std::string prefix = "[rank 0/1]";
  std::shared_ptr<spdlog::logger> logger;
  std::shared_ptr<spdlog::logger> silent;
};

LogState& state() {
  static LogState s;
  return s;
}

}  // namespace

spdlog::level::level_enum log_level_from_env() {
  auto value = knobs::get(knobs::kLogLevel);
  if (!value) return spdlog::level::info;
  auto level = spdlog::level::from_str(*value);
  // from_str maps unknown names to "off"; only "off" itself may mean off.
  if (level == spdlog::level::off && *value != "off") {
    throw ConfigError(str(knobs::kLogLevel, "='", *value,
                          "' is not a log level: use trace, debug, info, "
                          "warn, error, critical or off"));
  }
  return level;
}

namespace {

void apply_pattern(LogState& s) {
  s.logger->set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ " + s.prefix + " %v");
}

void ensure(LogState& s) {
  if (s.logger) return;
  // Log to stderr so that a program's own output (tables, results) stays clean.
  s.logger = spdlog::stderr_color_mt("remat");
  s.logger->set_level(log_level_from_env());
  s.logger->flush_on(spdlog::level::warn);
  apply_pattern(s);
  s.silent = std::make_shared<spdlog::logger>(
      "remat-silent", std::make_shared<spdlog::sinks::null_sink_mt>());
  s.silent->set_level(spdlog::level::off);
}

}  // namespace

spdlog::logger& log() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  ensure(s);
  return *s.logger;
}

spdlog::logger& log_rank0() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  ensure(s);
  return s.rank == 0 ? *s.logger : *s.silent;
}

void set_log_rank(int rank, int world_size) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  ensure(s);
  s.rank = rank;
  s.world_size = world_size;
  s.prefix = str("[rank ", rank, "/", world_size, "]");
  apply_pattern(s);
}

void set_log_layout(int tp_rank, int tp_size, int dp_rank, int dp_size) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  ensure(s);
  s.prefix = str("[rank ", s.rank, "/", s.world_size, " tp ", tp_rank, "/",
                 tp_size, " dp ", dp_rank, "/", dp_size, "]");
  apply_pattern(s);
}

std::string log_prefix() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.prefix;
}

}  // namespace remat
