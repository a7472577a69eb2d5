#include "parallel/internal/nvme_optimizer_store.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "runtime/error.h"

namespace remat::parallel::internal {

namespace {

uint64_t round_up(uint64_t bytes, uint64_t alignment) { return (bytes + alignment - 1) / alignment * alignment; }

}  // namespace

NvmeOptimizerStore::NvmeOptimizerStore(NvmeStoreOptions options) : options_(std::move(options)) {
  REMAT_CHECK_GE(options_.numel, 0, "NvmeOptimizerStore: elements");
  REMAT_CHECK(options_.sub_group_size >= 1, "NvmeOptimizerStore: sub_group_size ", options_.sub_group_size,
              " must be at least 1");
  REMAT_CHECK(options_.buffer_count >= 2, "NvmeOptimizerStore: buffer_count ", options_.buffer_count,
              " must be at least 2: one sub-group is stepped while the next is read");
  const uint64_t align = options_.io.alignment;
  uint64_t offset = 0;
  for (int64_t begin = 0; begin < options_.numel; begin += options_.sub_group_size) {
    Group g;
    g.begin = begin;
    g.numel = std::min(options_.sub_group_size, options_.numel - begin);
    g.offset = offset;
    g.piece = round_up(static_cast<uint64_t>(g.numel) * sizeof(float), align);
    offset += 3 * g.piece;
    record_bytes_ = std::max(record_bytes_, 3 * g.piece);
    groups_.push_back(g);
  }
  const size_t buffers = std::min<size_t>(options_.buffer_count, std::max<size_t>(groups_.size(), 2));
  for (size_t b = 0; b < buffers; ++b) buffers_.emplace_back(std::max<size_t>(record_bytes_, align), align);
  std::filesystem::create_directories(options_.folder);
  path_ = (std::filesystem::path(options_.folder) / ("rank" + std::to_string(options_.rank) + ".optimizer")).string();
  AsyncIoOptions io = options_.io;
  io.preallocate = true;  // a disk too small fails here, not in a step
  file_ = std::make_unique<AsyncFile>(path_, std::max<uint64_t>(offset, align), io);
}

NvmeOptimizerStore::~NvmeOptimizerStore() {
  file_.reset();  // waits for its requests
  ::unlink(path_.c_str());
}

uint64_t NvmeOptimizerStore::file_bytes() const { return file_->size(); }

float* NvmeOptimizerStore::array(size_t buffer, const Group& g, int which) const {
  return reinterpret_cast<float*>(static_cast<char*>(buffers_[buffer].data()) + which * g.piece);
}

void NvmeOptimizerStore::check_host(const at::Tensor& t, const char* what) const {
  REMAT_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.numel() == options_.numel,
              "NvmeOptimizerStore '", path_, "': ", what, " must be a contiguous float32 host tensor of ",
              options_.numel, " elements, not ",
              t.defined() ? str(t.scalar_type(), " ", t.sizes(), " on ", t.device()) : std::string("undefined"));
}

// Sub-group i lives in buffer i % B. Before sub-group i+1 is read into its
// buffer, the write of the sub-group that buffer held (i+1-B) must be done;
// the read is then in flight while sub-group i is stepped.
void NvmeOptimizerStore::stream(const std::function<void(size_t, const Group&)>& body, bool read,
                                bool write_back, const char* what) {
  REMAT_CHECK(!failed_, "NvmeOptimizerStore '", path_, "': an earlier I/O error left the file with some "
              "sub-groups stepped and others not; the optimizer state is lost: resume from the last save");
  const size_t count = buffers_.size();
  std::vector<IoRequest> reads(count), writes(count);
  size_t i = 0;
  auto start_read = [&](size_t k) {
    const Group& g = groups_[k];
    writes[k % count].wait();
    reads[k % count] = file_->read(g.offset, buffers_[k % count].data(), 3 * g.piece);
  };
  try {
    if (read && !groups_.empty()) start_read(0);
    for (; i < groups_.size(); ++i) {
      const size_t b = i % count;
      if (read && i + 1 < groups_.size()) start_read(i + 1);
      if (read) {
        reads[b].wait();
      } else {
        writes[b].wait();
      }
      body(b, groups_[i]);
      if (write_back) writes[b] = file_->write(groups_[i].offset, buffers_[b].data(), 3 * groups_[i].piece);
    }
    for (auto& w : writes) w.wait();
  } catch (const Error& e) {
    failed_ = write_back;
    for (auto& r : reads) try { r.wait(); } catch (const Error&) {}  // NOLINT: the first error is the one said
    for (auto& w : writes) try { w.wait(); } catch (const Error&) {}  // NOLINT
    const size_t at = std::min(i, groups_.size() - 1);
    throw Error(str("NVMe optimizer state, ", what, ", sub-group ", at, " of ", groups_.size(), " (elements [",
                    groups_[at].begin, ", ", groups_[at].begin + groups_[at].numel, ")) in '", path_,
                    "': ", e.what()));
  }
}

void NvmeOptimizerStore::initialize(const at::Tensor& masters) {
  check_host(masters, "the masters");
  const float* src = masters.data_ptr<float>();
  failed_ = false;
  stream([&](size_t b, const Group& g) {
    std::memset(buffers_[b].data(), 0, 3 * g.piece);
    std::memcpy(array(b, g, 0), src + g.begin, g.numel * sizeof(float));
  }, /*read=*/false, /*write_back=*/true, "initialize");
  steps_ = 0;
}

void NvmeOptimizerStore::step(const at::Tensor& grads, optim::HostAdamStep adam, const UpdatedMasters& updated) {
  check_host(grads, "the gradients");
  const float* grad = grads.data_ptr<float>();
  adam.step = steps_ + 1;
  const AsyncIoStats before = file_->stats();
  const auto start = std::chrono::steady_clock::now();
  const std::string what = str("step ", adam.step);
  stream([&](size_t b, const Group& g) {
    optim::host_adam_update(array(b, g, 0), grad + g.begin, array(b, g, 1), array(b, g, 2), g.numel, adam,
                            kernel_);
    if (updated) updated(g.begin, array(b, g, 0), g.numel);
  }, /*read=*/true, /*write_back=*/true, what.c_str());
  steps_ = adam.step;
  const AsyncIoStats after = file_->stats();
  last_.bytes_read = after.bytes_read - before.bytes_read;
  last_.bytes_written = after.bytes_written - before.bytes_written;
  last_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void NvmeOptimizerStore::read(at::Tensor masters, at::Tensor exp_avg, at::Tensor exp_avg_sq) {
  check_host(masters, "the masters");
  check_host(exp_avg, "exp_avg");
  check_host(exp_avg_sq, "exp_avg_sq");
  float* out[3] = {masters.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>()};
  stream([&](size_t b, const Group& g) {
    for (int k = 0; k < 3; ++k) std::memcpy(out[k] + g.begin, array(b, g, k), g.numel * sizeof(float));
  }, /*read=*/true, /*write_back=*/false, "read");
}

}  // namespace remat::parallel::internal
