#include "parallel/internal/nvme_optimizer_store.h"

#include <ATen/ATen.h>
#include <signal.h>
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
  REMAT_CHECK(options_.sub_group_size >= 1, "NvmeOptimizerStore: sub_group_size ", options_.sub_group_size,
              " must be at least 1");
  REMAT_CHECK(options_.buffer_count >= 2, "NvmeOptimizerStore: buffer_count ", options_.buffer_count,
              " must be at least 2: one sub-group is stepped while the next is read");
  offsets_.push_back(0);
  for (int64_t n : options_.sizes) {
    REMAT_CHECK_GE(n, 0, "NvmeOptimizerStore: a tensor's elements");
    offsets_.push_back(offsets_.back() + n);
  }
  numel_ = offsets_.back();
  steps_.assign(options_.sizes.size(), 0);
  const uint64_t align = options_.io.alignment;
  uint64_t offset = 0;
  for (int64_t begin = 0; begin < numel_; begin += options_.sub_group_size) {
    Group g;
    g.begin = begin;
    g.numel = std::min(options_.sub_group_size, numel_ - begin);
    g.offset = offset;
    g.piece = round_up(static_cast<uint64_t>(g.numel) * sizeof(float), align);
    offset += 2 * g.piece;
    record_bytes_ = std::max(record_bytes_, 2 * g.piece);
    groups_.push_back(g);
  }
  // No more buffers than sub-groups: a state of one sub-group is stepped in one.
  const size_t buffers = std::max<size_t>(1, std::min<size_t>(options_.buffer_count, groups_.size()));
  for (size_t b = 0; b < buffers; ++b) buffers_.emplace_back(std::max<size_t>(record_bytes_, align), align);
  std::filesystem::create_directories(options_.folder);
  path_ = (std::filesystem::path(options_.folder) / ("rank" + std::to_string(options_.rank) + ".optimizer")).string();
  AsyncIoOptions io = options_.io;
  io.preallocate = true;  // a disk too small fails here, not in a step
  try {
    file_ = std::make_unique<AsyncFile>(path_, std::max<uint64_t>(offset, align), io);
  } catch (...) {
    ::unlink(path_.c_str());  // made, but not sized (a disk too small): the destructor will not run
    throw;
  }
}

NvmeOptimizerStore::~NvmeOptimizerStore() {
  file_.reset();  // waits for its requests
  ::unlink(path_.c_str());
}

uint64_t NvmeOptimizerStore::file_bytes() const { return file_->size(); }

float* NvmeOptimizerStore::array(size_t buffer, const Group& g, int which) const {
  return reinterpret_cast<float*>(static_cast<char*>(buffers_[buffer].data()) + which * g.piece);
}

void NvmeOptimizerStore::check_tensor(const at::Tensor& t, size_t i, const char* what) const {
  const int64_t numel = options_.sizes.at(i);
  REMAT_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.numel() == numel,
              "NvmeOptimizerStore '", path_, "': ", what, " of tensor ", i, " must be a contiguous float32 host "
              "tensor of ", numel, " elements, not ",
              t.defined() ? str(t.scalar_type(), " ", t.sizes(), " on ", t.device()) : std::string("undefined"));
}

std::pair<size_t, size_t> NvmeOptimizerStore::groups_of(size_t i) const {
  const int64_t g = options_.sub_group_size;
  if (options_.sizes.at(i) == 0) return {0, 0};
  return {static_cast<size_t>(offsets_[i] / g), static_cast<size_t>((offsets_[i + 1] - 1) / g + 1)};
}

// Sub-group k lives in buffer k % B. Before sub-group k+1 is read into its
// buffer, the write of the sub-group that buffer held (k+1-B) must be done;
// the read is then in flight while sub-group k is stepped.
void NvmeOptimizerStore::stream(size_t first, size_t last, const std::function<void(size_t, const Group&)>& body,
                                bool read, bool write_back, const char* what) const {
  REMAT_CHECK(!failed_, "NvmeOptimizerStore '", path_, "': an earlier I/O error left the file with some "
              "sub-groups stepped and others not; the optimizer state is lost: resume from the last save");
  const size_t count = buffers_.size();
  std::vector<IoRequest> reads(count), writes(count);
  size_t k = first;
  auto start_read = [&](size_t j) {
    const Group& g = groups_[j];
    writes[j % count].wait();
    reads[j % count] = file_->read(g.offset, buffers_[j % count].data(), 2 * g.piece);
  };
  try {
    if (read && first < last) start_read(first);
    for (; k < last; ++k) {
      const size_t b = k % count;
      if (read && k + 1 < last) start_read(k + 1);
      if (read) {
        reads[b].wait();
      } else {
        writes[b].wait();
      }
      body(b, groups_[k]);
      if (write_back) writes[b] = file_->write(groups_[k].offset, buffers_[b].data(), 2 * groups_[k].piece);
    }
    for (auto& w : writes) w.wait();
  } catch (const Error& e) {
    failed_ = failed_ || write_back;
    for (auto& r : reads) try { r.wait(); } catch (const Error&) {}  // NOLINT: the first error is the one said
    for (auto& w : writes) try { w.wait(); } catch (const Error&) {}  // NOLINT
    const size_t at = std::min(k, groups_.size() - 1);
    throw Error(str("NVMe optimizer state, ", what, ", sub-group ", at, " of ", groups_.size(), " (elements [",
                    groups_[at].begin, ", ", groups_[at].begin + groups_[at].numel, ")) in '", path_,
                    "': ", e.what(),
                    write_back ? "; the optimizer state on disk is no longer whole: check the disk under "
                                 "nvme_path, then resume from the last save"
                               : ""));
  }
}

void NvmeOptimizerStore::initialize() {
  failed_ = false;
  stream(0, groups_.size(), [&](size_t b, const Group& g) { std::memset(array(b, g, 0), 0, 2 * g.piece); },
         /*read=*/false, /*write_back=*/true, "initialize");
  std::fill(steps_.begin(), steps_.end(), 0);
}

void NvmeOptimizerStore::step(const std::vector<at::Tensor>& params, optim::HostAdamStep adam) {
  REMAT_CHECK(params.size() == options_.sizes.size(), "NvmeOptimizerStore '", path_, "': ", params.size(),
              " tensors to step, made for ", options_.sizes.size());
  std::vector<float*> p(params.size()), g(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    check_tensor(params[i], i, "the master");
    const at::Tensor& grad = params[i].grad();
    if (!grad.defined()) continue;
    check_tensor(grad, i, "the gradient");
    p[i] = params[i].data_ptr<float>();
    g[i] = grad.data_ptr<float>();
  }
  const AsyncIoStats before = file_->stats();
  const auto start = std::chrono::steady_clock::now();
  const int64_t taken = steps_.empty() ? 0 : *std::max_element(steps_.begin(), steps_.end());
  const std::string what = str("step ", taken + 1);
  const bool kill = options_.kill_at_step == taken + 1, fail = options_.fail_at_step == taken + 1;
  stream(0, groups_.size(), [&](size_t b, const Group& group) {
    if (fail) throw Error("EIO: input/output error (REMAT_FAULT_NVME_FAIL)");
    if (kill && group.begin > 0) ::raise(SIGKILL);  // the earlier sub-groups' writes issued, the rest not
    const int64_t end = group.begin + group.numel;
    // The tensors overlapping [group.begin, end), each stepped where it overlaps.
    size_t i = std::upper_bound(offsets_.begin(), offsets_.end(), group.begin) - offsets_.begin() - 1;
    for (; i < params.size() && offsets_[i] < end; ++i) {
      if (p[i] == nullptr) continue;
      const int64_t lo = std::max(group.begin, offsets_[i]), hi = std::min(end, offsets_[i + 1]);
      if (hi <= lo) continue;
      optim::HostAdamStep at_step = adam;
      at_step.step = steps_[i] + 1;
      const int64_t in_tensor = lo - offsets_[i], in_group = lo - group.begin;
      optim::host_adam_update(p[i] + in_tensor, g[i] + in_tensor, array(b, group, 0) + in_group,
                              array(b, group, 1) + in_group, hi - lo, at_step, kernel_);
    }
  }, /*read=*/true, /*write_back=*/true, what.c_str());
  for (size_t i = 0; i < params.size(); ++i) steps_[i] += p[i] != nullptr ? 1 : 0;
  const AsyncIoStats after = file_->stats();
  last_.bytes_read = after.bytes_read - before.bytes_read;
  last_.bytes_written = after.bytes_written - before.bytes_written;
  last_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void NvmeOptimizerStore::read_state(size_t i, at::Tensor exp_avg, at::Tensor exp_avg_sq) const {
  check_tensor(exp_avg, i, "exp_avg");
  check_tensor(exp_avg_sq, i, "exp_avg_sq");
  float* out[2] = {exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>()};
  const auto [first, last] = groups_of(i);
  stream(first, last, [&](size_t b, const Group& g) {
    const int64_t lo = std::max(g.begin, offsets_[i]), hi = std::min(g.begin + g.numel, offsets_[i + 1]);
    for (int k = 0; k < 2; ++k) {
      std::memcpy(out[k] + (lo - offsets_[i]), array(b, g, k) + (lo - g.begin), (hi - lo) * sizeof(float));
    }
  }, /*read=*/true, /*write_back=*/false, "a read of the state");
}

void NvmeOptimizerStore::write_state(size_t i, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                     int64_t step) {
  REMAT_CHECK_GE(step, 0, "NvmeOptimizerStore: a step count");
  const bool clear = step == 0 && !exp_avg.defined() && !exp_avg_sq.defined();
  const float* in[2] = {nullptr, nullptr};
  if (!clear) {
    check_tensor(exp_avg, i, "exp_avg");
    check_tensor(exp_avg_sq, i, "exp_avg_sq");
    in[0] = exp_avg.data_ptr<float>();
    in[1] = exp_avg_sq.data_ptr<float>();
  }
  const auto [first, last] = groups_of(i);
  stream(first, last, [&](size_t b, const Group& g) {
    const int64_t lo = std::max(g.begin, offsets_[i]), hi = std::min(g.begin + g.numel, offsets_[i + 1]);
    for (int k = 0; k < 2; ++k) {
      float* dst = array(b, g, k) + (lo - g.begin);
      if (clear) {
        std::memset(dst, 0, (hi - lo) * sizeof(float));
      } else {
        std::memcpy(dst, in[k] + (lo - offsets_[i]), (hi - lo) * sizeof(float));
      }
    }
  }, /*read=*/true, /*write_back=*/true, "a write of the state");
  steps_.at(i) = step;
}

}  // namespace remat::parallel::internal
