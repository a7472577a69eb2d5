// Tensor-parallel communication as named autograd pairs.
//
//   copy_to_tensor_parallel_region      identity forward,        all-reduce backward
//   reduce_from_tensor_parallel_region  all-reduce forward,      identity backward
//   scatter_to_tensor_parallel_region   keep own last-dim chunk, all-gather backward
//   gather_from_tensor_parallel_region  all-gather last dim,     keep own chunk backward
//
// `group` is the tensor-parallel communicator (layout.tp_group()). A null group
// or a group of size 1 is the fast path: the input comes back unchanged and no
// autograd node is added. Every rank of the group must make the same calls in
// the same order, forward and backward (the usual collective contract).
//
// Last-dimension chunks may be uneven: rank r holds partition_range(n, size, r).
//
// Sequence parallelism: between the tensor-parallel layers every rank holds
// 1/size of the sequence, along `dim` (1 for [batch, seq, hidden]); the
// length must split evenly (an error names the lengths that do).
//
//   scatter_to_sequence_parallel_region         keep own sequence chunk,  all-gather backward
//   gather_from_sequence_parallel_region        all-gather the sequence,  reduce-scatter backward
//   reduce_scatter_to_sequence_parallel_region  reduce-scatter sequence,  all-gather backward
//   linear_with_sequence_parallel_input         all-gather, then x W^T + b; keeps only this
//                                               rank's chunk for the backward, which gathers
//                                               it again and reduce-scatters the input's gradient
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

namespace remat {
class Communicator;
}

namespace remat::parallel {

using Group = std::shared_ptr<Communicator>;

int group_size(const Group& group);
int group_rank(const Group& group);

// Rank `rank`'s share of `n` items split across `parts`: the first n % parts
// ranks get one more. `start` is the offset of the share.
struct Range {
  int64_t start = 0;
  int64_t length = 0;
};
Range partition_range(int64_t n, int parts, int rank);

// Every rank's `x` concatenated along `dim` in rank order, rank r holding
// partition_range(full, size, r).length of it (a collective, no autograd).
// With `stride` > 1 the full extent is `stride` blocks of full / stride (a
// fused projection: q|k|v) and each rank holds its share of every block, one
// after the other; the result puts each block back together in turn.
at::Tensor all_gather_uneven(const at::Tensor& x, int64_t dim, int64_t full, const Group& group,
                             int64_t stride = 1);

at::Tensor copy_to_tensor_parallel_region(const at::Tensor& x, const Group& group);
at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& x, const Group& group);
at::Tensor scatter_to_tensor_parallel_region(const at::Tensor& x, const Group& group);
// `full`: the gathered last-dimension size; -1 when every rank holds the same
// size (then full = size x x.size(-1)).
at::Tensor gather_from_tensor_parallel_region(const at::Tensor& x, const Group& group,
                                              int64_t full = -1);

at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, const Group& group, int64_t dim = 1);
at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, const Group& group, int64_t dim = 1);
at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, const Group& group,
                                                      int64_t dim = 1);
// `bias` may be undefined. The forward's result equals
// at::linear(gather_from_sequence_parallel_region(x), weight, bias) bit for bit;
// what autograd saves is `x` (1/size of the gathered input) and the weight.
at::Tensor linear_with_sequence_parallel_input(const at::Tensor& x, const at::Tensor& weight,
                                               const at::Tensor& bias, const Group& group,
                                               int64_t dim = 1);

// Throws a ConfigError unless `length` splits evenly over the group (the
// message lists the lengths that work). `what` names the length ("sequence of 13 tokens").
void check_sequence_split(int64_t length, const Group& group, const std::string& what);

// Bytes the mappings moved through collectives in the current context
// (runtime/context.h; cumulative). A backward counts into its forward's context.
int64_t tensor_parallel_comm_bytes();

}  // namespace remat::parallel
