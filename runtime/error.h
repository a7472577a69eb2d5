// Errors and checks.
//
// Every failure remat reports is a remat::Error (or a subclass), thrown at the
// LibTorch-facing surface. Messages say what is wrong and what to change.
//
//   REMAT_CHECK(ptr != nullptr, "buffer for ", name, " was released");
//   REMAT_CHECK_EQ(out.numel(), in.numel() * size, "allGather output");
//     -> "allGather output: expected out.numel() == in.numel() * size (6 vs 8)
//         at runtime/internal/mpi_communicator.cc:120"
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace remat {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A configuration file, a --set override or a layout that cannot work.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A collective or point-to-point operation failed or ranks disagree.
class CommError : public Error {
 public:
  using Error::Error;
};

// An operation did not finish within its timeout (a peer exited or hangs).
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

namespace internal {

template <typename... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

[[noreturn]] void throw_check_failure(const char* file, int line,
                                      const std::string& condition,
                                      const std::string& message);

}  // namespace internal

// Builds a message from any streamable pieces.
template <typename... Args>
std::string str(Args&&... args) {
  return internal::str_cat(std::forward<Args>(args)...);
}

}  // namespace remat

#define REMAT_CHECK(cond, ...)                                              \
  do {                                                                      \
    if (!(cond)) {                                                          \
      ::remat::internal::throw_check_failure(__FILE__, __LINE__, #cond,     \
          ::remat::str("", ##__VA_ARGS__));                                 \
    }                                                                       \
  } while (0)

#define REMAT_CHECK_OP_(op, a, b, ...)                                        \
  do {                                                                        \
    const auto& remat_lhs_ = (a);                                             \
    const auto& remat_rhs_ = (b);                                             \
    if (!(remat_lhs_ op remat_rhs_)) {                                        \
      ::remat::internal::throw_check_failure(                                 \
          __FILE__, __LINE__,                                                 \
          ::remat::str(#a " " #op " " #b " (", remat_lhs_, " vs ", remat_rhs_, \
                       ")"),                                                  \
          ::remat::str("", ##__VA_ARGS__));                                   \
    }                                                                         \
  } while (0)

#define REMAT_CHECK_EQ(a, b, ...) REMAT_CHECK_OP_(==, a, b, ##__VA_ARGS__)
#define REMAT_CHECK_NE(a, b, ...) REMAT_CHECK_OP_(!=, a, b, ##__VA_ARGS__)
#define REMAT_CHECK_LT(a, b, ...) REMAT_CHECK_OP_(<, a, b, ##__VA_ARGS__)
#define REMAT_CHECK_LE(a, b, ...) REMAT_CHECK_OP_(<=, a, b, ##__VA_ARGS__)
#define REMAT_CHECK_GT(a, b, ...) REMAT_CHECK_OP_(>, a, b, ##__VA_ARGS__)
#define REMAT_CHECK_GE(a, b, ...) REMAT_CHECK_OP_(>=, a, b, ##__VA_ARGS__)
