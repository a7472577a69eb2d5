#include "parallel/mappings.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

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
    return all_reduce(x, group, Context::current());
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
    return all_gather_last(x, group, full, Context::current());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {own_chunk(grads[0], group_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

bool fast_path(const Group& group) { return group_size(group) == 1; }

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

int64_t tensor_parallel_comm_bytes() { return counters(Context::current()).comm_bytes.load(); }

}  // namespace remat::parallel
