#include "runtime/env_knobs.h"

#include <algorithm>
#include <cctype>
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
  try {
    size_t used = 0;
    double seconds = std::stod(*value, &used);
    if (used == value->size() && seconds > 0) {
      return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
    }
  } catch (const std::exception&) {
  }
  throw ConfigError(str(kCommTimeoutSeconds, "='", *value,
                        "' is not a positive number of seconds"));
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

}  // namespace remat::knobs
