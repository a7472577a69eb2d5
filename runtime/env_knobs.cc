#include "runtime/env_knobs.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include "runtime/error.h"

namespace remat::knobs {

std::optional<std::string> get(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

bool get_bool(const char* name) {
  auto value = get(name);
  if (!value) return false;
  std::string v = *value;
  std::transform(v.begin(), v.end(), v.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw ConfigError(str(name, "='", *value,
                        "' is not a boolean: use 1 or 0 (or true/false)"));
}

std::chrono::milliseconds comm_timeout() {
  auto value = get(kCommTimeoutSeconds);
  if (!value) return std::chrono::seconds(300);
  // Milliseconds are what a wait counts; beyond a week a deadline would only
  // hide a hang (and 1e10 s overflowed the clock arithmetic, timing out at once).
  constexpr double kMinSeconds = 0.001, kMaxSeconds = 604800;
  double seconds = std::nan("");
  try {
    size_t used = 0;
    seconds = std::stod(*value, &used);
    if (used != value->size()) seconds = std::nan("");
  } catch (const std::exception&) {  // not a number, or beyond a double: refused below
  }
  if (std::isfinite(seconds) && seconds >= kMinSeconds && seconds <= kMaxSeconds) {
    return std::chrono::milliseconds(std::llround(seconds * 1000));
  }
  throw ConfigError(str(kCommTimeoutSeconds, "='", *value,
                        "' is not a number of seconds from 0.001 (1 ms) to 604800 (7 days): set it to how long "
                        "a collective may take before the job gives up (default 300), or unset it"));
}

std::optional<std::chrono::milliseconds> fault_save_pause() {
  auto value = get(kFaultSavePauseMs);
  if (!value) return std::nullopt;
  try {
    size_t used = 0;
    const long long ms = std::stoll(*value, &used);
    if (used == value->size() && ms >= 0) return std::chrono::milliseconds(ms);
  } catch (const std::exception&) {
  }
  throw ConfigError(str(kFaultSavePauseMs, "='", *value,
                        "' is not a whole number of milliseconds >= 0 (unset it outside tests)"));
}

bool reduce_progress_in_hooks() {
  auto value = get(kReduceProgress);
  if (!value || *value == "hooks") return true;
  if (*value == "off") return false;
  throw ConfigError(str(kReduceProgress, "='", *value, "' is neither hooks (the default) nor off"));
}

}  // namespace remat::knobs
