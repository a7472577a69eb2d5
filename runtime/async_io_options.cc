#include "runtime/async_io_options.h"

#include "runtime/error.h"

namespace remat {

const char* io_backend_name(IoBackend backend) {
  switch (backend) {
    case IoBackend::kAuto: return "auto";
    case IoBackend::kIoUring: return "io_uring";
    case IoBackend::kLibaio: return "libaio";
    case IoBackend::kThreads: return "threads";
  }
  return "unknown";
}

namespace {

bool power_of_two(size_t value) { return value != 0 && (value & (value - 1)) == 0; }

uint64_t round_up(uint64_t value, uint64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

std::string check_async_io_options(const AsyncIoOptions& options) {
  std::string problems;
  auto problem = [&](const std::string& line) { problems += line + "\n"; };
  if (!power_of_two(options.alignment) || options.alignment < 512) {
    problem(str("alignment ", options.alignment, " is not a power of two >= 512: give the filesystem's "
                "logical block size (4096 on most disks)"));
  }
  if (options.block_size == 0) {
    problem("aio.block_size 0: give the bytes of one request piece (DeepSpeed's default 1048576)");
  } else if (options.direct != DirectIo::kOff && power_of_two(options.alignment) &&
             options.block_size % options.alignment != 0) {
    problem(str("aio.block_size ", options.block_size, " is not a multiple of the alignment ",
                options.alignment, " that direct I/O needs: round it to ",
                round_up(options.block_size, options.alignment)));
  }
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    problem(str("aio.queue_depth ", options.queue_depth, " is not in [1, 4096] (DeepSpeed's default 8)"));
  }
  if (options.thread_count < 1 || options.thread_count > 256) {
    problem(str("aio.thread_count ", options.thread_count, " is not in [1, 256] (DeepSpeed's default 1)"));
  }
  if (options.timeout.count() <= 0) problem("the I/O timeout must be > 0 ms");
  return problems;
}

}  // namespace remat
