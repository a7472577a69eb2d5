#include "runtime/error.h"

namespace remat::internal {

void throw_check_failure(const char* file, int line,
                         const std::string& condition,
                         const std::string& message) {
  std::string text = message.empty() ? "" : message + ": ";
  text += "expected " + condition + " at " + file + ":" + std::to_string(line);
  throw Error(text);
}

}  // namespace remat::internal
