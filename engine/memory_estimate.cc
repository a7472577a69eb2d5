#include "engine/memory_estimate.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "checkpointing/frontier.h"
#include "engine/internal/memory_state.h"
#include "parallel/zero_options.h"
#include "runtime/compat.h"
#include "runtime/device_memory.h"
#include "runtime/error.h"

namespace remat {
namespace {

const std::vector<std::string> kPolicies = {"none", "selective_op", "every_k", "auto", "full"};
constexpr size_t kMaxPlannedBlocks = 1024;

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(bytes) / 1048576.0);
  return buf;
}

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
  r.host_parameter_bytes = st.host_params;
  // The activation phase, or the optimizer's step (the state, the
  // gradients and one parameter's update temporaries).
  // Host bytes are apart: what of them a CPU model's tracker counts
  // (cpu_checkpointing's copies) is in the activations already. The
  // offloaded optimizer's and parameters' are too, but on a CPU model they
  // are in the same memory, held through the step.
  r.peak_bytes =
      std::max(t.fixed + r.activation_bytes + t.grads_term, st.params + st.optimizer + st.grads) + t.host_held;
}

StageTerms stage_terms(const MemoryEstimateInputs& in, const Config& config, int stage, int group,
                       int64_t accumulation) {
  StageTerms t;
  t.state = internal::state_bytes(in, config, stage, group, accumulation);
  t.grads_term = in.gradients_in_activations ? t.state.grads - t.state.full_trainable : t.state.grads;
  t.fixed = t.state.params + t.state.optimizer + in.other_bytes + t.state.gathered;
  t.host_held = in.host_is_device ? t.state.host_optimizer + t.state.host_params : 0;
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
  const StageTerms t = stage_terms(in, config, stage, group, opt ? accumulation : 0);
  const StageTerms host = stage_terms(in, config, stage, group, accumulation);
  // Neither the optimizer nor the parameters offloaded.
  Config plain = config;
  plain.zero_optimization.offload_param.device = parallel::OffloadDevice::kNone;
  const bool offloads = opt || (stage == 3 && e.offload_param);
  const StageTerms none = stage_terms(in, plain, stage, group, 0);
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

namespace {

// "device capacity 81092 MiB per rank: the configured peak fits" (the device or host apart).
std::string capacity_text(const MemoryEstimate& e) {
  bool fits = false;
  for (const auto& r : e.rows) {
    if (r.configured) fits = r.feasible && r.peak_bytes <= e.device_capacity_bytes;
  }
  return str(e.host_is_device ? "memory" : "device capacity", " ", mib(e.device_capacity_bytes),
             " MiB per rank: the configured peak ", fits ? "fits" : "does not fit");
}

}  // namespace

const MemoryEstimateRow& MemoryEstimate::configured() const {
  for (const auto& r : rows) {
    if (r.configured) return r;
  }
  throw Error("memory estimate: no row matches the configuration");
}

const MemoryEstimateRow& MemoryEstimate::row(int stage, const std::string& policy, bool offload) const {
  const bool hybrid = shard_group < dp;
  for (const auto& r : rows) {
    if (r.stage == stage && r.policy == policy && r.offload == offload && (stage == 0 || r.hybrid == hybrid)) return r;
  }
  throw Error(str("memory estimate: no row for stage ", stage, " policy ", policy, offload ? " offloaded" : ""));
}

std::string MemoryEstimate::table() const {
  std::ostringstream o;
  o << "Estimated memory per rank (" << mode << (host_is_device ? "" : ", the model on a GPU") << "), " << world_size << " ranks = dp " << dp << " x tp " << tp
    << (shard_group < dp ? str(", hybrid shards of ", shard_group) : std::string()) << ", MiB; * the configuration\n";
  char line[512];
  // offload_param: a column of its own (stage 3's rows), absent otherwise.
  std::snprintf(line, sizeof line, "  %-5s %-13s %-7s %-5s %10s %10s %10s %10s %10s %10s %10s %10s %10s %10s%s  %s\n",
                "stage", "policy", "offload", "optim", "params", "grads", "optimizer", "gathered", "activation",
                "host", "comm", "peak", "host optim", "peak optim", offload_param ? " host param" : "", "plan");
  o << line;
  for (const auto& r : rows) {
    const std::string stage = str(r.configured ? "*" : " ", r.stage, r.hybrid ? "h" : "");
    const bool alt = r.stage > 0;  // stage 0 cannot offload the optimizer
    char host_param[32] = "";
    if (offload_param) {
      std::snprintf(host_param, sizeof host_param, " %10s", r.stage == 3 ? mib(r.host_parameter_bytes).c_str() : "-");
    }
    std::snprintf(line, sizeof line, "  %-5s %-13s %-7s %-5s %10s %10s %10s %10s %10s %10s %10s %10s %10s %10s%s  %s%s\n",
                  stage.c_str(), r.policy.c_str(), r.offload ? "on" : "off", r.offload_optimizer ? "host" : "dev",
                  mib(r.parameter_bytes).c_str(), mib(r.gradient_bytes).c_str(), mib(r.optimizer_bytes).c_str(),
                  mib(r.gathered_bytes).c_str(), mib(r.activation_bytes).c_str(), mib(r.host_bytes).c_str(),
                  mib(r.comm_bytes).c_str(), mib(r.peak_bytes).c_str(), alt ? mib(r.host_optimizer_bytes).c_str() : "-",
                  alt && r.offload_optimizer_peak_bytes > 0 ? mib(r.offload_optimizer_peak_bytes).c_str() : "-",
                  host_param, r.feasible ? "" : "(no plan fits its budget) ", r.plan.c_str());
    o << line;
  }
  if (!rows.empty() && std::count_if(rows.begin(), rows.end(), [](const MemoryEstimateRow& r) {
        return r.policy == "auto";
      }) <= 1) {
    o << "  auto: past " << kMaxPlannedBlocks << " blocks the planner's rows are not solved here (it solves at the run)\n";
  }
  o << "  activation: the step's activation peak above the state (" << (mode == "live" ? "a whole-model backward's "
       "gradients included; grads: the stage's peak" : "gradients apart")
    << "); host: what offloading moves to the host and holds there at the peak (apart from the peak); comm: buffers "
       "inside grads (stages 1-2 bucket) and gathered (stage 3); peak: what one rank holds at once"
    << (host_is_device ? "" : " on its device (host apart: in host memory)")
    << "; optim: where the optimizer's state is (host: zero_optimization.offload_optimizer.device cpu); host optim: "
       "the float32 master shards, their gradients and the optimizer's state on the host when it is there; peak optim: "
       "the peak with the optimizer on the host"
    << (host_is_device ? " (host optim included: the host is the device)" : " (host optim apart)")
    << (offload_param ? str("; host param: zero_optimization.offload_param's float32 parameter shards and their "
                            "gradients on the host (with the optimizer on the device, its state of them too), ",
                            host_is_device ? "in the peaks" : "apart from the peaks",
                            "; params, grads and optimizer then keep the device's: the persistent parameters' and, "
                            "in grads, a unit's gradient shard until it reaches the host")
                      : std::string())
    << "\n";
  if (device_capacity_bytes > 0 && !rows.empty()) o << "  " << capacity_text(*this) << "\n";
  return o.str();
}

std::string MemoryEstimate::line() const {
  const MemoryEstimateRow& r = configured();
  return str("memory estimate (", mode, "): peak ", mib(r.peak_bytes), " MiB per rank = parameters ",
             mib(r.parameter_bytes), " + gradients ", mib(r.gradient_bytes), " + optimizer state ",
             mib(r.optimizer_bytes), " + gathered units ", mib(r.gathered_bytes), " + activations ",
             mib(r.activation_bytes), r.host_bytes > 0 ? str(" (host ", mib(r.host_bytes), ")") : std::string(),
             r.offload_optimizer ? str("; the optimizer on the host: ", mib(r.host_optimizer_bytes), " MiB")
                                 : std::string(),
             r.host_parameter_bytes > 0 ? str("; the parameter shards on the host: ", mib(r.host_parameter_bytes), " MiB")
                                        : std::string(),
             " (ZeRO stage ", r.stage, r.hybrid ? " hybrid" : "", ", ", r.policy, r.plan.empty() ? "" : " ", r.plan,
             ")", device_capacity_bytes > 0 ? "; " + capacity_text(*this) : std::string());
}

nlohmann::json MemoryEstimate::to_json() const {
  nlohmann::json rows_json = nlohmann::json::array();
  for (const auto& r : rows) {
    rows_json.push_back({{"stage", r.stage}, {"hybrid", r.hybrid}, {"policy", r.policy}, {"offload", r.offload},
                         {"configured", r.configured}, {"feasible", r.feasible}, {"plan", r.plan},
                         {"parameter_bytes", r.parameter_bytes}, {"gradient_bytes", r.gradient_bytes},
                         {"optimizer_bytes", r.optimizer_bytes}, {"gathered_bytes", r.gathered_bytes},
                         {"activation_bytes", r.activation_bytes}, {"host_bytes", r.host_bytes},
                         {"comm_bytes", r.comm_bytes}, {"other_bytes", r.other_bytes},
                         {"peak_bytes", r.peak_bytes}, {"offload_optimizer", r.offload_optimizer},
                         {"host_optimizer_bytes", r.host_optimizer_bytes},
                         {"offload_optimizer_peak_bytes", r.offload_optimizer_peak_bytes}});
    // Written only when the config offloads: other estimates' keys stay as they are.
    if (offload_param) rows_json.back()["host_parameter_bytes"] = r.host_parameter_bytes;
    if (offload_param || offload_optimizer) rows_json.back()["no_offload_peak_bytes"] = r.no_offload_peak_bytes;
  }
  nlohmann::json out = {{"mode", mode}, {"world_size", world_size}, {"dp", dp}, {"tp", tp},
                        {"shard_group", shard_group}, {"rows", rows_json}};
  if (!host_is_device) out["host_is_device"] = false;
  if (offload_param) out["offload_param"] = true;
  if (device_capacity_bytes > 0) out["device_capacity_bytes"] = device_capacity_bytes;
  return out;
}

MemoryEstimateInputs cold_gpt_inputs(const Config& config, int64_t vocab_size, int64_t micro_batch,
                                     c10::DeviceType device) {
  const auto& m = config.model;
  const int64_t tp = config.tensor_parallel.size;
  const int64_t B = micro_batch, T = m.seq_len, C = m.d_model, H = m.n_head / tp, F = m.d_ff / tp, V = vocab_size,
                L = m.n_layer;
  MemoryEstimateInputs in;
  // Parameters (models/gpt.h): the embeddings, per block LayerNorms, qkv,
  // proj, fc1, fc2 (the column-parallel ones split over tp), ln_f and head.
  auto add = [&](int64_t numel, int unit) { in.parameters.push_back({numel, true, unit}); };
  add((V + tp - 1) / tp * C, -1);
  add(T * C, -1);
  for (int u = 0; u < L; ++u) {
    add(C, u), add(C, u);                      // ln1
    add(C * 3 * C / tp, u), add(3 * C / tp, u);  // qkv
    add(C / tp * C, u), add(C, u);             // proj
    add(C, u), add(C, u);                      // ln2
    add(C * F, u), add(F, u);                  // fc1
    add(F * C, u), add(C, u);                  // fc2
  }
  add(C, -1), add(C, -1);                      // ln_f
  add(C * ((V + tp - 1) / tp), -1);            // head
  // Activations, float32, per block (B batch, T time, C width, H heads and F
  // MLP width on this rank): LayerNorm outputs and statistics, q|k|v, the
  // softmax output and the dropped-out probabilities, the attention output,
  // the residual, fc1 and GELU outputs, and the dropout masks (ATen's CPU
  // dropout keeps float32 masks of the input's size). selective_op keeps the
  // projections' outputs; a full checkpoint its input alone.
  // In double, saturated: absurd sizes give absurd estimates, not overflows.
  // With sequence parallelism what lies between the tensor-parallel layers
  // (LayerNorm outputs and statistics, the residual and its dropout masks,
  // the block's input and output) is 1/tp of the sequence on each rank.
  const double b = static_cast<double>(B), t = static_cast<double>(T), btc = b * t * C, bhtt = b * H * t * t,
               btf = b * t * F;
  const double sp = config.tensor_parallel.sequence_parallel_active() ? static_cast<double>(tp) : 1.0;
  auto bytes_of = [](double x) { return static_cast<int64_t>(std::min(x, 0x1p50)); };
  // Bytes per activation element: bf16 or fp16 computes in 16 bits, its
  // saved tensors and dropout masks included; the loss is float32 either way.
  const bool half = config.bf16.enabled || config.fp16.enabled;
  const double a = half ? 2 : 4;
  // The attention's scores, probabilities and mask, and its q, k, v: float32
  // where LibTorch's attention computes reduced precision in float32.
  const double att = half && REMAT_SDPA_MATH_UPCASTS ? 4 : a;
  const int64_t block = bytes_of(a * ((3 * btc + 4 * b * t) / sp + 4 * btc + 2 * btf) + att * 3 * bhtt +
                                 (att - a) * 3 * btc + a * 2 * btc / sp);
  const int64_t boundary = bytes_of(a * btc / sp);
  const int64_t kept = bytes_of(a * (3 * btc + btc / sp + btf + btc / sp));
  // The embeddings (ids, dropout mask) and the head (the last output, ln_f
  // statistics and output, the log-softmax output in float32).
  const int64_t ends =
      bytes_of(8 * (b * t + t) + a * btc / sp + a * (btc + 2 * b * t + btc) / sp + 4 * b * t * V);
  BlockActivationBytes bytes;
  bytes.boundary = boundary;
  bytes.saved = block;
  bytes.selective_op = kept;
  bytes.embedding = bytes_of(8 * (b * t + t) + a * btc / sp);
  // save_collectives: per block two all-reduces' outputs, or with sequence
  // parallelism two all-gathers' (the whole sequence) and two reduce-scatters'.
  if (config.activation_checkpointing.save_collectives && tp > 1) {
    bytes.checkpoint_kept = bytes_of(a * (2 * btc + (sp > 1 ? 2 * btc / sp : 0)));
  }
  bytes.ends = ends;
  bytes.head_backward = bytes_of(2 * 4 * b * t * V);
  return cold_inputs(std::move(in.parameters), static_cast<int>(L), bytes, device);
}

MemoryEstimateInputs cold_inputs(std::vector<ParameterSize> parameters, int n_blocks,
                                 const BlockActivationBytes& bytes, c10::DeviceType device) {
  REMAT_CHECK(n_blocks > 0, "memory estimate: the model has no blocks");
  MemoryEstimateInputs in;
  in.mode = "cold";
  in.parameters = std::move(parameters);
  in.gradients_in_activations = false;
  in.host_is_device = device == c10::DeviceType::CPU;  // on a GPU the host copies are apart
  const int64_t boundary = bytes.boundary, block = bytes.saved, kept = bytes.selective_op;
  BlockCosts& c = in.activations;
  c.choices = {BlockChoice::kKeep, BlockChoice::kSelectiveOp, BlockChoice::kFull, BlockChoice::kFullOffload,
               BlockChoice::kOffloadActivations};
  for (int i = 0; i < n_blocks; ++i) {
    std::vector<ChoiceCost> row(5);
    row[0].held_bytes = boundary + block;
    row[1].held_bytes = boundary + kept + bytes.checkpoint_kept;
    row[2].held_bytes = boundary + bytes.checkpoint_kept;
    // The input moves to the host: cpu_checkpointing's host copy is made
    // through c10's allocator, so on a CPU model it is counted where it was.
    row[3].held_bytes = bytes.checkpoint_kept + (in.host_is_device ? boundary : 0);
    row[4].held_bytes = 0;  // everything it saves moves to the host (an arena outside c10's allocator)
    for (auto& x : row) x.forward_peak_bytes = boundary + block;
    // Offloaded as they are saved: about half the block's saved bytes are on
    // the device at once during its forward, as in its backward.
    row[4].forward_peak_bytes = boundary + block / 2;
    row[0].transient_bytes = 0;
    row[1].transient_bytes = block;
    row[2].transient_bytes = block;
    row[3].transient_bytes = block + boundary;  // restored, then recomputed
    // Restored one saved tensor at a time as the backward reaches it, each
    // freed after its use: about half the block's saved bytes are back at
    // once (0.51 in the GPT's live profile), not all of them.
    row[4].transient_bytes = block / 2;
    // No time is measured cold: a block's recompute in units of its
    // forward (selective_op recomputes the cheap ops only), so that the auto
    // row prefers keeping, then selective_op, then full.
    row[1].extra_cpu_ms = row[1].extra_wall_ms = 0.3;
    row[2].extra_cpu_ms = row[2].extra_wall_ms = 1.0;
    row[3].extra_cpu_ms = row[3].extra_wall_ms = 1.1;
    row[4].extra_cpu_ms = row[4].extra_wall_ms = 0.2;
    c.blocks.push_back(row);
    in.host_bytes.push_back({0, 0, 0, boundary, boundary + block});
  }
  // The head's backward runs with every block's saved tensors still live.
  c.forward_base = bytes.ends + bytes.head_backward;
  c.forward_live_base = bytes.embedding;
  c.backward_base = bytes.ends;
  c.fixed_peak = bytes.ends;
  c.keep_peak = predict_peak(c, std::vector<size_t>(static_cast<size_t>(n_blocks), 0));
  return in;
}

MemoryEstimateInputs live_inputs(torch::nn::Module& model, const std::string& blocks,
                                 const std::function<void()>& step) {
  MemoryEstimateInputs in;
  in.mode = "live";
  in.gradients_in_activations = true;
  // Which block each parameter belongs to: by address, through the block list.
  std::map<const void*, int> unit_of;
  std::shared_ptr<torch::nn::Module> list;
  for (const auto& item : model.named_modules()) {
    if (item.key() == blocks) list = item.value();
  }
  if (!list) throw ConfigError(str("memory estimate: the model has no module '", blocks, "' (the block list)"));
  int u = 0;
  for (const auto& block : list->children()) {
    for (const auto& p : block->parameters()) unit_of[p.unsafeGetTensorImpl()] = u;
    ++u;
  }
  in.host_is_device = true;
  for (const auto& p : model.parameters()) {
    auto it = unit_of.find(p.unsafeGetTensorImpl());
    in.parameters.push_back({p.numel(), p.requires_grad(), it == unit_of.end() ? -1 : it->second});
    in.element_bytes = static_cast<int64_t>(p.element_size());
    if (!p.device().is_cpu()) in.host_is_device = false;
  }
  for (const auto& b : model.buffers()) in.other_bytes += static_cast<int64_t>(b.nbytes());
  PlannerOptions options;
  options.blocks = blocks;
  options.rounds = 1;
  options.choices = {BlockChoice::kSelectiveOp, BlockChoice::kFull, BlockChoice::kFullOffload,
                     BlockChoice::kOffloadActivations};
  in.activations = profile_activation_choices(model, step, options);
  for (const auto& block : in.activations.blocks) {
    std::vector<int64_t> host;
    for (const ChoiceCost& cost : block) host.push_back(cost.host_bytes);
    in.host_bytes.push_back(std::move(host));
  }
  return in;
}

}  // namespace remat
