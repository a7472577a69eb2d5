#include "trainer.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "checkpointing/checkpoint.h"
#include "engine/engine.h"
#include "engine/memory_estimate.h"
#include "parallel/tensor_split.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/context.h"
#include "runtime/layout.h"

namespace llama {
namespace {

// A byte-level corpus generated from a small grammar: the same text every run,
// with enough structure for the loss to fall within a few dozen steps.
class Corpus {
 public:
  Corpus() {
    const char* subjects[] = {"the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"};
    const char* verbs[] = {"sees", "follows", "likes", "draws", "finds", "calls"};
    const char* objects[] = {"the river", "a red ball", "the tall tree", "an open door", "the moon", "a letter"};
    std::mt19937 gen(7);
    auto pick = [&](auto& list) { return list[gen() % (sizeof(list) / sizeof(list[0]))]; };
    while (text_.size() < 16384) {
      const unsigned a = gen() % 10, b = gen() % 10;
      text_ += std::string(pick(subjects)) + " " + pick(verbs) + " " + pick(objects) + ". " + std::to_string(a) +
               " plus " + std::to_string(b) + " is " + std::to_string(a + b) + ".\n";
    }
    const std::set<unsigned char> bytes(text_.begin(), text_.end());
    std::vector<int64_t> index(256, -1);
    for (unsigned char c : bytes) index[c] = vocab_++;
    tokens_ = at::empty({static_cast<int64_t>(text_.size())}, at::kLong);
    auto* t = tokens_.data_ptr<int64_t>();
    for (size_t i = 0; i < text_.size(); ++i) t[i] = index[static_cast<unsigned char>(text_[i])];
  }

  int64_t vocab_size() const { return vocab_; }
  int64_t size() const { return tokens_.numel(); }

  // The micro-batch of (step, micro-step, data-parallel rank): inputs and
  // next-token targets [rows, T]. A function of its arguments only, so a run
  // resumed at step k reads what the uninterrupted run read there; it draws
  // nothing from LibTorch's generators (dropout's).
  std::pair<at::Tensor, at::Tensor> batch(int64_t seed, int64_t step, int64_t micro, int64_t rank, int64_t rows,
                                          int64_t T) const {
    std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(step), static_cast<uint32_t>(micro),
                      static_cast<uint32_t>(rank)};
    std::mt19937_64 gen(seq);
    std::uniform_int_distribution<int64_t> start(0, size() - T - 1);
    std::vector<at::Tensor> x, y;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = start(gen);
      x.push_back(tokens_.narrow(0, s, T));
      y.push_back(tokens_.narrow(0, s + 1, T));
    }
    return {at::stack(x), at::stack(y)};
  }

 private:
  std::string text_;
  at::Tensor tokens_;
  int64_t vocab_ = 0;
};

// Every parameter's whole shape (what the export holds), whatever share of
// it this rank holds under tensor parallelism.
void write_parameter_list(const std::string& path, LlamaImpl& model) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write --params file '" + path + "'");
  for (const auto& [name, split] : remat::parallel::parameter_splits(model)) {
    std::string shape;
    for (int64_t d : split.full_sizes) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    std::fprintf(f, "%s %s\n", name.c_str(), shape.c_str());
  }
  std::fclose(f);
}

// Copies every tensor of an export (a {name: tensor} dictionary, whole
// tensors) into the parameter of that name, this rank's share of it under
// tensor parallelism. Parameters the file lacks keep their initial values
// (LoRA's adapters); a tensor the model lacks, or of another shape, is an error.
// A bf16 or fp16 export (stage3_gather_16bit_weights_on_model_save) is widened
// to the parameters' float32 by the copy.
void load_weights(const std::string& path, LlamaImpl& model, const remat::ParallelLayout& layout) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read --base file '" + path + "'");
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const c10::Dict<c10::IValue, c10::IValue> dict = torch::jit::pickle_load(bytes).toGenericDict();
  auto parameters = model.named_parameters();
  std::map<std::string, remat::parallel::TensorSplit> splits;
  for (auto& [name, split] : remat::parallel::parameter_splits(model)) splits[name] = std::move(split);
  at::NoGradGuard no_grad;
  for (const auto& entry : dict) {
    const std::string name = entry.key().toStringRef();
    const at::Tensor value = entry.value().toTensor();
    at::Tensor* p = parameters.find(name);
    if (!p) throw std::runtime_error("--base '" + path + "': the model has no parameter '" + name + "'");
    const remat::parallel::TensorSplit& split = splits.at(name);
    if (value.sizes().vec() != split.full_sizes) {
      throw std::runtime_error("--base '" + path + "': '" + name + "' has shape " + c10::str(value.sizes()) +
                               ", the model's is " + c10::str(c10::IntArrayRef(split.full_sizes)));
    }
    p->copy_(remat::parallel::share_of(value, split, layout.dims().tp, layout.tp_rank()));
  }
}

}  // namespace

remat::PretrainedOptions hf_llama_names(bool lora) {
  remat::PretrainedOptions o;
  const std::string layer = "model\\.layers\\.(\\d+)\\.";
  o.rename = {
      {"model\\.embed_tokens\\.weight", "tok_emb.weight"},
      {layer + "self_attn\\.q_proj\\.weight", "blocks.$1.wq.weight"},
      {layer + "self_attn\\.k_proj\\.weight", "blocks.$1.wk.weight"},
      {layer + "self_attn\\.v_proj\\.weight", "blocks.$1.wv.weight"},
      {layer + "self_attn\\.o_proj\\.weight", "blocks.$1.wo.weight"},
      {layer + "mlp\\.gate_proj\\.weight", "blocks.$1.w1.weight"},
      {layer + "mlp\\.up_proj\\.weight", "blocks.$1.w3.weight"},
      {layer + "mlp\\.down_proj\\.weight", "blocks.$1.w2.weight"},
      {layer + "input_layernorm\\.weight", "blocks.$1.attn_norm.weight"},
      {layer + "post_attention_layernorm\\.weight", "blocks.$1.mlp_norm.weight"},
      {"model\\.norm\\.weight", "norm.weight"},
  };
  o.ignore = ".*\\.rotary_emb\\.inv_freq";
  if (lora) o.allow_missing = ".*\\.lora_[ab]";
  return o;
}

void add_flags(CLI::App& app, ExampleArgs& a, const std::string& default_config) {
  a.config = default_config;
  app.add_option("--config", a.config, "DeepSpeed-style JSON config")->capture_default_str();
  app.add_option("--set", a.sets, "override a config key, e.g. --set zero_optimization.stage=3 (repeatable)");
  app.add_option("--steps", a.steps, "optimizer steps in all (train.steps); a resumed run stops there too");
  app.add_option("--seed", a.seed, "train.seed: initial weights, dropout and the data order");
  app.add_option("--save-dir", a.save_dir, "save the training state here after the last step");
  app.add_option("--resume", a.resume, "continue from this save (its root or a step folder)");
  app.add_option("--export", a.export_path, "after training, write every parameter whole to this file "
                 "(a {name: tensor} dictionary for torch.load)");
  app.add_option("--export-initial", a.export_initial, "the same, before the first step");
  app.add_option("--losses", a.losses, "write 'step loss' per optimizer step here (rank 0, %.17g)");
  app.add_option("--base", a.base, "start from the weights of this export (e.g. the llama example's --export)");
  app.add_option("--pretrained", a.pretrained, "start from the weights of this safetensors file, sharded set's "
                 "index or folder: a Hugging Face LLaMA checkpoint of this shape (hf_llama_names) or the "
                 "example's own safetensors --export; loaded after initialize, each rank reading its share");
  app.add_flag("--eval", a.eval, "print 'eval loss L' before training and 'final eval loss L' after it (%.17g): "
               "the loss of a fixed batch, the same on every rank, in eval mode (no dropout)");
  app.add_option("--params", a.params, "write 'name d0,d1,...' per model parameter here (rank 0)");
  app.add_option("--estimate-memory", a.estimate_memory, "before training, write remat's memory estimate per rank "
                 "(every ZeRO stage x policy; cold from the sizes, live from one profiled step) here as JSON");
  app.add_option("--kv-heads", a.kv_heads, "key/value heads of grouped-query attention (divides model.n_head)")
      ->capture_default_str();
  app.add_flag("--no-rng-replay", a.no_rng_replay,
               "test seam: checkpoint regions recompute without the forward's random state");
  app.add_flag("--perturb-rng", a.perturb_rng, "test seam: one extra draw from the default generator before training");
}

int train(const ExampleArgs& args, const std::function<void(LlamaImpl&)>& prepare) {
  if (!args.pretrained.empty() && (!args.resume.empty() || !args.base.empty())) {
    throw remat::ConfigError(std::string("--pretrained and ") + (args.resume.empty() ? "--base" : "--resume") +
                             " both give the starting weights: pass one (a save holds its weights already: "
                             "fine-tune from --pretrained, then --resume its saves)");
  }
  std::vector<std::string> overrides = args.sets;
  if (args.steps) overrides.push_back("train.steps=" + std::to_string(*args.steps));
  if (args.seed) overrides.push_back("train.seed=" + std::to_string(*args.seed));
  const remat::Config config = remat::load_config(args.config, overrides);
  remat::MemoryTracker memory;  // before the model: its parameters count in the step's peak
  // The processes, and every generator seeded from train.seed: the model is built after it.
  auto layout = remat::init_distributed(config);
  const bool rank0 = layout->rank() == 0;

  const Corpus corpus;
  LlamaOptions options;
  options.vocab_size = corpus.vocab_size();
  options.n_layer = config.model.n_layer;
  options.n_head = config.model.n_head;
  options.n_kv_head = args.kv_heads;
  options.d_model = config.model.d_model;
  options.d_ff = config.model.d_ff;
  options.seq_len = config.model.seq_len;
  options.dropout = config.model.dropout;
  options.lora_rank = args.lora_rank;
  // Tensor parallelism: the projections, the embedding and the head split
  // across the layout's tensor-parallel group (tensor_parallel.size).
  options.tensor_parallel = layout->tp_group();
  options.sequence_parallel = config.tensor_parallel.sequence_parallel;
  options.replicated_sequence_dropout =
      config.tensor_parallel.sequence_parallel_dropout == remat::models::SequenceParallelDropout::kReplicated;
  Llama model(options);
  if (!args.base.empty()) load_weights(args.base, *model, *layout);
  if (prepare) prepare(*model);
  int64_t trainable = 0, frozen = 0;
  for (const auto& p : model->parameters()) (p.requires_grad() ? trainable : frozen) += p.numel();
  if (rank0 && !args.params.empty()) write_parameter_list(args.params, *model);

  if (!args.estimate_memory.empty() && layout->dims().tp > 1) {
    // The live profile runs the model on rank 0 alone; split layers would
    // wait there for the rest of their group.
    throw remat::ConfigError("--estimate-memory profiles the model on rank 0 alone, which a model split across "
                             "tensor_parallel.size = " + std::to_string(layout->dims().tp) +
                             " ranks cannot run: estimate at tensor_parallel.size 1");
  }
  if (rank0 && !args.estimate_memory.empty()) {
    // Rank 0 alone, before the engine: the profile runs the plain model (its
    // random state and gradients are put back afterwards).
    const int world = layout->dims().dp * layout->dims().tp;
    const int64_t micro = config.resolve_batch(layout->dims().dp).micro_batch_per_gpu;
    at::Tensor x, y;
    std::tie(x, y) = corpus.batch(config.train.seed, 1, 0, 0, micro, options.seq_len);
    const remat::MemoryEstimate cold = remat::estimate_memory(config, world, cold_memory_inputs(options, micro));
    const remat::MemoryEstimate live = remat::estimate_memory(
        config, world, remat::live_inputs(*model, "blocks", [&] { model->loss(x, y).backward(); }));
    std::ofstream out(args.estimate_memory);
    out << nlohmann::json{{"cold", cold.to_json()}, {"live", live.to_json()}}.dump(1) << "\n";
    if (!out) throw std::runtime_error("cannot write --estimate-memory file '" + args.estimate_memory + "'");
    std::printf("%s\n%s\n", cold.line().c_str(), live.line().c_str());
  }

  remat::EngineOptions engine_options;
  engine_options.memory = &memory;
  engine_options.layout = layout;
  engine_options.model_signature = options.to_string();
  auto engine = remat::initialize(model, config, engine_options);
  if (args.no_rng_replay) {
    remat::ContextScope scope(engine->context());  // the engine's own checkpointing defaults
    remat::default_checkpoint_options().preserve_rng_state = false;
  }

  const remat::BatchSizes batch = config.resolve_batch(layout->dims().dp);
  if (!args.pretrained.empty()) {
    const remat::PretrainedReport r = engine->load_pretrained(args.pretrained, hf_llama_names(args.lora_rank > 0));
    if (rank0) {
      std::printf("loaded '%s': %lld tensors, %lld kept as initialised, %lld ignored; rank 0 read %lld of %lld "
                  "bytes in %.3f s\n", args.pretrained.c_str(), static_cast<long long>(r.loaded),
                  static_cast<long long>(r.kept), static_cast<long long>(r.ignored),
                  static_cast<long long>(r.bytes_read), static_cast<long long>(r.file_bytes), r.seconds);
    }
  }
  if (!args.resume.empty()) {
    engine->load_checkpoint(args.resume);
    if (rank0) std::printf("resumed from '%s' at step %lld\n", args.resume.c_str(),
                           static_cast<long long>(engine->global_steps()));
  }
  // --eval: a fixed batch (the same on every rank, whatever the layout), in eval mode.
  auto evaluate = [&](const char* label) {
    if (!args.eval) return;
    at::Tensor x, y;
    std::tie(x, y) = corpus.batch(config.train.seed, 0, 0, 0, 4, options.seq_len);
    x = engine->to_device(x);
    y = engine->to_device(y);
    const double loss = engine->evaluate([&] { return model->loss(x, y); }).item<double>();
    if (rank0) std::printf("%s %.17g\n", label, loss);
  };
  evaluate("eval loss");
  if (args.perturb_rng) at::randn({1});
  if (!args.export_initial.empty()) engine->export_model(args.export_initial);
  if (rank0) {
    std::printf("%s: %lld parameters trained, %lld frozen (on this rank); %d ranks, tp %d%s, ZeRO stage %d, "
                "checkpointing %s, activation offloading %s, batch %lld = micro %lld x accumulation %lld x dp %d\n",
                options.to_string().c_str(), static_cast<long long>(trainable), static_cast<long long>(frozen),
                layout->dims().dp * layout->dims().tp, layout->dims().tp,
                options.sequence_parallel_active() ? " (sequence parallel)" : "",
                config.zero_optimization.stage, remat::checkpoint_variant_name(config.activation_checkpointing.variant).c_str(),
                config.activation_offloading.enabled ? "on" : "off", static_cast<long long>(batch.train_batch_size),
                static_cast<long long>(batch.micro_batch_per_gpu),
                static_cast<long long>(batch.gradient_accumulation_steps), layout->dims().dp);
  }

  FILE* losses = nullptr;
  if (rank0 && !args.losses.empty()) {
    losses = std::fopen(args.losses.c_str(), "w");
    if (!losses) throw std::runtime_error("cannot write --losses file '" + args.losses + "'");
  }
  const int64_t first = engine->global_steps() + 1;
  const auto t0 = std::chrono::steady_clock::now();
  while (engine->global_steps() < config.train.steps) {
    const int64_t step = engine->global_steps() + 1;
    for (int64_t micro = 0; micro < batch.gradient_accumulation_steps; ++micro) {
      at::Tensor x, y;
      std::tie(x, y) = corpus.batch(config.train.seed, step, micro, layout->dp_rank(), batch.micro_batch_per_gpu,
                                    options.seq_len);
      // Onto the device the engine placed the model on (train.device); the same tensors on the CPU.
      x = engine->to_device(x);
      y = engine->to_device(y);
      at::Tensor loss = engine->forward([&] { return model->loss(x, y); });
      engine->backward(loss);
      engine->step();
    }
    const remat::StepMetrics& m = engine->last_metrics();
    if (losses) std::fprintf(losses, "%lld %.17g\n", static_cast<long long>(m.step), m.loss);
    if (rank0 && m.plan.is_object() && m.plan.value("act_planned", false)) {
      std::printf("step %lld: activation plan %s\n", static_cast<long long>(step), m.plan["act_plan"].dump().c_str());
    }
    if (rank0 && (step % config.steps_per_print == 0 || step == config.train.steps)) {
      std::printf("step %lld loss %.4f lr %.3g (%.0f ms)\n", static_cast<long long>(step), m.loss, m.lr, m.step_ms);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (losses) std::fclose(losses);
  if (rank0 && engine->global_steps() >= first) {
    std::printf("trained steps %lld-%lld in %.2f s\n", static_cast<long long>(first),
                static_cast<long long>(engine->global_steps()), seconds);
    // What the last step did (recompute time, offloaded bytes, ...): one JSON object.
    std::printf("last step metrics: %s\n", engine->last_metrics().to_json().dump().c_str());
  }
  evaluate("final eval loss");
  if (!args.save_dir.empty()) {
    const std::string folder = engine->save_checkpoint(args.save_dir);
    if (rank0) std::printf("saved %s\n", folder.c_str());
  }
  if (!args.export_path.empty()) {
    const int64_t bytes = engine->export_model(args.export_path);
    if (rank0) std::printf("exported %s (%lld bytes)\n", args.export_path.c_str(), static_cast<long long>(bytes));
  }
  return 0;
}

}  // namespace llama
