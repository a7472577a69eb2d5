#include "checkpointing/stored_inputs.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <mutex>

#include "checkpointing/internal/host_transfer.h"
#include "checkpointing/internal/state.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/memory_trace.h"

namespace remat {

// checkpointing/internal/: the region and the state.
using internal::StoredInputChain;
using internal::StoredInputCounters;
using internal::CheckpointingState;

namespace {


int64_t bytes_of(int64_t numel, at::ScalarType dtype) {
  return numel * static_cast<int64_t>(c10::elementSize(dtype));
}

// Elements of storage from a tensor's first element to its last.
int64_t span_numel(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t span = 1;
  for (int64_t d = 0; d < t.dim(); ++d) span += (t.size(d) - 1) * t.stride(d);
  return span;
}

// Counts bytes left on the device for being small; the first time in the
// process at info level (what to change), then at debug level.
void note_left_small(StoredInputCounters& counters, const std::string& region, int64_t bytes,
                     int64_t min_bytes) {
  static std::atomic<bool> told{false};
  counters.left_small_bytes += bytes;
  if (!told.exchange(true)) {
    log().info("cpu_checkpointing: {} leaves {} bytes on the device for being under "
               "offload_min_bytes = {} (set activation_checkpointing.offload_min_bytes to 0 to "
               "offload them; further cases at debug level)",
               region, bytes, min_bytes);
  } else {
    log().debug("cpu_checkpointing: {} leaves {} bytes on the device (offload_min_bytes {})",
                region, bytes, min_bytes);
  }
}

}  // namespace

int64_t covered_bytes(const at::Tensor& t) {
  return t.defined() ? bytes_of(std::min(span_numel(t), t.numel()), t.scalar_type()) : 0;
}

// ---------------------------------------------------------------------------
// ContiguousBuffers

ContiguousBuffers::ContiguousBuffers(int64_t number_checkpoints)
    : number_checkpoints_(number_checkpoints), in_use_(number_checkpoints, false) {
  REMAT_CHECK_GE(number_checkpoints, 1, "contiguous checkpoint buffers: number_checkpoints");
}

int64_t ContiguousBuffers::acquire(const std::string& region) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t i = 0; i < number_checkpoints_; ++i) {
    if (!in_use_[i]) {
      in_use_[i] = true;
      return i;
    }
  }
  throw Error(str("contiguous_memory_optimization: region '", region, "' is checkpoint region ",
                  number_checkpoints_ + 1, " alive at once, but number_checkpoints is ",
                  number_checkpoints_, "; set activation_checkpointing.number_checkpoints to the "
                  "number of checkpointed regions per forward (and run the backward, or drop "
                  "the graph, before the next forward)"));
}

void ContiguousBuffers::release(int64_t slot, uint64_t generation) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (generation == generation_ && slot >= 0 && slot < number_checkpoints_) in_use_[slot] = false;
}

int64_t ContiguousBuffers::slots_in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::count(in_use_.begin(), in_use_.end(), true);
}

at::Tensor ContiguousBuffers::view(int64_t slot, size_t position, int64_t numel,
                                   at::ScalarType dtype, at::Device device, bool pinned,
                                   const std::string& region) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (buffers_.size() <= position) buffers_.resize(position + 1);
  Buffer& b = buffers_[position];
  const bool fits = b.storage.defined() && b.storage.scalar_type() == dtype &&
                    b.storage.device() == device && b.slot_numel >= numel;
  if (!fits) {
    // Reallocating would move the slots of live regions: only when none is
    // held besides the one asking.
    if (b.storage.defined() && std::count(in_use_.begin(), in_use_.end(), true) > 1) {
      throw Error(str("contiguous_memory_optimization: argument ", position, " of region '",
                      region, "' needs ", numel, " elements of ", c10::toString(dtype), " on ",
                      device.str(), " but its buffer's slots hold ", b.slot_numel, " of ",
                      c10::toString(b.storage.scalar_type()), " on ", b.storage.device().str(),
                      " (sized by the first region); checkpointed regions must take inputs of "
                      "one shape, or call reset_checkpoint_buffers() between shapes"));
    }
    b.slot_numel = numel;
    b.storage = at::empty({number_checkpoints_, numel},
                          at::TensorOptions().dtype(dtype).device(device).pinned_memory(pinned));
  }
  return b.storage[slot].narrow(0, 0, numel);
}

void ContiguousBuffers::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  buffers_.clear();
  std::fill(in_use_.begin(), in_use_.end(), false);
  ++generation_;
}

int64_t ContiguousBuffers::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t n = 0;
  for (const auto& b : buffers_) n += b.storage.defined() ? b.storage.nbytes() : 0;
  return n;
}

StoredInputStats stored_input_stats() {
  const StoredInputCounters& c = CheckpointingState::current().stored;
  return {c.kept_bytes.load(),     c.kept_padding_bytes.load(), c.gathered_bytes.load(),
          c.offloaded_bytes.load(), c.fetched_bytes.load(),     c.offload_copies.load(),
          c.fetch_copies.load(),   c.left_small_bytes.load()};
}

// ---------------------------------------------------------------------------
// One stored input.

struct StoredInputs::Entry {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  at::Device device{at::kCPU};
  int64_t numel = 0;
  // Whole (not partitioned): the view's strides over the span it covers.
  std::vector<int64_t> strides;
  int64_t share = 0;    // elements kept (partitioned: ceil(numel / size); else the span)
  int64_t padding = 0;  // of which zero padding
  at::Tensor kept;      // on the device: the share, or the whole tensor
  at::Tensor host;      // the host copy, once offloaded (kept is then undefined)
  std::shared_ptr<host_transfer::PendingCopy> to_host;
  // Prefetched for the recompute:
  at::Tensor fetched;  // device copy of host
  std::shared_ptr<host_transfer::PendingCopy> fetching;
  at::Tensor gathered;  // [share * size] all-gathered
  std::shared_ptr<Work> gathering;

  int64_t kept_bytes() const { return bytes_of(share, dtype); }
  // The input's shape over `flat`: a gathered or fetched copy of what was kept.
  at::Tensor shaped(const at::Tensor& flat) const {
    if (strides.empty()) return flat.reshape({-1}).narrow(0, 0, numel).view(sizes);
    return flat.as_strided(sizes, strides, flat.storage_offset());
  }
  void wait_all() {
    if (to_host) to_host->wait();
    if (fetching) fetching->wait();
    if (gathering) gathering->wait();
  }
};

void StoredInputChain::remove(StoredInputs* region) {
  regions.erase(std::remove(regions.begin(), regions.end(), region), regions.end());
  if (pending_offload == region) pending_offload = nullptr;
}

void StoredInputChain::track(std::shared_ptr<host_transfer::PendingCopy> copy, int bound) {
  if (copy->done()) return;
  in_flight.push_back(std::move(copy));
  while (static_cast<int>(in_flight.size()) > std::max(bound, 1)) {
    in_flight.front()->wait();
    in_flight.pop_front();
  }
  while (!in_flight.empty() && in_flight.front()->done()) in_flight.pop_front();
}

// ---------------------------------------------------------------------------

bool StoredInputs::stores(const at::Tensor& t, const InputStorageOptions& options) {
  if (!t.defined() || !at::isFloatingType(t.scalar_type())) return false;
  if (t.is_leaf() && t.requires_grad()) return false;  // a parameter: alive anyway
  if (options.partitioned()) return true;
  return options.offload && covered_bytes(t) >= options.offload_min_bytes;
}

std::vector<bool> StoredInputs::select(const std::vector<at::Tensor>& inputs,
                                       const InputStorageOptions& options,
                                       const std::string& region) {
  std::vector<bool> store;
  int64_t small = 0;
  for (const auto& t : inputs) {
    store.push_back(stores(t, options));
    const bool floating = t.defined() && at::isFloatingType(t.scalar_type());
    if (!store.back() && options.offload && floating && !(t.is_leaf() && t.requires_grad())) {
      small += covered_bytes(t);
    }
  }
  if (small > 0) {
    note_left_small(CheckpointingState::current().stored, region, small, options.offload_min_bytes);
  }
  return store;
}

StoredInputs::StoredInputs(const std::vector<at::Tensor>& inputs, const std::vector<bool>& store,
                           InputStorageOptions options, std::string region)
    : context_(Context::current_shared()),
      state_(&context_->get<CheckpointingState>()),
      options_(std::move(options)),
      region_(std::move(region)) {
  REMAT_CHECK_EQ(inputs.size(), store.size(), "StoredInputs: one flag per input");
  MemoryCategoryScope category(MemoryCategory::kCheckpointInputs);
  auto& chain = state_->chain;
  std::lock_guard<std::recursive_mutex> lock(chain.mutex);
  // The previous region is no longer the last: its inputs leave the device.
  if (chain.pending_offload != nullptr) chain.pending_offload->offload_now();

  const bool partitioned = options_.partitioned();
  const int size = partitioned ? options_.partition_group->size() : 1;
  const int rank = partitioned ? options_.partition_group->rank() : 0;
  auto& buffers = options_.contiguous;
  if (buffers && std::count(store.begin(), store.end(), true) > 0) {
    slot_ = buffers->acquire(region_);
    slot_generation_ = buffers->generation();
  }
  size_t position = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    entries_.emplace_back();
    if (!store[i]) continue;
    const at::Tensor& x = inputs[i];
    auto e = std::make_unique<Entry>();
    e->sizes = x.sizes().vec();
    e->dtype = x.scalar_type();
    e->device = x.device();
    e->numel = x.numel();
    if (partitioned) {
      e->share = (e->numel + size - 1) / size;
      const int64_t start = std::min<int64_t>(rank * e->share, e->numel);
      const int64_t length = std::min<int64_t>(e->share, e->numel - start);
      e->padding = e->share - length;
      at::Tensor flat = x.detach().reshape({-1});
      // Without offload the share goes straight to its contiguous slot.
      e->kept = (buffers && !options_.offload)
                    ? buffers->view(slot_, position, e->share, e->dtype, e->device, false, region_)
                    : at::empty({e->share}, x.options().requires_grad(false));
      e->kept.narrow(0, 0, length).copy_(flat.narrow(0, start, length));
      if (e->padding > 0) e->kept.narrow(0, length, e->padding).zero_();
    } else {
      // Kept as it is (an alias) until offloaded. Offloading moves the span of
      // storage the elements cover when that is no larger than the elements
      // (dense or expanded views, which come back with their strides); a view
      // with gaps (a column, a slice of a fused projection) moves a dense copy
      // of its elements instead.
      e->kept = x.detach();
      classify_memory(x, MemoryCategory::kCheckpointInputs);
      const int64_t span = span_numel(x);
      if (span <= e->numel) {
        e->share = span;
        e->strides = x.strides().vec();
      } else {
        e->share = e->numel;
      }
    }
    state_->stored.kept_bytes += e->kept_bytes();
    state_->stored.kept_padding_bytes += bytes_of(e->padding, e->dtype);
    entries_.back() = std::move(e);
    ++position;
  }
  chain.regions.push_back(this);
  if (options_.offload) {
    if (options_.offload_keep_last) {
      chain.pending_offload = this;
      offload_pending_ = true;
    } else {
      offload_now();
    }
  }
}

StoredInputs::~StoredInputs() {
  try {
    release();
  } catch (...) {
    // A failed copy or collective was already reported by whoever waited first.
  }
}

void StoredInputs::offload_now() {
  auto& chain = state_->chain;
  offload_pending_ = false;
  if (chain.pending_offload == this) chain.pending_offload = nullptr;
  size_t position = 0;
  for (auto& e : entries_) {
    if (!e) continue;
    const size_t pos = position++;
    if (!e->kept.defined() || e->share == 0) continue;
    if (e->kept_bytes() < options_.offload_min_bytes) {
      note_left_small(state_->stored, region_, e->kept_bytes(), options_.offload_min_bytes);
      continue;
    }
    at::Tensor flat = e->strides.empty()
                          ? e->kept.reshape({-1})
                          : e->kept.as_strided({e->share}, {1}, e->kept.storage_offset());
    MemoryCategoryScope host(MemoryCategory::kHostCopies);
    e->host = options_.contiguous
                  ? options_.contiguous->view(slot_, pos, e->share, e->dtype, at::kCPU,
                                              host_transfer::wants_pinned(e->device), region_)
                  : host_transfer::empty_host_like(flat);
    e->to_host = host_transfer::copy_to_host(flat, e->host);
    chain.track(e->to_host, options_.offload_max_in_flight);
    e->kept = at::Tensor();  // the device copy is freed once the copy is done
    state_->stored.offloaded_bytes += static_cast<int64_t>(e->host.nbytes());
    state_->stored.offload_copies++;
  }
}

void StoredInputs::prefetch() {
  if (prefetched_ || released_) return;
  prefetched_ = true;
  MemoryCategoryScope category(MemoryCategory::kCheckpointInputs);
  for (auto& e : entries_) {
    if (!e) continue;
    at::Tensor source = e->kept;
    if (!source.defined()) {
      // Offloaded: bring the host copy back (after its own copy out ended).
      if (e->to_host) e->to_host->order_before_use();
      e->fetched = at::empty({e->share}, at::TensorOptions().dtype(e->dtype).device(e->device));
      e->fetching = host_transfer::copy_to_device(e->host, e->fetched);
      state_->stored.fetched_bytes += static_cast<int64_t>(e->fetched.nbytes());
      state_->stored.fetch_copies++;
      source = e->fetched;
    }
    if (options_.partitioned()) {
      if (e->fetching) e->fetching->order_before_use();
      auto& group = options_.partition_group;
      e->gathered = at::empty({e->share * group->size()}, source.options());
      e->gathering = group->allGather(e->gathered, source);
      state_->stored.gathered_bytes += static_cast<int64_t>(e->gathered.nbytes());
    }
  }
}

std::vector<at::Tensor> StoredInputs::restore() {
  if (released_) {
    throw Error(str(region_, ": its stored inputs were released after an earlier backward; pass "
                    "retain_graph=true to the first backward() to backpropagate twice"));
  }
  {
    auto& chain = state_->chain;
    std::lock_guard<std::recursive_mutex> lock(chain.mutex);
    // The last region's inputs never left the device.
    if (chain.pending_offload == this) chain.pending_offload = nullptr;
    offload_pending_ = false;
    prefetch();
    // Start the region recomputed next (the one before this in forward order).
    auto it = std::find(chain.regions.begin(), chain.regions.end(), this);
    if (it != chain.regions.end() && it != chain.regions.begin()) (*(it - 1))->prefetch();
  }
  const bool partitioned = options_.partitioned();
  MemoryCategoryScope category(MemoryCategory::kCheckpointInputs);
  std::vector<at::Tensor> out(entries_.size());
  for (size_t i = 0; i < entries_.size(); ++i) {
    auto& e = entries_[i];
    if (!e) continue;
    if (e->gathering) {
      e->gathering->wait();
      out[i] = e->shaped(e->gathered);
    } else if (e->fetching) {
      e->fetching->order_before_use();
      out[i] = e->shaped(e->fetched);
    } else {
      out[i] = partitioned ? e->shaped(e->kept) : e->kept;  // whole: the alias itself
    }
    e->fetched = at::Tensor();
    e->fetching = nullptr;
    e->gathered = at::Tensor();
    e->gathering = nullptr;
  }
  prefetched_ = false;
  return out;
}

void StoredInputs::release() {
  if (released_) return;
  auto& chain = state_->chain;
  std::lock_guard<std::recursive_mutex> lock(chain.mutex);
  released_ = true;
  chain.remove(this);
  for (auto& e : entries_) {
    if (!e) continue;
    e->wait_all();  // collectives in flight finish on every rank
    state_->stored.kept_bytes -= e->kept_bytes();
    state_->stored.kept_padding_bytes -= bytes_of(e->padding, e->dtype);
    e.reset();
  }
  if (slot_ >= 0) options_.contiguous->release(slot_, slot_generation_);
  slot_ = -1;
}

std::vector<at::Tensor> StoredInputs::held_tensors() const {
  std::vector<at::Tensor> out;
  for (const auto& e : entries_) {
    if (!e) continue;
    for (const at::Tensor* t : {&e->kept, &e->host, &e->fetched, &e->gathered}) {
      if (t->defined()) out.push_back(*t);
    }
  }
  return out;
}

int64_t StoredInputs::kept_bytes() const {
  int64_t n = 0;
  for (const auto& e : entries_) n += e ? e->kept_bytes() : 0;
  return n;
}

}  // namespace remat
