#include "runtime/env_knobs.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "runtime/error.h"

namespace remat::knobs {
namespace {

bool all_digits(const std::string& s, size_t from, size_t to) {
  return std::all_of(s.begin() + static_cast<std::ptrdiff_t>(from), s.begin() + static_cast<std::ptrdiff_t>(to),
                     [](unsigned char c) { return c >= '0' && c <= '9'; });
}

[[noreturn]] void refuse(const char* name, const std::string& value, const NumberRule& rule, bool spelled_badly) {
  throw ConfigError(str(name, "='", value, "' is not ", rule.expected,
                        spelled_badly ? " (write it in plain decimal digits: no spaces, sign, hex or exponent)" : "",
                        ": ", rule.advice));
}

// `name`'s whole number within [min, max], or nullopt when it is unset or empty.
std::optional<int64_t> optional_whole(const char* name, int64_t min, int64_t max, const NumberRule& rule) {
  auto value = get(name);
  if (!value) return std::nullopt;
  return parse_whole(name, *value, min, max, rule);
}

}  // namespace

std::optional<std::string> get(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

int64_t parse_whole(const char* name, const std::string& value, int64_t min, int64_t max,
                    const NumberRule& rule) {
  if (value.empty() || !all_digits(value, 0, value.size())) refuse(name, value, rule, true);
  int64_t n = 0;
  for (char c : value) {
    const int digit = c - '0';
    if (n > (std::numeric_limits<int64_t>::max() - digit) / 10) refuse(name, value, rule, false);
    n = n * 10 + digit;
  }
  if (n < min || n > max) refuse(name, value, rule, false);
  return n;
}

double parse_decimal(const char* name, const std::string& value, double min, double max,
                     const NumberRule& rule) {
  const size_t point = value.find('.');
  const size_t whole_end = point == std::string::npos ? value.size() : point;
  const size_t digits = value.size() - (point == std::string::npos ? 0 : 1);
  const bool spelled_well = digits > 0 &&
                            all_digits(value, 0, whole_end) &&
                            (point == std::string::npos || all_digits(value, point + 1, value.size()));
  if (!spelled_well) refuse(name, value, rule, true);
  const double x = std::strtod(value.c_str(), nullptr);  // digits and a point: nothing else to read
  if (!std::isfinite(x) || x < min || x > max) refuse(name, value, rule, false);
  return x;
}

bool parse_bool(const char* name, const std::string& value) {
  std::string v = value;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw ConfigError(str(name, "='", value, "' is not a boolean: use 1 or 0 (or true/false), without spaces"));
}

bool get_bool(const char* name) {
  auto value = get(name);
  return value && parse_bool(name, *value);
}

std::chrono::milliseconds comm_timeout() {
  auto value = get(kCommTimeoutSeconds);
  if (!value) return std::chrono::seconds(300);
  // Milliseconds are what a wait counts; beyond a week a deadline would only
  // hide a hang (and 1e10 s overflowed the clock arithmetic, timing out at once).
  const double seconds =
      parse_decimal(kCommTimeoutSeconds, *value, 0.001, 604800,
                    {"a number of seconds from 0.001 (1 ms) to 604800 (7 days)",
                     "set it to how long a collective may take before the job gives up (default 300), or unset it"});
  return std::chrono::milliseconds(std::llround(seconds * 1000));
}

std::optional<std::chrono::milliseconds> fault_save_pause() {
  auto value = get(kFaultSavePauseMs);
  if (!value) return std::nullopt;
  return std::chrono::milliseconds(parse_whole(
      kFaultSavePauseMs, *value, 0, 60000,
      {"a whole number of milliseconds from 0 to 60000 (1 minute)",
       "it pauses each save for a test to interrupt, and a longer pause only stalls the save; unset it outside "
       "tests"}));
}

std::optional<int64_t> fault_save_fail() {
  return optional_whole(kFaultSaveFail, 0, 65535,
                        {"a rank, a whole number from 0 to 65535",
                         "it makes that rank's save fail, for tests; unset it outside tests"});
}

std::optional<int64_t> fault_export_rename(const char* name) {
  return optional_whole(name, 1, 1000000,
                        {"a whole number from 1 (the rename it hits)",
                         "it makes a sharded export's rename fail, for tests; unset it outside tests"});
}

std::optional<int64_t> fault_nvme_step(const char* name) {
  return optional_whole(name, 1, 1000000,
                        {"a whole number from 1 (the optimizer step it hits)",
                         "it makes offload_optimizer nvme's step fail, for tests; unset it outside tests"});
}

std::optional<int64_t> memory_per_rank_bytes() {
  return optional_whole(kMemoryPerRankBytes, 1, std::numeric_limits<int64_t>::max(),
                        {"a whole number of bytes > 0",
                         "give the bytes each rank may use, or unset it to read them from the host"});
}

std::optional<int64_t> omp_num_threads() {
  return optional_whole(kOmpNumThreads, 1, std::numeric_limits<int64_t>::max(),
                        {"a whole number of threads >= 1",
                         "give the intra-op threads each rank may run, or unset it to share the cores out"});
}

bool reduce_progress_in_hooks() {
  auto value = get(kReduceProgress);
  if (!value || *value == "hooks") return true;
  if (*value == "off") return false;
  throw ConfigError(str(kReduceProgress, "='", *value, "' is neither hooks (the default) nor off"));
}

}  // namespace remat::knobs
