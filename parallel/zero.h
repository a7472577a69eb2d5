// ZeRO / FSDP style sharding over the data-parallel group: plain data
// parallelism (stage 0), optimizer state (stage 1), optimizer state and
// gradients (stage 2), everything (stage 3), behind one interface.
//
// Stages 1 and 2: the parameters are laid out in gradient buckets of at most
// reduce_bucket_size elements (in reverse registration order, the order their
// gradients arrive in backward), each bucket one flat buffer padded to a
// multiple of the shard group's size. Every rank keeps the whole parameters;
// the optimizer steps this rank's 1/N of each bucket (a view of it, so the
// step updates the parameters in place), and begin_forward all-gathers the
// buckets after every step: once the last micro-step's gradients reached the
// shards (whatever optimizer steps them, and however it writes) or a shard
// was changed in place. Stage 1 reduce-scatters the gradients at
// the last micro-step; stage 2 reduce-scatters each bucket as soon as all its
// gradients arrived, during the backward (overlap_comm: without waiting), so
// only the shards' gradients outlive the backward.
//
// Hybrid sharding (hybrid_shard_size S): parameters and state are sharded over
// groups of S consecutive data-parallel ranks and replicated across the
// dp / S groups; gradients are reduce-scattered within a group, then
// all-reduced across groups.
//
// Stage 3: the model is cut into units, each given submodule (the transformer
// blocks) and the rest of the model as the root unit. A unit's parameters
// (per kind: sharded across tensor-parallel ranks or not) are flattened into
// one buffer padded to a multiple of the data-parallel size; each rank keeps
// one shard, which is what the optimizer steps (fp32). The module's
// parameters stay registered, with their storage filled only while gathered:
//
//   forward   gather the unit (prefetched while the previous unit computed),
//             run it, free it;
//   backward  gather again before the unit's backward (a checkpointed unit
//             recomputes on this one gather), prefetch the unit before it,
//             then reduce-scatter the gradients into the shard's gradient
//             (averaged over data-parallel ranks) and free parameters and
//             gradients.
//
// The root unit serves the embeddings (gathered by begin_forward, freed when
// the first block starts) and the head (fetched while the last block runs,
// kept through the head's backward, freed when the first block's backward
// begins), and is reduced in finish_backward: so its parameters must be used
// only before the first unit and after the last one. When the backward of
// what runs before the first unit needs a root parameter's data (a LayerNorm
// after the embedding; an embedding's own backward does not), the root is
// gathered again once the first unit's backward is done. At most two units are
// gathered at once. Parameters
// with fewer than stage3_param_persistence_threshold elements stay whole on every rank
// (gradients all-reduced). Units are called through remat::forward, whose
// sharding hook gathers them (nn/module_call.h).
//
// Stage 0: every rank holds every parameter; the gradients are all-reduced
// (averaged) in buckets of reduce_bucket_size elements, in reverse
// registration order: in finish_backward, or with overlap_comm each bucket as
// soon as the backward accumulated its last gradient (begin_backward(true)
// announces the last micro-step).
//
// Mixed precision, bf16 or fp16 (every stage): float32 masters are what the
// optimizer steps and saves hold; the model computes with 16-bit copies
// (stages 0-2: made once per step and installed in the model; stage 3: the
// gathered units); gradients are accumulated in float32 and reduced in
// MixedPrecision::reduce_dtype.
//
// offload_optimizer (stages 1-3, internal/zero_offload.h): parameters() are float32
// host copies of the shards (and stage 3's persistent parameters), which the
// optimizer steps in host memory, its state made beside them; in the last
// micro-step (begin_backward(true)) each reduced gradient shard is copied
// into its master's gradient as its reduction ends (finish_backward: the
// rest, and waits), and the stepped values go back into the device shards by
// after_step (and by begin_forward, whatever stepped them). On a CPU the
// losses are bitwise those without offload.
//
// offload_param (stage 3, zero_stage3.cc): the units' float32 shards are host
// tensors of their own (pinned where asked and this LibTorch can pin), copied
// to the device in the compute dtype by each unit's gather (prefetched alike),
// so that the device holds the units in flight and the persistent parameters
// (below stage3_param_persistence_threshold, whole on every rank) only; each
// unit's reduced gradient shard is copied to the host shard's gradient, and
// the optimizer steps the host shards where they are (with offload_optimizer
// too: the shards are then the host masters, not copied again). On a CPU the
// losses are bitwise those without offload.
//
// Every stage: the model's parameters and buffers start as data-parallel
// rank 0's (broadcast at construction, whatever each rank initialised).
// Frozen parameters (requires_grad false when ZeroModel is built, e.g. the
// base weights of a low-rank fine-tune) get no gradient, so the optimizer
// skips them: stages 0-2 keep them whole on every rank, stage 3 shards them in
// buffers of their own that are gathered for use and never reduced. They are
// in parameters() and layout() (so saves hold them) and in full_parameters().
//
// Each stage is its own strategy behind ZeroModel (internal/sharding_strategy.h):
// data_parallel.cc for stage 0, zero_stage12.cc for stages 1 and 2,
// zero_stage3.cc for stage 3. Each answers for its stage (what follows an
// optimizer step or a load, whether parameters are gathered on use, its
// memory rule: zero_memory.h), so that a caller never switches on stage().
//
//   remat::parallel::ZeroModel zero(*model, blocks, layout.dp_group(), cfg.zero_optimization,
//                                   cfg.bf16, remat::parallel::sharded_parameters(*model));
//   auto optimizer = make_optimizer(cfg.optimizer, zero.parameters());
//   zero.begin_forward();
//   at::Tensor loss = zero.finish_forward(model->loss(x, y));
//   zero.begin_backward(/*synchronize=*/true);
//   loss.backward();
//   zero.finish_backward();
//   optimizer->step();
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "parallel/nvme_tensor_file.h"
#include "parallel/zero_memory.h"
#include "parallel/zero_options.h"
#include "runtime/field_table.h"

namespace torch::nn {
class Module;
}

namespace remat {
class Communicator;
class ModuleHook;
}  // namespace remat

namespace remat::parallel {

class ShardingStrategy;
class MasterPolicy;


// Per-rank bytes, now and over the collectives issued so far.
struct ZeroStats {
  int64_t param_bytes = 0;          // shards and persistent parameters
  int64_t grad_bytes = 0;           // their gradients now
  int64_t gathered_bytes = 0;       // full unit parameters alive now
  int64_t peak_gathered_bytes = 0;  // since reset_peak()
  int peak_gathered_units = 0;      // units gathered at once, since reset_peak()
  int64_t allgather_bytes = 0;      // total: output bytes of parameter all-gathers
  int64_t reducescatter_bytes = 0;  // total: input bytes of gradient reduce-scatters
  int64_t allreduce_bytes = 0;      // total: 2 x bytes all-reduced (reduce-scatter + all-gather)
  // offload_optimizer: the float32 masters and their gradient buffers held
  // in host memory (the optimizer's state is the optimizer's to count).
  int64_t host_bytes = 0;
  // offload_param (stage 3): the parameter shards and their gradients held in
  // host memory (param_bytes and grad_bytes then count the device's only);
  // with its "nvme", the shards in the file (the page-padded bytes on disk)
  // in disk_param_bytes instead.
  int64_t host_param_bytes = 0;
  int64_t disk_param_bytes = 0;
  // offload_optimizer "nvme": the float32 masters' bytes in its file (not in
  // host_bytes, which keeps their gradients).
  int64_t disk_master_bytes = 0;
  // Totals: the bytes of tensors in those files that the work read and
  // wrote: each gather of a parameter shard on disk reads it; the optimizer
  // step reads and rewrites each tensor it steps there (shard or master).
  // The files are mapped, so the kernel does this I/O through its page cache
  // (a read of a page it still holds does not reach the disk; a rewritten
  // page is written back on the kernel's schedule).
  int64_t disk_param_read_bytes = 0, disk_param_written_bytes = 0;
  int64_t disk_master_read_bytes = 0, disk_master_written_bytes = 0;
  // Stages 1 and 2: the most gradient bytes held at once (parameters' own,
  // bucket buffers, reductions in flight and the shards'), since reset_peak();
  // stage 3: the most the device held at once of the shards' gradients
  // (offload_optimizer's before each goes to the host; none of
  // offload_param's host shards but each on its way there) and the
  // persistent parameters'; stage 0: grad_bytes.
  int64_t peak_grad_bytes = 0;
  // Totals: milliseconds spent blocked on gradient reductions (stages 0-2:
  // the communication the backward did not hide, whether waited for in the
  // backward's gradient hooks or after it); gradient buckets reduced, and of
  // those, the ones seen complete before the backward ended (overlap_comm).
  double reduce_wait_ms = 0;
  int64_t buckets_reduced = 0, buckets_done_in_backward = 0;
  int64_t collective_bytes() const { return allgather_bytes + reducescatter_bytes + allreduce_bytes; }
  static const FieldTable<ZeroStats>& fields();
};

// Each field once (runtime/field_table.h): its kind, and its key in a step's
// metrics if it has one. A new counter is its field, its row and its increment
// where a strategy counts (each keeps one ZeroStats and returns it whole).
inline const FieldTable<ZeroStats>& ZeroStats::fields() {
  using S = ZeroStats;
  constexpr FieldKind kTotal = FieldKind::kTotal, kNow = FieldKind::kNow, kPeak = FieldKind::kPeak;
  static const FieldTable<S> table = {
      {"param_bytes", kNow, &S::param_bytes, "param_bytes"},
      {"grad_bytes", kNow, &S::grad_bytes, "grad_bytes"},
      {"gathered_bytes", kNow, &S::gathered_bytes},
      {"host_bytes", kNow, &S::host_bytes},
      {"host_param_bytes", kNow, &S::host_param_bytes},
      {"peak_gathered_bytes", kPeak, &S::peak_gathered_bytes, "peak_gathered_param_bytes"},
      {"peak_gathered_units", kPeak, &S::peak_gathered_units},
      {"allgather_bytes", kTotal, &S::allgather_bytes},
      {"reducescatter_bytes", kTotal, &S::reducescatter_bytes},
      {"allreduce_bytes", kTotal, &S::allreduce_bytes},
      {"disk_param_read_bytes", kTotal, &S::disk_param_read_bytes},
      {"disk_param_written_bytes", kTotal, &S::disk_param_written_bytes},
      {"disk_master_read_bytes", kTotal, &S::disk_master_read_bytes},
      {"disk_master_written_bytes", kTotal, &S::disk_master_written_bytes},
      {"peak_grad_bytes", kPeak, &S::peak_grad_bytes, "grad_peak_bytes"},
      {"reduce_wait_ms", kTotal, &S::reduce_wait_ms, "reduce_wait_ms"},
      {"buckets_reduced", kTotal, &S::buckets_reduced, "buckets_reduced"},
      {"buckets_done_in_backward", kTotal, &S::buckets_done_in_backward, "buckets_done_in_backward"},
  };
  return table;
}

// Which elements of the model's parameters one of ZeroModel::parameters()
// holds: `length` elements from `param_offset` of the flattened parameter
// `name` (the model's state-dict name) at `shard_offset` of the tensor.
struct ShardSegment {
  std::string name;
  int64_t param_offset = 0, shard_offset = 0, length = 0;
};
struct ShardLayout {
  std::vector<ShardSegment> segments;
};

// A part of one rank's model state (zero_memory.h): what it is, where it
// lives, and its tensors. Their gradients are held where they are: a device
// part's are the device's gradients, a host part's in its host account. The
// optimizer's state is the optimizer's tensors: its part lists none.
struct HeldTensors {
  StatePart part = StatePart::kParameters;
  Place place = Place::kDevice;
  std::vector<at::Tensor> tensors;
};

class ZeroModel {
 public:
  // `units` are submodules of `model` (each transformer block); `config` is
  // the zero_optimization section, `mixed` the compute and reduce dtypes
  // (any stage; both in parallel/zero_options.h, where a Bf16Options, the bf16
  // section, converts to one: with bf16 or fp16 the model computes with 16-bit
  // copies, parameters() are float32 masters, and the floating-point inputs
  // of the model's modules called through remat::forward are cast to the
  // compute dtype); `sharded_tp` lists parameters that
  // differ across tensor-parallel ranks (for the gradient norm;
  // sharded_parameters()); `nvme` the files the NVMe offloads keep their
  // tensors in, each given exactly when its section's device is "nvme".
  // Invalid options (check_zero_options), or a stage or combination that is
  // not implemented, are a ConfigError.
  ZeroModel(torch::nn::Module& model, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
            std::shared_ptr<Communicator> dp_group, const ZeroOptions& config,
            const MixedPrecision& mixed, std::vector<at::Tensor> sharded_tp = {},
            NvmeFiles nvme = {});
  ~ZeroModel();
  ZeroModel(const ZeroModel&) = delete;
  ZeroModel& operator=(const ZeroModel&) = delete;

  int stage() const { return stage_; }
  // What this rank holds of the model state and where, by part: the model's
  // parameters, what the optimizer steps (by place: the device, the host
  // masters of offload_optimizer, the host shards of offload_param) and the
  // optimizer's state. The same places as state_elements (zero_memory.h)
  // gives a config not yet built; the engine classifies memory by them.
  std::vector<HeldTensors> holding() const;
  // Whether parameters() are host copies the optimizer steps in host memory
  // (zero_optimization.offload_optimizer.device cpu).
  bool offloads_optimizer() const;
  // Whether stage 3's shards live in host memory (zero_optimization.offload_param.device cpu).
  bool offloads_parameters() const { return !host_shards_.empty(); }
  // offload_param: those of parameters() that are stage 3's host shards (empty without it).
  const std::vector<at::Tensor>& host_shards() const { return host_shards_; }
  // What the optimizer steps: the shards and the persistent parameters
  // (stage 0: the model's parameters). offload_optimizer: the host masters,
  // free to write once this returns (copies from them to the device ended).
  std::vector<at::Tensor> parameters() const;
  // The tensors the stage keeps on the device for parameters(): the same
  // tensors without offload; offload_optimizer: what the masters are copied
  // into (stage 3 under masters_on_host: 16-bit shards); offload_param's
  // host shards left out.
  std::vector<at::Tensor> device_parameters() const;
  // Every gradient of parameters() dropped (set to none), as between steps.
  void zero_grad();

  // For each of parameters(): the model parameter elements it holds.
  std::vector<ShardLayout> layout() const;
  // The model's parameters, whole (gathered where sharded), by state-dict
  // name: copies, made between steps (collective over the data-parallel
  // group). for_each_full_unit collected.
  std::vector<std::pair<std::string, at::Tensor>> full_parameters();
  // The same values one unit at a time, so that no rank holds more than one
  // unit whole (collective over the data-parallel group; between steps):
  // `fn` gets each unit's parameters, float32 and whole, by state-dict name
  // in registration order; stage 3 a unit (its groups gathered), stages 1
  // and 2 a gradient bucket, stage 0 and the parameters kept whole on every
  // rank (frozen, persistent) one parameter. Every parameter comes once;
  // units come in the order of their first parameter's registration, the
  // same on every rank. The tensors are views valid until `fn` returns
  // (gathered buffers, or the live parameters): copy what you keep.
  using FullUnit = std::vector<std::pair<std::string, at::Tensor>>;
  void for_each_full_unit(const std::function<void(FullUnit&)>& fn);
  // Ranks a parameter is sharded over, and ranks holding the same shard.
  int shard_size() const;
  int replicate_size() const;

  // After the optimizer stepped parameters(): stages 1 and 2 gather the
  // stepped shards, so that every rank's parameters read right between steps
  // (the next forward would gather them anyway); the other stages have
  // nothing to do. Collective.
  void after_step();
  // After a load wrote parameters(): the model's parameters rebuilt from
  // them where they are whole copies of the shards (stages 1 and 2). Collective.
  void after_load();
  // Whether the model's parameters are views of units gathered around each
  // use and empty between uses (stage 3), rather than whole tensors.
  bool parameters_gathered_on_use() const;
  // The gradients this rank holds under its stage (zero_memory.h), from the
  // model's trainable bytes and those of parameters().
  GradientHold gradient_hold(int64_t trainable, int64_t local_trainable) const;

  // A scope with whole parameters, between steps. install_whole_parameters
  // puts every parameter's whole value into the model where they are
  // gathered on use (collective over the data-parallel group), in the type
  // each computes in (`as_computed`) or in float32; elsewhere they are whole
  // already and nothing is done. `restore`: each parameter with the data it
  // held before (set it back to end the scope); `values` (`keep_values`):
  // the whole values the scope began with, by name.
  struct WholeParameters {
    std::vector<std::pair<at::Tensor, at::Tensor>> restore;
    std::map<std::string, at::Tensor> values;
  };
  WholeParameters install_whole_parameters(bool as_computed, bool keep_values);
  // Writes `edited` (whole values by name) into parameters(): rank 0's value
  // for every data-parallel rank (collective), each rank its pieces;
  // `began_with` (WholeParameters::values): what is unchanged from it is
  // left as it is. The model's parameters are then current on every rank.
  void write_back_parameters(std::map<std::string, at::Tensor> edited,
                             const std::map<std::string, at::Tensor>& began_with);
  // The model left whole and current for use without ZeroModel
  // (collective): stage 3 puts every parameter's whole value in, in float32;
  // stages 1 and 2 gather the stepped shards.
  void leave_whole();

  // Stage 3: gathers the root unit; stages 1 and 2: brings the parameters up
  // to date with the shards the optimizer stepped. Call before each forward.
  void begin_forward();
  // Frees the root unit; its backward (from the returned loss) gathers it again.
  at::Tensor finish_forward(const at::Tensor& loss);
  // Before backward: whether the finish_backward after it synchronizes. With
  // overlap_comm, stages 0 and 1 reduce during a backward announced with true
  // (without the call they reduce in finish_backward).
  void begin_backward(bool synchronize);
  // After backward: reduces what is left (root unit; and with `synchronize`,
  // the last micro-step of a gradient-accumulation step: persistent
  // parameters, stage 0: everything) and checks that every unit that ran was
  // reduced.
  void finish_backward(bool synchronize = true);
  // Frees the root unit after a forward without backward (evaluation).
  void end_evaluation();
  // After a backward that threw half-way: waits for the collectives in
  // flight, frees what is gathered and drops every gradient (the whole
  // accumulation window's), so the next forward starts clean.
  void abandon_backward();

  // Which of the model's parameters (named_parameters() order, one element
  // each: 1 or 0) a backward accumulated a gradient for on this rank since
  // the last call (or abandon_backward()); the call starts counting afresh.
  // A parameter no forward used gets none, though the reduction hands the
  // optimizer zeros for it: reduced (max) over every rank, these say which
  // parameters no rank used, which the optimizer must not step (weight decay
  // and momentum would move them; remat::Engine::step leaves them alone).
  at::Tensor take_gradient_arrivals();
  // Clips gradients by the global L2 norm (shards summed over the
  // data-parallel group, tensor-parallel shards over `tp_group` too; see
  // grad_norm.h). Returns the norm before clipping.
  double clip_grad_norm(double max_norm, const std::shared_ptr<Communicator>& tp_group);

  ZeroStats stats() const;
  void reset_peak();
  // Gathers per unit so far (forward, backward and evaluation), by unit name
  // ("root", "blocks.0", ...). Empty for stage 0.
  std::map<std::string, int64_t> gather_counts() const;
  // Parameter elements of each unit (unpadded), by unit name.
  std::map<std::string, int64_t> unit_numels() const;
  // Padded elements of each unit's flat buffers (the all-gather size), by unit name.
  std::map<std::string, int64_t> unit_padded_numels() const;

 private:
  int stage_;
  bool optimizer_on_host_ = false;  // optimizer_on_host (zero_memory.h) of the options
  torch::nn::Module& model_;
  std::shared_ptr<Communicator> dp_group_, shard_group_, replicate_group_;
  std::vector<at::Tensor> sharded_tp_;
  // Masters and compute copies (internal/master_policy.h), asked by the
  // strategy: made before it, gone after it.
  std::unique_ptr<MasterPolicy> policy_;
  std::unique_ptr<ShardingStrategy> strategy_;
  std::vector<at::Tensor> host_shards_;        // offload_param: those of parameters() in host memory
  NvmeFiles nvme_;  // the NVMe offloads' files (the policy's too)
  // The optimizer steps' reads and writes of tensors in nvme_'s files (ZeroStats's disk_*_bytes).
  int64_t stepped_param_disk_bytes_ = 0, stepped_master_disk_bytes_ = 0;
  struct Arrivals;  // take_gradient_arrivals()'s hooks and flags
  // Mixed precision: the modules whose inputs remat::forward casts, and the hook.
  std::vector<std::weak_ptr<torch::nn::Module>> cast_hooked_;
  std::shared_ptr<ModuleHook> cast_hook_;
  std::unique_ptr<Arrivals> arrivals_;
};

}  // namespace remat::parallel
