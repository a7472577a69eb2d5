#include "rng/rng_state_io.h"

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <sstream>

namespace remat {
namespace {

void write_states(torch::serialize::OutputArchive& archive, const std::string& prefix,
                  const GeneratorStates& states) {
  archive.write(prefix + "/cpu", states.cpu);
  if (states.cuda.defined()) archive.write(prefix + "/cuda", states.cuda.cpu());
}

GeneratorStates read_states(torch::serialize::InputArchive& archive, const std::string& prefix) {
  GeneratorStates states;
  archive.read(prefix + "/cpu", states.cpu);
  // A CUDA generator takes its state as a CPU byte tensor too.
  at::Tensor cuda;
  if (archive.try_read(prefix + "/cuda", cuda)) states.cuda = cuda;
  return states;
}

}  // namespace

void write_rng_snapshot(torch::serialize::OutputArchive& archive, const RngSnapshot& snapshot) {
  write_states(archive, "default", snapshot.defaults);
  std::string names;
  for (const auto& [name, states] : snapshot.tracker) {
    names += (names.empty() ? "" : "\n") + name;
    write_states(archive, "tracker/" + name, states);
  }
  archive.write("tracker_names", c10::IValue(names));
}

RngSnapshot read_rng_snapshot(torch::serialize::InputArchive& archive) {
  RngSnapshot snapshot;
  snapshot.defaults = read_states(archive, "default");
  c10::IValue names;
  archive.read("tracker_names", names);
  std::stringstream list(names.toStringRef());
  std::string name;
  while (std::getline(list, name)) {
    if (!name.empty()) snapshot.tracker[name] = read_states(archive, "tracker/" + name);
  }
  return snapshot;
}

}  // namespace remat
