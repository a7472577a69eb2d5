// Host buffers standing in for a call's tensors, so that a backend that reads
// and writes host memory (MPI) carries CUDA tensors.
//
// Contract: stage() returns one contiguous host tensor per argument. An input
// (or in-place) CUDA tensor is copied into pinned memory with a blocking copy
// on the tensor's current stream, so its values are there, complete, when
// stage() returns and MPI may read them. finish(), called once the transfer
// is complete, copies each written stand-in back into the caller's tensor:
// from pinned memory without blocking, on the device's current stream, so
// later work on that stream sees the result (LibTorch's pinned allocator
// keeps the block until that copy is done). CPU tensors are passed through
// as they are, unless a test forces staging: then through ordinary host
// memory, which must give the same bits.
//
//   HostStaging staging(plan_staging(devices, false, "allReduce", "mpi"));
//   std::vector<at::Tensor> host = staging.stage({t}, {StagedRole::kInOut});
//   ... MPI on host[0] ... complete ...
//   staging.finish();  // t holds the result
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace remat::internal {

// What a call does with a tensor: reads it, writes all of it, or both.
enum class StagedRole { kIn, kOut, kInOut };

struct StagingPlan {
  bool stage = false;   // the call goes through host stand-ins
  bool pinned = false;  // in pinned memory (the tensors are CUDA tensors)
};

// The plan for a call whose tensors are on `devices`: CUDA tensors staged
// through pinned memory, CPU tensors as they are (staged through ordinary
// host memory when `force_cpu`, a test's switch). Tensors of one call on
// different devices (CUDA and CPU, or two CUDA devices), or on a device that
// is neither, are a CommError naming the devices.
StagingPlan plan_staging(const std::vector<c10::Device>& devices, bool force_cpu, const char* op,
                         const char* backend);

class HostStaging {
 public:
  explicit HostStaging(StagingPlan plan) : plan_(plan) {}

  // The tensors the transfer uses, one per argument: the arguments themselves
  // when the plan stages nothing, else their host stand-ins.
  std::vector<at::Tensor> stage(const std::vector<at::Tensor>& tensors, const std::vector<StagedRole>& roles);

  // Copies every written stand-in back into its tensor. Once.
  void finish();

  // Bytes copied between the tensors and the stand-ins, both ways (those
  // finish() copies back included).
  int64_t bytes() const { return bytes_; }

 private:
  StagingPlan plan_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;  // (caller's tensor, stand-in)
  int64_t bytes_ = 0;
};

}  // namespace remat::internal
