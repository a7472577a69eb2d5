// A job in which rank 1 dies while the others wait in a collective. Used by
// peer_exit_test.sh: the job must end with a nonzero exit, never hang.
#include <ATen/ATen.h>

#include <cstdlib>

#include "runtime/runtime.h"

int main() {
  return remat::run_main([] {
    auto world = remat::Runtime::init().world(remat::Backend::kMpi);
    at::Tensor t = at::ones({16});
    world->allReduce(t)->wait();  // everyone takes part once
    if (world->rank() == 1) std::_Exit(3);  // a crash: no MPI_Finalize, no goodbye
    world->allReduce(t)->wait();  // the others wait for a peer that is gone
    return 0;
  });
}
