// A job in which rank 1 stalls (alive, never joins the collective). The others
// must give up after REMAT_COMM_TIMEOUT_S with a TimeoutError and end the job.
#include <ATen/ATen.h>

#include <chrono>
#include <thread>

#include "runtime/runtime.h"

int main() {
  return remat::run_main([] {
    auto world = remat::Runtime::init().world(remat::Backend::kMpi);
    at::Tensor t = at::ones({16});
    if (world->rank() == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(120));
      return 0;
    }
    world->allReduce(t)->wait();
    return 0;
  });
}
