// The estimator's rows (engine/memory_estimate.h): every stage x policy x
// offloading, each from its stage's model state (engine/internal/
// memory_state.h, parallel's memory rule in bytes) and its blocks' columns.
// Its inputs are memory_inputs.cc's, its text memory_table.cc's, what fits
// memory_fit.cc's.
#include "engine/memory_estimate.h"

#include <algorithm>
#include <string>
#include <vector>

#include "checkpointing/frontier.h"
#include "engine/internal/memory_state.h"
#include "parallel/zero_options.h"
#include "runtime/device_memory.h"
#include "runtime/error.h"

namespace remat {
namespace {

const std::vector<std::string> kPolicies = {"none", "selective_op", "every_k", "auto", "full"};

size_t column_of(const BlockCosts& costs, BlockChoice choice) {
  auto it = std::find(costs.choices.begin(), costs.choices.end(), choice);
  REMAT_CHECK(it != costs.choices.end(), "memory estimate: the costs have no column ", block_choice_name(choice));
  return static_cast<size_t>(it - costs.choices.begin());
}

bool has_column(const BlockCosts& costs, BlockChoice choice) {
  return std::find(costs.choices.begin(), costs.choices.end(), choice) != costs.choices.end();
}

using internal::StateBytes;

std::vector<size_t> every_k_columns(const BlockCosts& costs, const Config& config, bool offload) {
  const auto& ac = config.activation_checkpointing;
  const int k = ac.variant == CheckpointVariant::kSelectiveLayer ? ac.every_k : 2;
  const size_t n = costs.blocks.size();
  const size_t ck = column_of(costs, offload ? BlockChoice::kFullOffload : BlockChoice::kFull);
  const size_t keep = column_of(costs, offload ? BlockChoice::kOffloadActivations : BlockChoice::kKeep);
  std::vector<size_t> cols(n, keep);
  for (size_t i = 0; i < n; ++i) {
    const size_t from = ac.every_k_from == EveryKFrom::kFirst ? i : n - 1 - i;
    if (from % static_cast<size_t>(k) == 0) cols[i] = ck;
  }
  return cols;
}

std::string plan_text(const BlockCosts& costs, const std::vector<size_t>& cols) {
  std::string out, prev;
  int run = 0;
  auto flush = [&] {
    if (run > 0) out += (out.empty() ? "" : " ") + prev + "x" + std::to_string(run);
  };
  for (size_t c : cols) {
    const std::string name = block_choice_name(costs.choices[c]);
    if (name != prev) {
      flush();
      prev = name;
      run = 0;
    }
    ++run;
  }
  flush();
  return out;
}

std::string configured_policy(const ActivationCheckpointingOptions& ac) {
  switch (ac.variant) {
    case CheckpointVariant::kNone: return "none";
    case CheckpointVariant::kFull: return "full";
    case CheckpointVariant::kSelectiveLayer: return "every_k";
    case CheckpointVariant::kSelectiveOp: return "selective_op";
    default: return "auto";
  }
}

// `costs` without the offloading choices (the rows without offloading).
BlockCosts without_offloading(const BlockCosts& costs) {
  std::vector<size_t> allowed;
  for (size_t c = 0; c < costs.choices.size(); ++c) {
    if (costs.choices[c] != BlockChoice::kFullOffload && costs.choices[c] != BlockChoice::kOffloadActivations) {
      allowed.push_back(c);
    }
  }
  BlockCosts choices = costs;
  choices.choices.clear();
  for (size_t c : allowed) choices.choices.push_back(costs.choices[c]);
  for (size_t i = 0; i < costs.blocks.size(); ++i) {
    choices.blocks[i].clear();
    for (size_t c : allowed) choices.blocks[i].push_back(costs.blocks[i][c]);
  }
  return choices;
}

// What one stage's rows share: its model state, and what the activations
// add to it (a live profile already holds a whole-model backward's gradients).
struct StageTerms {
  StateBytes state;
  int64_t grads_term = 0;
  int64_t fixed = 0;  // parameters, optimizer state, other bytes and gathered units
  // A CPU model: the offloaded optimizer's and parameters' host bytes, held
  // through the step in the same memory (in the peak, and charged against a
  // whole-device budget as the engine's planner charges them).
  int64_t host_held = 0;
  // train.async_save: a background save's snapshot on the host.
  int64_t snapshot = 0;
};

// The planner's columns for the auto row: the configured budget when the
// variant is auto (memory_budget_fraction "knee": the plan at the knee of the
// frontier, as the planner takes it), else half the peak with every block
// kept; a whole-device budget leaves what the state and gradients take. A
// budget no plan fits: infeasible, at full checkpointing's columns.
std::vector<size_t> auto_columns(const BlockCosts& costs, const Config& config, bool offload, int64_t keep_peak,
                                 const StageTerms& t, const MemoryEstimateInputs& in, bool& feasible) {
  const auto& ac = config.activation_checkpointing;
  const size_t n = costs.blocks.size();
  std::vector<size_t> cols(n);
  if (ac.variant == CheckpointVariant::kAuto && ac.memory_budget_knee && n >= 2) {
    const std::vector<FrontierPoint> frontier = activation_frontier(offload ? costs : without_offloading(costs));
    const ActivationPlan& knee = frontier[frontier_knee(frontier)].plan;
    for (size_t i = 0; i < n; ++i) cols[i] = column_of(costs, knee.choices[i]);
    return cols;
  }
  int64_t budget = keep_peak / 2;
  if (ac.variant == CheckpointVariant::kAuto) {
    if (ac.memory_budget_bytes) budget = *ac.memory_budget_bytes;
    if (ac.memory_budget_fraction) budget = static_cast<int64_t>(*ac.memory_budget_fraction * keep_peak);
    const int64_t state = t.fixed + t.grads_term + t.host_held;
    if (ac.device_memory_budget_bytes) budget = *ac.device_memory_budget_bytes - state;
    if (ac.device_memory_budget_auto && in.device_capacity_bytes > 0) {
      budget = auto_device_budget(in.device_capacity_bytes, 1, "activation_checkpointing.device_memory_budget_bytes",
                                  in.device_capacity_given)
                   .budget -
               state;
    }
  }
  try {
    ActivationPlan plan = solve_activation_plan(offload ? costs : without_offloading(costs), budget);
    for (size_t i = 0; i < n; ++i) cols[i] = column_of(costs, plan.choices[i]);
  } catch (const Error&) {
    feasible = false;
    const BlockChoice full = offload ? BlockChoice::kFullOffload : BlockChoice::kFull;
    std::fill(cols.begin(), cols.end(), column_of(costs, full));
  }
  return cols;
}

// Each block's column under `policy` (`unsolved`: the auto row past
// kMaxPlannedBlocks, at full checkpointing's peak).
std::vector<size_t> policy_columns(const BlockCosts& costs, const Config& config, const std::string& policy,
                                   bool offload, bool unsolved, int64_t keep_peak, const StageTerms& t,
                                   const MemoryEstimateInputs& in, bool& feasible) {
  const size_t n = costs.blocks.size();
  const BlockChoice keep = offload ? BlockChoice::kOffloadActivations : BlockChoice::kKeep;
  const BlockChoice full = offload ? BlockChoice::kFullOffload : BlockChoice::kFull;
  if (policy == "none") return std::vector<size_t>(n, column_of(costs, keep));
  if (policy == "full" || (policy == "auto" && unsolved)) return std::vector<size_t>(n, column_of(costs, full));
  if (policy == "selective_op") return std::vector<size_t>(n, column_of(costs, BlockChoice::kSelectiveOp));
  if (policy == "every_k") return every_k_columns(costs, config, offload);
  return auto_columns(costs, config, offload, keep_peak, t, in, feasible);
}

// A row's bytes from its stage's terms and its blocks' columns.
void fill_row(MemoryEstimateRow& r, const StageTerms& t, const MemoryEstimateInputs& in,
              const std::vector<size_t>& cols) {
  const StateBytes& st = t.state;
  int64_t host = 0;
  if (!in.host_bytes.empty()) {
    for (size_t i = 0; i < cols.size(); ++i) host += in.host_bytes[i][cols[i]];
  }
  r.parameter_bytes = st.params;
  r.gradient_bytes = st.grads;
  r.optimizer_bytes = st.optimizer;
  r.gathered_bytes = st.gathered;
  r.comm_bytes = st.comm;
  r.other_bytes = in.other_bytes;
  r.activation_bytes = predict_peak(in.activations, cols);
  r.host_bytes = host;
  r.host_optimizer_bytes = st.host_optimizer;
  r.disk_bytes = st.disk;
  r.disk_master_bytes = st.disk_masters;
  r.disk_parameter_bytes = st.disk_params;
  r.host_parameter_bytes = st.host_params;
  // The activation phase, or the optimizer's step (the state, the
  // gradients and one parameter's update temporaries).
  // Host bytes are apart: what of them a CPU model's tracker counts
  // (cpu_checkpointing's copies) is in the activations already. The
  // offloaded optimizer's and parameters' are too, but on a CPU model they
  // are in the same memory, held through the step.
  r.save_snapshot_bytes = t.snapshot;
  // A snapshot is held through the steps after a save: on a CPU model in the same memory.
  r.peak_bytes = std::max(t.fixed + r.activation_bytes + t.grads_term, st.params + st.optimizer + st.grads) +
                 t.host_held + (in.host_is_device ? t.snapshot : 0);
}

StageTerms stage_terms(const MemoryEstimateInputs& in, const Config& config, int stage, int group,
                       int64_t accumulation) {
  std::vector<parallel::ParameterCount> params;
  params.reserve(in.parameters.size());
  for (const ParameterSize& p : in.parameters) params.push_back({p.numel, p.trainable, p.unit, p.tp_sharded});
  StageTerms t;
  t.state = internal::state_bytes(params, in.element_bytes, config, stage, group, accumulation);
  t.grads_term = in.gradients_in_activations ? t.state.grads - t.state.full_trainable : t.state.grads;
  t.fixed = t.state.params + t.state.optimizer + in.other_bytes + t.state.gathered;
  t.host_held = in.host_is_device ? t.state.host_optimizer + t.state.host_params : 0;
  if (config.train.async_save) {
    // The tensors the optimizer steps (whole at stage 0, this rank's shard
    // after), copied in float32, and their optimizer state wherever it is.
    const int64_t trained = t.state.full_trainable / std::max<int64_t>(in.element_bytes, 1) * 4;
    t.snapshot = (stage == 0 ? trained : (trained + group - 1) / group) + t.state.optimizer + t.state.host_optimizer;
  }
  return t;
}

// `r` again under other terms (the optimizer or the parameters elsewhere),
// an auto row solved again under them.
MemoryEstimateRow row_under(MemoryEstimateRow r, const StageTerms& t, const MemoryEstimateInputs& in,
                            const Config& config, bool unsolved, int64_t keep_peak) {
  r.feasible = true;
  const std::vector<size_t> cols = policy_columns(in.activations, config, r.policy, r.offload, unsolved, keep_peak, t,
                                                  in, r.feasible);
  fill_row(r, t, in, cols);
  return r;
}

// The rows of one stage (`hybrid`: sharded within hybrid groups), every
// policy with offloading off and on, the optimizer offloaded as configured;
// at stages 1-3 each row's peak with the optimizer on the host beside it,
// and where the config offloads, its peak without.
void add_stage_rows(MemoryEstimate& e, const Config& config, const MemoryEstimateInputs& in, int stage, bool hybrid,
                    int group, bool use_hybrid, int64_t keep_peak) {
  const BlockCosts& costs = in.activations;
  const size_t n = costs.blocks.size();
  const auto& ac = config.activation_checkpointing;
  const bool offload_configured = config.activation_offloading.enabled || ac.cpu_checkpointing;
  const std::string configured = configured_policy(ac);
  const int64_t accumulation = internal::accumulation_of(config, e.dp);
  const bool opt = stage > 0 && e.offload_optimizer;
  const StageTerms t = stage_terms(in, config, stage, group, accumulation);
  // The optimizer on the host (its state on disk where the config says
  // "nvme"), the parameters as configured.
  Config on_host = config;
  if (!on_host.zero_optimization.offload_optimizer.enabled()) {
    on_host.zero_optimization.offload_optimizer.device = parallel::OffloadDevice::kCpu;
  }
  const StageTerms host = stage_terms(in, on_host, stage, group, accumulation);
  // Neither the optimizer nor the parameters offloaded.
  Config plain = config;
  plain.zero_optimization.offload_param.device = parallel::OffloadDevice::kNone;
  plain.zero_optimization.offload_optimizer.device = parallel::OffloadDevice::kNone;
  const bool offloads = opt || (stage == 3 && e.offload_param);
  const StageTerms none = stage_terms(in, plain, stage, group, accumulation);
  for (bool offload : {false, true}) {
    for (const std::string& policy : kPolicies) {
      if (offload && policy == "selective_op") continue;  // no offloading variant of it
      if (offload && (!has_column(costs, BlockChoice::kFullOffload) ||
                      !has_column(costs, BlockChoice::kOffloadActivations))) {
        continue;
      }
      MemoryEstimateRow r;
      r.stage = stage;
      r.hybrid = hybrid;
      r.policy = policy;
      r.offload = offload;
      r.offload_optimizer = opt;
      r.configured = policy == configured && offload == offload_configured &&
                     stage == config.zero_optimization.stage && (stage == 0 || hybrid == use_hybrid);
      // The planner's exact solve grows with the square of the blocks: past
      // kMaxPlannedBlocks only the configured auto row is kept, unsolved,
      // at full checkpointing's peak (the least any plan reaches).
      const bool unsolved = policy == "auto" && n > kMaxPlannedBlocks;
      if (unsolved && !r.configured) continue;
      const std::vector<size_t> cols =
          policy_columns(costs, config, policy, offload, unsolved, keep_peak, t, in, r.feasible);
      if (policy == "every_k" || policy == "auto") r.plan = plan_text(costs, cols);
      fill_row(r, t, in, cols);
      if (unsolved) r.plan = str("not solved (more than ", kMaxPlannedBlocks, " blocks): at least this peak");
      if (stage > 0) {
        // The same row with the optimizer on the host (the planner's auto
        // row under its own budget then).
        const MemoryEstimateRow h = row_under(r, host, in, config, unsolved, keep_peak);
        r.host_optimizer_bytes = h.host_optimizer_bytes;
        r.offload_optimizer_peak_bytes = h.feasible ? h.peak_bytes : 0;
      }
      if (offloads) {
        const MemoryEstimateRow p = row_under(r, none, in, plain, unsolved, keep_peak);
        r.no_offload_peak_bytes = p.feasible ? p.peak_bytes : 0;
      }
      e.rows.push_back(std::move(r));
    }
  }
}

}  // namespace

MemoryEstimate estimate_memory(const Config& config, int world_size, const MemoryEstimateInputs& in) {
  const int tp = config.tensor_parallel.size;
  if (world_size < 1 || world_size % tp != 0) {
    throw ConfigError(str("memory estimate: ", world_size, " ranks do not divide into tensor_parallel.size ", tp,
                          ": give a number of ranks that is a multiple of it"));
  }
  REMAT_CHECK(!in.activations.blocks.empty(), "memory estimate: the model has no blocks");
  MemoryEstimate e;
  e.mode = in.mode;
  e.host_is_device = in.host_is_device;
  e.device_capacity_bytes = in.device_capacity_bytes;
  e.world_size = world_size;
  e.tp = tp;
  e.dp = world_size / tp;
  e.offload_optimizer = config.zero_optimization.offload_optimizer.enabled();
  e.offload_param = config.zero_optimization.offload_param.enabled();
  e.async_save = config.train.async_save;
  // The trainer's rules that need the number of ranks (ZeroModel's), so that
  // the estimate refuses what the run would.
  if (std::string bad = parallel::check_hybrid_shard_size(config.zero_optimization, e.dp); !bad.empty()) {
    throw ConfigError(bad);
  }
  const int hybrid = config.zero_optimization.hybrid_shard_size;
  const bool use_hybrid = hybrid > 0 && hybrid < e.dp;
  e.shard_group = use_hybrid ? hybrid : e.dp;
  const BlockCosts& costs = in.activations;
  const std::vector<size_t> keep_cols(costs.blocks.size(), column_of(costs, BlockChoice::kKeep));
  const int64_t keep_peak = predict_peak(costs, keep_cols);
  std::vector<std::pair<int, bool>> stages = {{0, false}, {1, false}, {2, false}, {3, false}};
  if (use_hybrid) {
    for (int s = 1; s <= 3; ++s) stages.push_back({s, true});
  }
  for (const auto& [stage, hyb] : stages) {
    add_stage_rows(e, config, in, stage, hyb, hyb ? hybrid : e.dp, use_hybrid, keep_peak);
  }
  return e;
}


}  // namespace remat
