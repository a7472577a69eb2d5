#include "parallel/mappings.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <atomic>
#include <mutex>
#include <vector>

#include "nn/autograd_state.h"
#include "runtime/communicator.h"
#include "runtime/context.h"
#include "runtime/error.h"

namespace remat::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The mappings' share of a context's state (runtime/context.h).
struct MappingCounters {
  std::atomic<int64_t> comm_bytes{0};
};

MappingCounters& counters(Context& context) { return context.get<MappingCounters>(); }

// A backward that communicates counts into the context of its forward, on
// whatever thread autograd runs it: the function keeps that context with its group.
void keep_group(AutogradContext* ctx, const Group& group) {
  keep_in(ctx, "group", group);
  keep_in(ctx, "context", Context::current_shared());
}

const Group& group_of(AutogradContext* ctx) { return kept_in<Group>(ctx, "group"); }

Context& context_of(AutogradContext* ctx) { return *kept_in<std::shared_ptr<Context>>(ctx, "context"); }

at::Tensor all_reduce(const at::Tensor& x, const Group& group, Context& context) {
  at::Tensor out = x.contiguous().clone();
  group->allReduce(out)->wait();
  counters(context).comm_bytes += out.nbytes();
  return out;
}

at::Tensor all_gather_last(const at::Tensor& x, const Group& group, int64_t full, Context& context) {
  at::Tensor out = all_gather_uneven(x, -1, full, group);
  counters(context).comm_bytes += x.nbytes();
  return out;
}

at::Tensor own_chunk(const at::Tensor& x, const Group& group) {
  Range range = partition_range(x.size(-1), group->size(), group->rank());
  return x.narrow(-1, range.start, range.length).contiguous();
}

// --- sequence parallelism ---------------------------------------------------

int64_t positive_dim(const at::Tensor& x, int64_t dim) {
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  REMAT_CHECK(d >= 0 && d < x.dim(), "sequence-parallel mapping: dim ", dim, " of a ", x.dim(),
              "-d tensor");
  return d;
}

// Every rank's chunk along `dim` concatenated in rank order (no autograd).
at::Tensor all_gather_along(const at::Tensor& x, int64_t dim, const Group& group, Context& context) {
  const int64_t d = positive_dim(x, dim);
  at::Tensor front = x.movedim(d, 0).contiguous();
  auto sizes = front.sizes().vec();
  sizes[0] *= group->size();
  at::Tensor out = at::empty(sizes, front.options());
  group->allGather(out, front)->wait();
  counters(context).comm_bytes += front.nbytes();  // this rank's share, as all_gather_last counts
  return out.movedim(0, d).contiguous();
}

// The sum over ranks of `x`, this rank keeping its chunk along `dim` (no autograd).
at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, const Group& group, Context& context) {
  const int64_t d = positive_dim(x, dim);
  check_sequence_split(x.size(d), group, str("a tensor of ", x.size(d), " along its sequence dim ", d));
  at::Tensor front = x.movedim(d, 0).contiguous();
  auto sizes = front.sizes().vec();
  sizes[0] /= group->size();
  at::Tensor out = at::empty(sizes, front.options());
  group->reduceScatter(out, front)->wait();
  counters(context).comm_bytes += front.nbytes();
  return out.movedim(0, d).contiguous();
}

at::Tensor own_sequence_chunk(const at::Tensor& x, int64_t dim, const Group& group) {
  const int64_t d = positive_dim(x, dim);
  check_sequence_split(x.size(d), group, str("a tensor of ", x.size(d), " along its sequence dim ", d));
  const int64_t share = x.size(d) / group->size();
  return x.narrow(d, group->rank() * share, share).contiguous();
}

// --- the forward's collectives as dispatcher ops ------------------------------
//
// remat::tp_all_reduce, remat::tp_all_gather and remat::tp_reduce_scatter run
// the collectives of the mappings' forwards. As operators they pass through
// the dispatcher like aten::mm, so a checkpoint region that lists them in its
// save_ops (activation_checkpointing.save_collectives adds all three) keeps
// their outputs from the forward and hands them back in the recompute, which
// then communicates nothing (checkpointing/selective_op.h). Their schemas take
// the group as an id into this table.

std::mutex g_groups_mutex;
std::vector<std::weak_ptr<Communicator>>& groups() {
  static std::vector<std::weak_ptr<Communicator>> table;
  return table;
}

int64_t group_id(const Group& group) {
  std::lock_guard<std::mutex> lock(g_groups_mutex);
  auto& table = groups();
  for (size_t i = 0; i < table.size(); ++i) {
    if (table[i].lock() == group) return static_cast<int64_t>(i);
  }
  for (size_t i = 0; i < table.size(); ++i) {  // a destroyed group's slot
    if (table[i].expired()) {
      table[i] = group;
      return static_cast<int64_t>(i);
    }
  }
  table.push_back(group);
  return static_cast<int64_t>(table.size() - 1);
}

Group group_of_id(int64_t id) {
  std::lock_guard<std::mutex> lock(g_groups_mutex);
  Group group = id >= 0 && id < static_cast<int64_t>(groups().size()) ? groups()[id].lock() : nullptr;
  REMAT_CHECK(group != nullptr, "tensor-parallel collective: group ", id, " no longer exists");
  return group;
}

at::Tensor all_reduce_kernel(const at::Tensor& x, int64_t group) {
  return all_reduce(x, group_of_id(group), Context::current());
}

at::Tensor all_gather_kernel(const at::Tensor& x, int64_t dim, int64_t full, int64_t group) {
  at::Tensor out = all_gather_uneven(x, dim, full, group_of_id(group));
  counters(Context::current()).comm_bytes += x.nbytes();
  return out;
}

at::Tensor reduce_scatter_kernel(const at::Tensor& x, int64_t dim, int64_t group) {
  return reduce_scatter_along(x, dim, group_of_id(group), Context::current());
}

TORCH_LIBRARY(remat, m) {
  m.def("tp_all_reduce(Tensor x, int group) -> Tensor");
  m.def("tp_all_gather(Tensor x, int dim, int full, int group) -> Tensor");
  m.def("tp_reduce_scatter(Tensor x, int dim, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(remat, CompositeExplicitAutograd, m) {
  m.impl("tp_all_reduce", all_reduce_kernel);
  m.impl("tp_all_gather", all_gather_kernel);
  m.impl("tp_reduce_scatter", reduce_scatter_kernel);
}

at::Tensor forward_all_reduce(const at::Tensor& x, const Group& group) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("remat::tp_all_reduce", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return op.call(x, group_id(group));
}

at::Tensor forward_all_gather(const at::Tensor& x, int64_t dim, int64_t full, const Group& group) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("remat::tp_all_gather", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t)>();
  return op.call(x, dim, full, group_id(group));
}

at::Tensor forward_reduce_scatter(const at::Tensor& x, int64_t dim, const Group& group) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("remat::tp_reduce_scatter", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  return op.call(x, dim, group_id(group));
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group group) {
    keep_group(ctx, group);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduce(grads[0], group_of(ctx), context_of(ctx)), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, Group group) {
    return forward_all_reduce(x, group);
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group group) {
    keep_group(ctx, group);
    ctx->saved_data["full"] = x.size(-1);
    return own_chunk(x, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather_last(grads[0], group_of(ctx), ctx->saved_data["full"].toInt(),
                            context_of(ctx)),
            at::Tensor()};
  }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group group,
                            int64_t full) {
    keep_group(ctx, group);
    return forward_all_gather(x, -1, full, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {own_chunk(grads[0], group_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

bool fast_path(const Group& group) { return group_size(group) == 1; }

void keep_dim(AutogradContext* ctx, int64_t dim) { ctx->saved_data["dim"] = dim; }
int64_t dim_of(AutogradContext* ctx) { return ctx->saved_data["dim"].toInt(); }

struct ScatterToSequence : torch::autograd::Function<ScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group group, int64_t dim) {
    keep_group(ctx, group);
    keep_dim(ctx, dim);
    return own_sequence_chunk(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather_along(grads[0], dim_of(ctx), group_of(ctx), context_of(ctx)), at::Tensor(),
            at::Tensor()};
  }
};

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group group, int64_t dim) {
    keep_group(ctx, group);
    keep_dim(ctx, dim);
    return forward_all_gather(x, dim, x.size(positive_dim(x, dim)) * group->size(), group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {reduce_scatter_along(grads[0], dim_of(ctx), group_of(ctx), context_of(ctx)), at::Tensor(),
            at::Tensor()};
  }
};

struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group group, int64_t dim) {
    keep_group(ctx, group);
    keep_dim(ctx, dim);
    return forward_reduce_scatter(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather_along(grads[0], dim_of(ctx), group_of(ctx), context_of(ctx)), at::Tensor(),
            at::Tensor()};
  }
};

// The input's gradient and the weight's are the kernels autograd runs for
// at::linear on a contiguous input (the flattened mm and its two backward
// products), so a sequence-parallel layer computes what the plain one does.
struct LinearWithSequenceInput : torch::autograd::Function<LinearWithSequenceInput> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, Group group, int64_t dim) {
    keep_group(ctx, group);
    keep_dim(ctx, dim);
    const bool has_bias = bias.numel() > 0;  // an empty tensor stands for none (see the caller)
    ctx->saved_data["has_bias"] = has_bias;
    ctx->save_for_backward({x, weight});
    at::Tensor total = forward_all_gather(x, dim, x.size(positive_dim(x, dim)) * group->size(), group);
    return at::linear(total, weight, has_bias ? bias : at::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[1];
    const Group& group = group_of(ctx);
    at::Tensor total = all_gather_along(saved[0], dim_of(ctx), group, context_of(ctx));
    at::Tensor grad = grads[0].contiguous();
    at::Tensor grad2d = grad.view({-1, grad.size(-1)});
    at::Tensor total2d = total.view({-1, total.size(-1)});
    at::Tensor grad_total = grad2d.mm(weight).view(total.sizes());
    at::Tensor grad_x = reduce_scatter_along(grad_total, dim_of(ctx), group, context_of(ctx));
    at::Tensor grad_weight = grad2d.t().mm(total2d);
    at::Tensor grad_bias = ctx->saved_data["has_bias"].toBool() ? grad2d.sum(0) : at::Tensor();
    return {grad_x, grad_weight, grad_bias, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int group_size(const Group& group) { return group ? group->size() : 1; }

at::Tensor all_gather_uneven(const at::Tensor& x, int64_t dim, int64_t full, const Group& group,
                             int64_t stride) {
  REMAT_CHECK(stride >= 1 && full % stride == 0, "all_gather_uneven: ", full,
              " elements are not ", stride, " equal blocks");
  const int n = group_size(group);
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  const int64_t block = full / stride;
  std::vector<int64_t> lengths(n);
  for (int r = 0; r < n; ++r) lengths[r] = partition_range(block, n, r).length;
  if (x.size(d) != lengths[group_rank(group)] * stride) {
    throw Error(str("all_gather_uneven: rank ", group_rank(group), " holds ", x.size(d),
                    " elements along dim ", d, " but its share of ", full, " is ",
                    lengths[group_rank(group)] * stride));
  }
  std::vector<at::Tensor> parts;
  if (n == 1) {
    parts.push_back(x.clone());
  } else {
    for (int r = 0; r < n; ++r) {
      auto sizes = x.sizes().vec();
      sizes[d] = lengths[r] * stride;
      parts.push_back(at::empty(sizes, x.options()));
    }
    group->allGather(parts, x.contiguous())->wait();
  }
  if (stride == 1) return n == 1 ? parts[0] : at::cat(parts, d);
  std::vector<at::Tensor> pieces;
  for (int64_t s = 0; s < stride; ++s) {
    for (int r = 0; r < n; ++r) pieces.push_back(parts[r].narrow(d, s * lengths[r], lengths[r]));
  }
  return at::cat(pieces, d);
}

int group_rank(const Group& group) { return group ? group->rank() : 0; }

Range partition_range(int64_t n, int parts, int rank) {
  REMAT_CHECK_GE(parts, 1, "partition_range: number of parts");
  REMAT_CHECK(rank >= 0 && rank < parts, "partition_range: rank ", rank, " of ", parts);
  const int64_t base = n / parts, extra = n % parts;
  return {rank * base + std::min<int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

at::Tensor copy_to_tensor_parallel_region(const at::Tensor& x, const Group& group) {
  if (fast_path(group)) return x;
  return CopyToRegion::apply(x, group);
}

at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& x, const Group& group) {
  if (fast_path(group)) return x;
  return ReduceFromRegion::apply(x, group);
}

at::Tensor scatter_to_tensor_parallel_region(const at::Tensor& x, const Group& group) {
  if (fast_path(group)) return x;
  return ScatterToRegion::apply(x, group);
}

at::Tensor gather_from_tensor_parallel_region(const at::Tensor& x, const Group& group,
                                              int64_t full) {
  if (fast_path(group)) return x;
  if (full < 0) full = x.size(-1) * group->size();
  Range mine = partition_range(full, group->size(), group->rank());
  if (x.size(-1) != mine.length) {
    throw Error(str("gather_from_tensor_parallel_region: rank ", group->rank(), " holds ",
                    x.size(-1), " of ", full, " columns but its share is ", mine.length,
                    " (shares are split as evenly as possible, the first ranks taking one more)"));
  }
  return GatherFromRegion::apply(x, group, full);
}

void check_sequence_split(int64_t length, const Group& group, const std::string& what) {
  const int n = group_size(group);
  if (length % n == 0) return;
  throw ConfigError(str("sequence parallelism splits ", what, " evenly across the ", n,
                        " tensor-parallel ranks, and ", length, " is not a multiple of ", n,
                        ": use a length that is (", n, ", ", 2 * n, ", ", 3 * n, ", ...; e.g. ",
                        (length / n) * n > 0 ? (length / n) * n : n, " or ", (length / n + 1) * n,
                        "), or turn tensor_parallel.sequence_parallel off"));
}

at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, const Group& group, int64_t dim) {
  if (fast_path(group)) return x;
  return ScatterToSequence::apply(x, group, dim);
}

at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, const Group& group, int64_t dim) {
  if (fast_path(group)) return x;
  return GatherFromSequence::apply(x, group, dim);
}

at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, const Group& group, int64_t dim) {
  if (fast_path(group)) return x;
  return ReduceScatterToSequence::apply(x, group, dim);
}

at::Tensor linear_with_sequence_parallel_input(const at::Tensor& x, const at::Tensor& weight,
                                               const at::Tensor& bias, const Group& group, int64_t dim) {
  // One rank: the product on a contiguous input too, as the gathered one of
  // several ranks is (a strided view's product may round differently).
  if (fast_path(group)) return at::linear(x.contiguous(), weight, bias);
  // Function::apply takes defined tensors only.
  return LinearWithSequenceInput::apply(x, weight, bias.defined() ? bias : at::empty({0}, weight.options()), group,
                                        dim);
}

int64_t tensor_parallel_comm_bytes() { return counters(Context::current()).comm_bytes.load(); }

}  // namespace remat::parallel
