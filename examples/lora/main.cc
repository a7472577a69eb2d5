// LoRA fine-tuning of the Llama example's model through remat's engine: the
// base weights are frozen (requires_grad false), only the low-rank adapters
// of every projection train, and activation offloading is on. It runs at
// every ZeRO stage:
//
//   mpirun -np 2 ./lora                                   # examples/lora/ds_config.json
//   mpirun -np 2 ./lora --set zero_optimization.stage=3 --export-initial before.pt --export after.pt
//
// The model is examples/llama/model.cc, built into this executable.
#include <CLI/CLI.hpp>

#include "runtime/runtime.h"
#include "trainer.h"

int main(int argc, char** argv) {
  llama::ExampleArgs args;
  args.lora_rank = 4;
  CLI::App app("LoRA fine-tuning of a small Llama-style decoder through remat::initialize");
  llama::add_flags(app, args, LORA_EXAMPLE_CONFIG);
  app.add_option("--lora-rank", args.lora_rank, "rank of the adapters (> 0)")->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  return remat::run_main([&] { return llama::train(args, [](llama::LlamaImpl& model) { model.freeze_base(); }); });
}
