#include "checkpointing/offload_activations.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/modules/container/modulelist.h>

#include <any>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "checkpointing/internal/host_transfer.h"
#include "nn/module_call.h"
#include "nn/saved_tensors_hooks.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/memory_trace.h"

namespace remat {
struct Packed;

// Activation offloading's share of a context's state (runtime/context.h).
struct ActivationOffloadCounters {
  std::atomic<int64_t> offloaded_tensors{0}, offloaded_bytes{0}, restored_tensors{0},
      restored_bytes{0}, kept_tensors{0}, kept_bytes{0}, host_bytes{0};
};

namespace {


// Parameters, and views of them, stay where they are (alive anyway): leaves
// that require grad, views of such leaves, and tensors on the storage of the
// model's parameters and buffers (frozen weights included).
bool is_parameter(const at::Tensor& t, const std::unordered_set<const c10::StorageImpl*>& model) {
  if (t.has_storage() && model.count(t.storage().unsafeGetStorageImpl())) return true;
  if (t.is_leaf() && t.requires_grad()) return true;
  if (t.is_view()) {
    const at::TensorBase& base = t._base();
    return base.defined() && base.is_leaf() && base.requires_grad();
  }
  return false;
}

// Host memory for a copy of `t`: pinned for GPU tensors (use_pin_memory), and
// for CPU tensors an arena outside c10's allocator (so the memory accounting
// counts only what stays on the "device"). Keeps t's strides when they are
// dense, else dense row-major.
at::Tensor host_buffer(const at::Tensor& t, bool pinned) {
  const bool dense = t.is_non_overlapping_and_dense();
  if (t.is_cuda()) {
    MemoryCategoryScope host(MemoryCategory::kHostCopies);
    auto options = at::TensorOptions().dtype(t.scalar_type()).device(at::kCPU).pinned_memory(pinned);
    return dense ? at::empty_strided(t.sizes(), t.strides(), options) : at::empty(t.sizes(), options);
  }
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  void* data = std::malloc(bytes == 0 ? 1 : bytes);
  if (data == nullptr) {
    throw Error(str("activation offloading: could not allocate ", bytes, " bytes of host memory"));
  }
  auto options = at::TensorOptions().dtype(t.scalar_type()).device(at::kCPU);
  auto free_it = [](void* p) { std::free(p); };
  return dense ? at::from_blob(data, t.sizes(), t.strides(), free_it, options)
               : at::from_blob(data, t.sizes(), free_it, options);
}

}  // namespace

// One saved tensor: what pack returned.
struct Packed {
  std::shared_ptr<OffloadActivations::State> state;
  size_t id = 0;
  at::Tensor kept;  // left on the device
  bool counted_kept = false;  // kept for being small (a parameter is not counted)
  bool counted_host = false;  // host_bytes includes this copy
  int unpacks = 0;            // backwards that brought it back
  at::Tensor host;  // the offloaded copy
  std::shared_ptr<host_transfer::PendingCopy> to_host;
  at::Tensor fetched;  // brought back ahead (GPU prefetch)
  std::shared_ptr<host_transfer::PendingCopy> to_device;
  at::Device device{at::kCPU};
  int64_t bytes = 0;
  c10::VariableVersion version{c10::VariableVersion::DISABLED};
  uint32_t saved_version = 0;
  std::string describe;

  ~Packed();
};

struct OffloadActivations::State {
  // The context current when the scope began: its saved tensors count there,
  // also when backward unpacks them on another thread or after the scope.
  std::shared_ptr<Context> context = Context::current_shared();
  ActivationOffloadCounters& counters = context->get<ActivationOffloadCounters>();
  OffloadActivationsOptions options;
  std::mutex mutex;
  std::vector<std::weak_ptr<Packed>> order;  // offloaded tensors, forward order
  std::unordered_set<const c10::StorageImpl*> model_storages;  // never offloaded
  // Set once the output head has run in this scope: what follows (the loss)
  // is needed first in backward and stays on the device.
  bool after_head = false;
  // The head exclude_output_head marked in the model the scope was given
  // (its path; empty: none), and whether it ran through remat::forward here.
  std::string head;
  bool head_ran = false;
  State* previous = nullptr;  // the enclosing scope on this thread
  std::deque<std::shared_ptr<host_transfer::PendingCopy>> in_flight;

  std::any pack(const std::shared_ptr<State>& self, const at::Tensor& t);
  at::Tensor unpack(Packed& p);
  at::Tensor bring_back(Packed& p);
};

Packed::~Packed() {
  if (counted_host) state->counters.host_bytes -= bytes;
  if (counted_kept) state->counters.kept_bytes -= bytes;
}

namespace {
// The innermost offloading scope on this thread (the head's hook marks it).
thread_local OffloadActivations::State* t_innermost = nullptr;
}  // namespace

std::any OffloadActivations::State::pack(const std::shared_ptr<State>& self, const at::Tensor& t) {
  // The hooks' own work saves nothing and is not offloaded.
  disable_saved_tensors_hooks off;
  at::NoGradGuard no_grad;
  auto p = std::make_shared<Packed>();
  p->state = self;
  p->device = t.device();
  p->bytes = static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
  if (!t.is_inference()) {
    p->version = t.unsafeGetTensorImpl()->version_counter();
    p->saved_version = t._version();
  }
  p->describe = str(c10::toString(t.scalar_type()), " ", t.sizes(), " on ", t.device().str());
  at::Tensor data = t.detach();
  if (is_parameter(t, model_storages)) {
    p->kept = data;  // not an activation: not counted
    return p;
  }
  if (p->bytes < options.min_offload_size || after_head) {
    p->kept = data;
    p->counted_kept = true;
    counters.kept_tensors++;
    counters.kept_bytes += p->bytes;
    return p;
  }
  p->host = host_buffer(data, options.use_pin_memory && data.is_cuda());
  p->counted_host = true;
  counters.host_bytes += p->bytes;
  if (data.is_cuda() && options.use_streams) {
    std::lock_guard<std::mutex> lock(mutex);
    p->to_host = host_transfer::copy_to_host(data, p->host);
    in_flight.push_back(p->to_host);
    while (static_cast<int>(in_flight.size()) > options.max_fwd_stash_size) {
      in_flight.front()->wait();
      in_flight.pop_front();
    }
  } else {
    p->host.copy_(data);
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    p->id = order.size();
    order.push_back(p);
  }
  counters.offloaded_tensors++;
  counters.offloaded_bytes += p->bytes;
  return p;
}

// Starts (or does) the copy of p's host data back to its device.
at::Tensor OffloadActivations::State::bring_back(Packed& p) {
  if (p.fetched.defined()) return p.fetched;
  if (p.to_host) p.to_host->wait();
  MemoryCategoryScope activations(MemoryCategory::kSavedActivations);  // back where it was
  at::Tensor out = at::empty_strided(p.host.sizes(), p.host.strides(),
                                     p.host.options().device(p.device).pinned_memory(false));
  if (p.device.is_cuda() && options.use_streams) {
    p.to_device = host_transfer::copy_to_device(p.host, out);
  } else {
    out.copy_(p.host);
  }
  p.fetched = out;
  return out;
}

at::Tensor OffloadActivations::State::unpack(Packed& p) {
  // Backward has begun, so this scope's forward is over: a marked head that
  // never ran through the call route had its activations offloaded (and the
  // loss after it too), silently undoing what the head option asks for.
  if (!head.empty() && !head_ran) {
    throw Error(str("activation offloading: the output head '", head, "' was not called through remat::forward "
                    "in this forward, so excluding it had no effect: its activations (and the loss's) were "
                    "offloaded although backward needs them first. Call it through remat::forward(module, args...) in "
                    "the model's forward instead of module->forward(args...), or set activation_offloading.head "
                    "to the module that is called that way"));
  }
  if (p.version.enabled() && p.version.current_version() != p.saved_version) {
    throw Error(str("activation offloading: a tensor saved for backward (", p.describe,
                    ") was modified in place after it was saved (its version went from ",
                    p.saved_version, " to ", p.version.current_version(), "); the gradient "
                    "would use another value than the forward's: clone() the tensor before "
                    "changing it in place, or change a copy"));
  }
  if (p.kept.defined()) return p.kept;
  disable_saved_tensors_hooks off;
  at::NoGradGuard no_grad;
  at::Tensor out;
  std::shared_ptr<host_transfer::PendingCopy> ready;
  {
    std::lock_guard<std::mutex> lock(mutex);
    out = bring_back(p);
    ready = p.to_device;
    const int round = ++p.unpacks;
    // Backward runs in reverse: fetch the tensors saved just before this one
    // that this backward has not brought back yet.
    if (p.device.is_cuda() && options.use_streams) {
      int ahead = 0;
      for (size_t i = p.id; i-- > 0 && ahead < options.max_fwd_stash_size;) {
        auto earlier = order[i].lock();
        if (!earlier || !earlier->host.defined() || earlier->unpacks >= round) continue;
        if (!earlier->fetched.defined()) bring_back(*earlier);
        ++ahead;
      }
    }
    // Taken: the next backward (retain_graph) brings it back again.
    p.fetched = at::Tensor();
    p.to_device = nullptr;
  }
  if (ready) ready->order_before_use();
  counters.restored_tensors++;
  counters.restored_bytes += p.bytes;
  return out;
}

namespace {

// The head's calls run with no saved-tensor hooks: nothing of it is offloaded.
class NoOffloadHook final : public ModuleHook {
 public:
  c10::IValue run(const std::vector<c10::IValue>& args, const IValueFn& next) override {
    c10::IValue out;
    {
      disable_saved_tensors_hooks off;
      out = next(args);
    }
    // What runs after the head in this forward (the loss) stays on the device.
    if (t_innermost != nullptr) t_innermost->after_head = true;
    for (auto* scope = t_innermost; scope != nullptr; scope = scope->previous) scope->head_ran = true;
    return out;
  }
};

// The path of the module of `model` that exclude_output_head marked, or "".
std::string marked_head(const torch::nn::Module& model) {
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (std::dynamic_pointer_cast<NoOffloadHook>(module_hook(*item.value(), HookSlot::kNoOffload))) {
      return item.key();
    }
  }
  return "";
}

}  // namespace

OffloadActivations::OffloadActivations(const OffloadActivationsOptions& options,
                                       const torch::nn::Module* model)
    : state_(std::make_shared<State>()) {
  const std::string invalid = check_offload_activations(options);
  if (!invalid.empty()) throw ConfigError("OffloadActivations: " + invalid);
  state_->options = options;
  if (model != nullptr) {
    for (const auto& p : model->parameters()) {
      if (p.has_storage()) state_->model_storages.insert(p.storage().unsafeGetStorageImpl());
    }
    for (const auto& b : model->buffers()) {
      if (b.defined() && b.has_storage()) state_->model_storages.insert(b.storage().unsafeGetStorageImpl());
    }
    state_->head = marked_head(*model);
  }
  state_->previous = t_innermost;
  t_innermost = state_.get();
  std::weak_ptr<State> weak = state_;
  scope_ = std::make_unique<saved_tensors_hooks>(
      [weak](const at::Tensor& t) -> std::any {
        auto state = weak.lock();
        REMAT_CHECK(state != nullptr, "activation offloading: pack after the scope ended");
        return state->pack(state, t);
      },
      [](const std::any& packed) -> at::Tensor {
        const auto& p = std::any_cast<const std::shared_ptr<Packed>&>(packed);
        return p->state->unpack(*p);
      });
}

OffloadActivations::~OffloadActivations() {
  scope_.reset();
  t_innermost = state_->previous;
  // Copies still in flight finish before the forward's tensors may be reused.
  // A failed copy was or will be reported where its tensor is used; a
  // destructor must not throw (it may run while an exception unwinds).
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (auto& copy : state_->in_flight) {
    try {
      copy->wait();
    } catch (const std::exception& e) {
      log().error("activation offloading: a copy to the host failed: {}", e.what());
    }
  }
  state_->in_flight.clear();
}

ActivationOffloadStats activation_offload_stats() {
  const auto& c = Context::current().get<ActivationOffloadCounters>();
  ActivationOffloadStats s;
  s.offloaded_tensors = c.offloaded_tensors;
  s.offloaded_bytes = c.offloaded_bytes;
  s.restored_tensors = c.restored_tensors;
  s.restored_bytes = c.restored_bytes;
  s.kept_tensors = c.kept_tensors;
  s.kept_bytes = c.kept_bytes;
  s.host_bytes = c.host_bytes;
  return s;
}

std::shared_ptr<torch::nn::Module> find_output_head(torch::nn::Module& model,
                                                    const std::string& path) {
  if (!path.empty()) {
    std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
    for (const auto& item : model.named_modules("", /*include_self=*/false)) modules[item.key()] = item.value();
    auto found = modules.find(path);
    if (found == modules.end()) {
      throw ConfigError(str("activation_offloading.head: the model has no module '", path,
                            "'; its children are: ", describe_children(model)));
    }
    // The head is what runs last before the loss: one of the model's blocks,
    // or a module holding them, would keep every activation after it on the
    // device (or none offloaded at all) without a word.
    const auto not_a_head = [&](const std::string& why) {
      return ConfigError(str("activation_offloading.head '", path, "' is not an output head: ", why,
                             "; name the module that computes the logits (the model's children are: ",
                             describe_children(model), ")"));
    };
    const size_t dot = path.rfind('.');
    if (dot != std::string::npos) {
      auto parent = modules.find(path.substr(0, dot));
      if (parent != modules.end() && dynamic_cast<torch::nn::ModuleListImpl*>(parent->second.get()) != nullptr) {
        throw not_a_head(str("it is one of the blocks in '", parent->first, "', and the blocks after it would "
                             "keep their activations on the device"));
      }
    }
    for (const auto& item : found->second->named_modules("", /*include_self=*/true)) {
      if (dynamic_cast<torch::nn::ModuleListImpl*>(item.value().get()) != nullptr && item.value()->children().size() > 1) {
        throw not_a_head(str("it holds the blocks of '", item.key().empty() ? path : path + "." + item.key(),
                             "', whose activations would then all stay on the device"));
      }
    }
    return found->second;
  }
  auto children = model.named_children();
  for (const char* name : {"head", "output", "lm_head"}) {
    if (children.contains(name)) return children[name];
  }
  std::shared_ptr<torch::nn::Module> last;
  for (const auto& item : children) {
    if (module_type(*item.value()).find("Linear") != std::string::npos) last = item.value();
  }
  return last;
}

std::shared_ptr<torch::nn::Module> exclude_output_head(torch::nn::Module& model,
                                                       const OffloadActivationsOptions& options) {
  auto head = find_output_head(model, options.head);
  if (!head) {
    if (options.warn_if_no_head) {
      log_rank0().warn("activation offloading: no output head found (no top-level child named "
                       "head, output or lm_head, and no Linear child); its activations, needed "
                       "first in backward, are offloaded too. Name it with "
                       "activation_offloading.head");
    }
    return nullptr;
  }
  set_module_hook(*head, HookSlot::kNoOffload, std::make_shared<NoOffloadHook>());
  return head;
}

std::shared_ptr<torch::nn::Module> prepare_output_head(torch::nn::Module& model,
                                                       const OffloadActivationsOptions& options) {
  if (options.enabled) return exclude_output_head(model, options);
  if (options.head.empty()) return nullptr;
  try {
    return find_output_head(model, options.head);
  } catch (const ConfigError& e) {
    throw ConfigError(str(e.what(), " (checked although activation_offloading.enabled is false, so that a "
                                    "misspelt head shows now rather than when offloading is turned on)"));
  }
}

}  // namespace remat
