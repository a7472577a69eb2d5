// Test and benchmark support: the pickle archive of a name -> tensor dict as
// LibTorch writes it at once (Pickler, then writeArchiveAndTensors), in
// memory. engine/export_test.cc compares remat's streamed pickle with it byte
// for byte; benchmarks/export_bench.cc writes it as the export before it
// streamed did.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <string>
#include <utility>
#include <vector>

namespace remat::testing {

// The archive's bytes. `copy`: each tensor pickled from a contiguous copy of
// its own (a view into a larger storage is written as remat's export writes
// it); else as given (whole contiguous tensors, as a benchmark holds them,
// without a second copy in memory).
inline std::string pickle_archive_at_once(const std::vector<std::pair<std::string, at::Tensor>>& params,
                                          bool copy) {
  c10::Dict<std::string, at::Tensor> dict;
  std::vector<at::Tensor> held;  // the caller holds each tensor too, as an export's caller does
  held.reserve(params.size());
  for (const auto& [name, value] : params) {
    held.push_back(copy ? value.contiguous().clone() : value);
    dict.insert(name, held.back());
  }
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* data, size_t size) { pickled.insert(pickled.end(), data, data + size); },
                              nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();
  std::string bytes;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
      bytes.append(static_cast<const char*>(data), size);
      return size;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  }
  return bytes;
}

}  // namespace remat::testing
