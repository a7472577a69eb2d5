// remat's safetensors reader and writer from the command line, for
// tests/safetensors_test.sh to check them against Python's.
//
//   safetensors_tool dump PATH          a file, an index or a folder: one line a
//                                       tensor, "name dtype [shape] hex-of-its-bytes"
//   safetensors_tool write OUT [SHARD]  the fixed set below (SHARD > 0: shards of
//                                       at most SHARD bytes in the folder OUT)
//
// A refused file prints its error and exits 1.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "engine/safetensors.h"
#include "runtime/error.h"

namespace {

std::string hex(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  std::string out;
  char two[3];
  for (int64_t i = 0; i < c.numel() * c.element_size(); ++i) {
    std::snprintf(two, sizeof two, "%02x", p[i]);
    out += two;
  }
  return out.empty() ? "-" : out;
}

int dump(const std::string& path) {
  const remat::SafetensorsSet set = remat::SafetensorsSet::open(path);
  for (const auto& name : set.names()) {
    const remat::SafetensorsEntry* e = set.find(name);
    std::string shape = "[";
    for (size_t i = 0; i < e->shape.size(); ++i) shape += (i ? "," : "") + std::to_string(e->shape[i]);
    std::cout << name << " " << remat::safetensors_dtype_name(e->dtype) << " " << shape << "] "
              << hex(set.tensor(name)) << "\n";
  }
  return 0;
}

// Exact in every dtype: i/8 - 3 (dyadic), big integers, a pattern of bools,
// a zero-size tensor and a scalar; tests/safetensors_test.sh builds the same.
int write(const std::string& out, int64_t shard_bytes) {
  const at::Tensor f = at::arange(24, at::kFloat).reshape({4, 6}) / 8 - 3;
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"model.embed.weight", f},
      {"model.norm.weight", f.to(at::kBFloat16).t()},  // a view: written as its value
      {"model.half", f.slice(0, 0, 2).to(at::kHalf)},
      {"model.steps", at::arange(5, at::kLong) * (int64_t(1) << 40) - 7},
      {"model.mask", at::arange(7, at::kLong).remainder(3).eq(0)},
      {"model.empty", at::zeros({0, 3})},
      {"model.scale", at::scalar_tensor(0.5, at::kDouble)},
  };
  std::vector<remat::SafetensorsPlanned> plan;
  for (const auto& [name, value] : tensors) plan.push_back({name, value.scalar_type(), value.sizes().vec()});
  remat::SafetensorsWriter writer(out, plan, {shard_bytes, {{"format", "pt"}}});
  for (const auto& [name, value] : tensors) writer.write(name, value);
  writer.finish();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = argc > 2 ? argv[1] : "";
  try {
    if (command == "dump" && argc == 3) return dump(argv[2]);
    if (command == "write" && (argc == 3 || argc == 4)) return write(argv[2], argc == 4 ? std::atoll(argv[3]) : 0);
  } catch (const remat::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "usage: safetensors_tool dump PATH | write OUT [SHARD_BYTES]\n";
  return 2;
}
