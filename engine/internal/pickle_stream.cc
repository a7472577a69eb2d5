#include "engine/internal/pickle_stream.h"

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <c10/core/Storage.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "runtime/error.h"
#include "runtime/output_file.h"

namespace remat::internal {
namespace {

// The folder a file path lies in ("." for a bare name).
std::string folder_of(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// A CPU tensor of `dtype` and `shape` whose storage has the size of its
// data and no memory: what the pickle records of a tensor (its storage's
// size, dtype, device, shape and strides) without the tensor.
at::Tensor placeholder(at::ScalarType dtype, const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const auto bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, c10::DataPtr(nullptr, c10::Device(c10::kCPU)),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, shape);
}

}  // namespace

TemporaryFile::TemporaryFile(std::string path) : path_(std::move(path)) {
  fd_ = open_temporary_beside(path_, tmp_);
  if (fd_ < 0) {
    throw Error(str("export file '", path_, "': cannot create a file in '", folder_of(path_), "' (",
                    std::strerror(errno), ")"));
  }
}

TemporaryFile::~TemporaryFile() {
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(tmp_.c_str());
}

void TemporaryFile::write(const void* data, size_t size) {
  const char* bytes = static_cast<const char*>(data);
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd_, bytes + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw Error(str("export file '", path_, "': writing ", size, " bytes to '", tmp_, "' failed after ",
                      written_ + static_cast<int64_t>(done), " bytes of the file (", std::strerror(errno),
                      "); the temporary file is removed"));
    }
    done += static_cast<size_t>(n);
  }
  written_ += static_cast<int64_t>(size);
}

int64_t TemporaryFile::commit() {
  if (::fsync(fd_) != 0) {
    throw Error(str("export file '", path_, "': flushing '", tmp_, "' to disk failed (", std::strerror(errno),
                    "); the temporary file is removed"));
  }
  // Checked at start too: the path may have changed since. Renamed while
  // still open (and so locked): a writer at work is never taken for a stale one.
  const std::string what = not_a_regular_file(path_);
  if (!what.empty() || ::rename(tmp_.c_str(), path_.c_str()) != 0) {
    throw Error(str("export file '", path_, "': cannot put the file there (",
                    what.empty() ? std::string(std::strerror(errno)) : "it is " + what + " now",
                    "); the temporary file is removed"));
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    throw Error(str("export file '", path_, "': closing it failed (", std::strerror(errno),
                    "); export again to be sure of its contents"));
  }
  return written_;
}

std::string pickle_of(const std::vector<SafetensorsPlanned>& plan) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& t : plan) dict.insert(t.name, placeholder(t.dtype, t.shape));
  // torch::pickle_save's format, without the type tag it adds to a typed
  // dictionary (torch.jit._pickle.restore_type_tag): Python's torch.load with
  // weights_only (the default from PyTorch 2.6 on) refuses that global, and a
  // plain {str: tensor} needs no tag.
  std::string pickled;
  torch::jit::Pickler pickler([&](const char* data, size_t size) { pickled.append(data, size); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();
  // Each tensor's storage is its own record, named by its place in the pickle.
  REMAT_CHECK(pickler.tensorData().size() == plan.size(), "the export's pickle names ", pickler.tensorData().size(),
              " storages for ", plan.size(), " tensors");
  return pickled;
}

PickleStream::PickleStream(const std::string& path, std::vector<SafetensorsPlanned> plan)
    : plan_(std::move(plan)), file_(path) {
  // The archive hands its bytes over as it makes them. A write that fails is
  // kept and raised by the call that made it; the archive is never told (it
  // would throw from its destructor), and what it writes after is dropped.
  writer_ = std::make_unique<caffe2::serialize::PyTorchStreamWriter>([this](const void* data, size_t size) {
    if (failed_ || closing_) return size;
    try {
      file_.write(data, size);
    } catch (...) {
      failed_ = std::current_exception();
    }
    return size;
  });
}

PickleStream::~PickleStream() { closing_ = true; }

void PickleStream::rethrow_failure() {
  if (failed_) std::rethrow_exception(failed_);
}

void PickleStream::write(size_t index, const at::Tensor& value) {
  REMAT_CHECK(index < plan_.size(), "PickleStream: tensor ", index, " of ", plan_.size());
  const SafetensorsPlanned& t = plan_[index];
  if (value.scalar_type() != t.dtype || value.sizes().vec() != t.shape) {
    throw Error(str("export: '", t.name, "' is ", c10::toString(value.scalar_type()), " ", value.sizes(),
                    ", planned as ", c10::toString(t.dtype), " ", at::IntArrayRef(t.shape)));
  }
  if (index < next_ || waiting_.count(index)) throw Error(str("export: '", t.name, "' written twice"));
  at::Tensor host = value.to(at::kCPU).contiguous();
  if (index != next_) {
    // Ahead of its turn: a copy of its own waits (not a view that keeps a unit alive).
    if (host.storage().is_alias_of(value.storage())) host = host.clone();
    waiting_bytes_ += static_cast<int64_t>(host.nbytes());
    peak_waiting_bytes_ = std::max(peak_waiting_bytes_, waiting_bytes_);
    waiting_.emplace(index, std::move(host));
    return;
  }
  append(index, host);
  for (auto it = waiting_.begin(); it != waiting_.end() && it->first == next_; it = waiting_.erase(it)) {
    waiting_bytes_ -= static_cast<int64_t>(it->second.nbytes());
    append(it->first, it->second);
  }
}

void PickleStream::append(size_t index, const at::Tensor& host) {
  writer_->writeRecord(str("data/", index), host.data_ptr(), host.nbytes());
  rethrow_failure();
  ++next_;
}

int64_t PickleStream::finish() {
  if (next_ != plan_.size()) {
    throw Error(str("export: ", plan_.size() - next_, " of ", plan_.size(), " tensors not written (the first: '",
                    plan_[next_].name, "')"));
  }
  const std::string pickled = pickle_of(plan_);
  writer_->writeRecord("data.pkl", pickled.data(), pickled.size());
  writer_->writeEndOfFile();
  rethrow_failure();
  return file_.commit();
}

}  // namespace remat::internal
