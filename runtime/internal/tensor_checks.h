// Argument checks and call descriptions shared by the communication backends.
// Each throws CommError (or Error from a REMAT_CHECK) naming what to change.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace remat::internal {

// Defined tensor on the backend's device kind.
void check_tensor_device(const at::Tensor& t, bool want_cuda, const char* op,
                         const char* backend);

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op);

// "dtype=Float, shape=[4, 3]": how calls are named in errors and debug checks.
std::string describe(const at::Tensor& t);

// Flat all-gather: output holds `size` inputs of one dtype.
void check_gather_flat(const at::Tensor& output, const at::Tensor& input, int size);

// List all-gather: one output per rank, outputs[rank] sized like the input.
// Returns the description compared across ranks (the output shapes).
std::string check_gather_list(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                              int rank, int size);

// Reduce-scatter: input holds `size` outputs of one dtype.
void check_scatter(const at::Tensor& output, const at::Tensor& input, int size);

void check_root(int root, int size, const char* op);

// A point-to-point peer: another rank of the communicator.
void check_peer(int peer, int rank, int size, const char* op);

// What a wait that timed out was for: a send or receive, a collective, or
// REMAT_DEBUG_COLLECTIVES's check before one.
enum class WaitedFor { kPointToPoint, kCollective, kDebugCheck };

// The advice of a timeout error: what the user can look at or change. With
// REMAT_DEBUG_COLLECTIVES on (`debug`), running with it is no advice: what its
// check established is.
std::string timeout_advice(WaitedFor waited, bool debug);

}  // namespace remat::internal
