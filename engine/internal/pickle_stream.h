// The export's pickle written as it goes (engine/export.h): the
// {name: tensor} archive torch.load reads, its tensors' records appended to
// the file as they come, in the dictionary's order, the pickle itself (made
// from the planned shapes alone) and the archive's directory at the end.
//
//   PickleStream out("model.pt", {{"w", at::kFloat, {4, 8}}, ...});
//   out.write(0, w);        // any order: a tensor ahead of its turn waits
//   out.finish();           // fsynced, renamed
//
// The bytes are those writing the archive at once gives (write_model_file),
// whatever order the tensors came in. Errors (a write that fails, a tensor
// of another shape or dtype than planned) are Errors naming the file; a
// stream destroyed before finish() removes its temporary file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/safetensors.h"

namespace caffe2::serialize {
class PyTorchStreamWriter;
}

namespace remat::internal {

// A file written under a temporary name beside `path`
// (runtime/output_file.h's open_temporary_beside), renamed over it by
// commit(); removed if destroyed before. Failures are Errors naming `path`.
class TemporaryFile {
 public:
  explicit TemporaryFile(std::string path);
  ~TemporaryFile();
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  void write(const void* data, size_t size);
  // fsynced, checked to be still a path a file may go to, renamed, closed.
  // Returns the bytes written.
  int64_t commit();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  int64_t written_ = 0;
};

// The pickle of a {name: tensor} dictionary of these tensors (contiguous
// CPU tensors in the planned dtype and shape), without their data: its
// records are "data/0", "data/1", ... in the plan's order.
std::string pickle_of(const std::vector<SafetensorsPlanned>& plan);

class PickleStream {
 public:
  PickleStream(const std::string& path, std::vector<SafetensorsPlanned> plan);
  ~PickleStream();
  PickleStream(const PickleStream&) = delete;
  PickleStream& operator=(const PickleStream&) = delete;

  // The plan's tensor `index` (any device, any strides; the planned dtype and
  // shape). Copied when it has to wait for its turn.
  void write(size_t index, const at::Tensor& value);
  int64_t finish();
  // The bytes of the tensors waiting for their turn now, and the most so far.
  int64_t waiting_bytes() const { return waiting_bytes_; }
  int64_t peak_waiting_bytes() const { return peak_waiting_bytes_; }

 private:
  void append(size_t index, const at::Tensor& value);
  void rethrow_failure();

  std::vector<SafetensorsPlanned> plan_;
  TemporaryFile file_;
  std::exception_ptr failed_;  // the first write into the file that failed
  bool closing_ = false;       // being destroyed: what the archive writes now is dropped
  std::unique_ptr<caffe2::serialize::PyTorchStreamWriter> writer_;  // after file_: goes first
  size_t next_ = 0;
  std::map<size_t, at::Tensor> waiting_;
  int64_t waiting_bytes_ = 0, peak_waiting_bytes_ = 0;
};

}  // namespace remat::internal
