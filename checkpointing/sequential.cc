#include "checkpointing/sequential.h"

#include "runtime/error.h"

namespace remat {

at::Tensor checkpoint_sequential(torch::nn::Sequential& seq, int64_t segments,
                                 const at::Tensor& input, const CheckpointOptions& options) {
  const int64_t n = static_cast<int64_t>(seq->size());
  if (segments < 1 || segments > n) {
    throw Error(str("checkpoint_sequential: segments=", segments, " must be between 1 and the ",
                    n, " modules of the Sequential"));
  }
  // Segments as even as possible: the first n % segments get one module more.
  auto run = [seq](int64_t begin, int64_t end, at::Tensor x) mutable {
    for (int64_t i = begin; i < end; ++i) x = seq->begin()[i].forward(x);
    return x;
  };
  at::Tensor x = input;
  // run is copied into every region: it keeps the Sequential alive until backward.
  int64_t begin = 0;
  for (int64_t s = 0; s < segments; ++s) {
    int64_t end = begin + n / segments + (s < n % segments ? 1 : 0);
    if (s + 1 == segments) return run(begin, end, x);  // the last segment runs plainly
    CheckpointOptions segment_options = options;
    segment_options.name = str(options.name, "_segment", s);
    x = checkpoint_with(segment_options,
                        [run, begin, end](const at::Tensor& in) mutable { return run(begin, end, in); }, x);
    begin = end;
  }
  return x;
}

}  // namespace remat
