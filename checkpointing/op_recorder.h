// Records the names of the aten ops this thread runs while it is alive.
// Recorders nest: an inner one does not hide ops from an outer one.
//
//   OpRecorder rec;
//   y = torch::matmul(x, w);
//   rec.ops();  // {"aten::matmul", "aten::mm", ...}
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace remat {

class OpRecorder {
 public:
  OpRecorder();
  ~OpRecorder();
  OpRecorder(const OpRecorder&) = delete;
  OpRecorder& operator=(const OpRecorder&) = delete;

  const std::vector<std::string>& ops() const { return ops_; }
  int64_t count(const std::string& op) const;

 private:
  friend struct OpRecorderAccess;
  std::vector<std::string> ops_;
  OpRecorder* previous_;
  uint64_t handle_;
};

}  // namespace remat
