// A Llama-style model trained through remat's engine from a DeepSpeed-style
// config. Run it on two ranks:
//
//   mpirun -np 2 ./llama                                  # examples/llama/ds_config.json
//   mpirun -np 2 ./llama --set zero_optimization.stage=3 --set activation_checkpointing.variant=full
//
// The model's shape comes from the config's model section (n_layer, n_head,
// d_model, d_ff, seq_len, dropout); --kv-heads sets grouped-query attention.
#include <CLI/CLI.hpp>

#include "runtime/runtime.h"
#include "trainer.h"

int main(int argc, char** argv) {
  llama::ExampleArgs args;
  CLI::App app("Trains a small Llama-style decoder through remat::initialize");
  llama::add_flags(app, args, LLAMA_EXAMPLE_CONFIG);
  CLI11_PARSE(app, argc, argv);
  return remat::run_main([&] { return llama::train(args); });
}
