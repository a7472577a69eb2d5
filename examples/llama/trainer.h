// The training driver the Llama and LoRA examples share: flags, a generated
// byte-level corpus, and the loop through remat's engine.
//
//   llama::ExampleArgs args;
//   CLI::App app("...");
//   llama::add_flags(app, args);
//   CLI11_PARSE(app, argc, argv);
//   return remat::run_main([&] { return llama::train(args, options, prepare); });
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model.h"

namespace llama {

struct ExampleArgs {
  std::string config;               // the DeepSpeed-style JSON
  std::vector<std::string> sets;    // "a.b=value" overrides (--set)
  std::optional<int64_t> steps;     // train.steps
  std::optional<int64_t> seed;      // train.seed
  std::string save_dir;             // save at the end
  std::string resume;               // a save (step folder or save root) to continue from
  std::string export_path;          // the whole model after training
  std::string export_initial;       // the whole model before the first step
  std::string losses;               // "step loss" per optimizer step (rank 0)
  std::string params;               // "name d0,d1,..." per parameter (rank 0)
  std::string base;                 // start from these weights (an --export of the same shape)
  std::string pretrained;           // start from a safetensors file or set (hf_llama_names)
  bool eval = false;                // print the loss of a fixed batch, in eval mode, before and after training
  std::string estimate_memory;       // remat's memory estimate (cold and live) as JSON (rank 0)
  int64_t kv_heads = 2;
  int64_t lora_rank = 0;
  // Test seams, to show that the parity checks can fail: checkpoint regions
  // recompute without replaying the forward's random state, or the default
  // generator is moved on by one draw before training.
  bool no_rng_replay = false;
  bool perturb_rng = false;
};

// How a Hugging Face LLaMA checkpoint's names (model.safetensors, or shards
// with model.safetensors.index.json) map onto this example's, for
// Engine::load_pretrained: model.embed_tokens -> tok_emb,
// model.layers.N.self_attn.{q,k,v,o}_proj -> blocks.N.{wq,wk,wv,wo},
// model.layers.N.mlp.{gate,up,down}_proj -> blocks.N.{w1,w3,w2},
// input_layernorm -> attn_norm, post_attention_layernorm -> mlp_norm,
// model.norm -> norm; lm_head keeps its name. Names of the example's own
// (its --export) match no rule and stay, so the same options load both. The
// rotary tables some files carry (rotary_emb.inv_freq) are ignored: the
// example makes its own. With `lora`, the adapters (lora_a, lora_b) are
// allowed missing and keep their initial values (B = 0: the model starts as
// the pretrained one).
//
// The example rotates the (first half, second half) pairs of each head
// (model.cc, apply_rotary), the layout Hugging Face's LLaMA checkpoints store
// q_proj and k_proj for, so their rows load as they are: no permutation.
// A checkpoint with tied embeddings (no lm_head.weight) lacks the head: the
// load names it missing.
remat::PretrainedOptions hf_llama_names(bool lora);

// Adds every flag above; `default_config` is the example's own JSON.
void add_flags(CLI::App& app, ExampleArgs& args, const std::string& default_config);

// Trains `base` (its shape from the config's model section, the vocabulary
// from the corpus, kv heads and LoRA rank from the flags). `prepare` runs on
// the model after it is built and before remat::initialize (LoRA freezes the
// base weights there). Collective; returns the exit code.
int train(const ExampleArgs& args, const std::function<void(LlamaImpl&)>& prepare = {});

}  // namespace llama
