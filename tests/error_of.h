// Test helper: the message of the exception of type E that `fn` throws.
//
//   EXPECT_THAT(error_of<ConfigError>([] { parse("[1]"); }), HasSubstr("top level"));
#pragma once

#include <gtest/gtest.h>

#include <string>

namespace remat::testing {

template <typename E, typename F>
std::string error_of(F fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception of the given type";
  return "";
}

}  // namespace remat::testing
