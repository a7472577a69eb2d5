#include "runtime/internal/mpi_communicator.h"

#include <ATen/ATen.h>
#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/memory_trace.h"
#include "runtime/internal/host_staging.h"
#include "runtime/internal/tensor_checks.h"

namespace remat::internal {
namespace {

// The choke point for MPI return codes.
void mpi_check(int rc, const std::string& context) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  throw CommError(str("MPI error in ", context, ": ", std::string(text, length)));
}

// ---------------------------------------------------------------------------
// Reductions on 16-bit floats: MPI has no bfloat16 or float16, so both travel
// as 2-byte opaque types and reduce through user ops that widen to float.

MPI_Datatype g_bf16 = MPI_DATATYPE_NULL;
MPI_Datatype g_fp16 = MPI_DATATYPE_NULL;
MPI_Op g_half_ops[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // sum, max, min

template <typename T, typename F>
void combine(void* in, void* inout, int n, F f) {
  auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < n; ++i) b[i] = T(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

template <typename F>
void half_op(void* in, void* inout, int* len, MPI_Datatype* type, F f) {
  if (*type == g_bf16) {
    combine<c10::BFloat16>(in, inout, *len, f);
  } else {
    combine<c10::Half>(in, inout, *len, f);
  }
}

void half_sum(void* in, void* inout, int* len, MPI_Datatype* type) {
  half_op(in, inout, len, type, [](float a, float b) { return a + b; });
}
void half_max(void* in, void* inout, int* len, MPI_Datatype* type) {
  half_op(in, inout, len, type, [](float a, float b) { return std::max(a, b); });
}
void half_min(void* in, void* inout, int* len, MPI_Datatype* type) {
  half_op(in, inout, len, type, [](float a, float b) { return std::min(a, b); });
}

void ensure_half_types() {
  if (g_bf16 != MPI_DATATYPE_NULL) return;
  mpi_check(MPI_Type_contiguous(2, MPI_BYTE, &g_bf16), "creating the bfloat16 type");
  mpi_check(MPI_Type_commit(&g_bf16), "committing the bfloat16 type");
  mpi_check(MPI_Type_contiguous(2, MPI_BYTE, &g_fp16), "creating the float16 type");
  mpi_check(MPI_Type_commit(&g_fp16), "committing the float16 type");
  mpi_check(MPI_Op_create(&half_sum, 1, &g_half_ops[0]), "creating the 16-bit sum");
  mpi_check(MPI_Op_create(&half_max, 1, &g_half_ops[1]), "creating the 16-bit max");
  mpi_check(MPI_Op_create(&half_min, 1, &g_half_ops[2]), "creating the 16-bit min");
}

struct Reduction {
  MPI_Datatype type;
  MPI_Op op;
  bool divide_after = false;  // kAvg: sum, then divide by the group size
};

// `op` has passed Communicator::check_reduce_op.
Reduction reduction_for(at::ScalarType dtype, ReduceOp op, const char* what) {
  int index = op == ReduceOp::kMax ? 1 : op == ReduceOp::kMin ? 2 : 0;
  MPI_Op builtin = index == 1 ? MPI_MAX : index == 2 ? MPI_MIN : MPI_SUM;
  bool avg = op == ReduceOp::kAvg;
  switch (dtype) {
    case at::kFloat: return {MPI_FLOAT, builtin, avg};
    case at::kDouble: return {MPI_DOUBLE, builtin, avg};
    case at::kInt: return {MPI_INT32_T, builtin, false};
    case at::kLong: return {MPI_INT64_T, builtin, false};
    case at::kByte: return {MPI_UINT8_T, builtin, false};
    // For bool, sum and max are "any", min is "all".
    case at::kBool: return {MPI_C_BOOL, index == 2 ? MPI_LAND : MPI_LOR, false};
    case at::kBFloat16:
      ensure_half_types();
      return {g_bf16, g_half_ops[index], avg};
    case at::kHalf:
      ensure_half_types();
      return {g_fp16, g_half_ops[index], avg};
    default:
      throw CommError(str(what, ": dtype ", c10::toString(dtype),
                          " is not supported by reductions; use float32, float64, "
                          "bfloat16, float16, int32, int64, uint8 or bool"));
  }
}

int to_count(int64_t n, const char* what) {
  if (n > INT_MAX) {
    throw CommError(str(what, ": ", n, " elements/bytes exceed MPI's int count (", INT_MAX,
                        "); split the tensor into smaller pieces"));
  }
  return static_cast<int>(n);
}

// The buffer an in-place op writes into: the tensor itself when contiguous,
// else a contiguous copy that `finish` copies back.
at::Tensor writable(at::Tensor& t, std::vector<std::function<void()>>& finish) {
  if (t.is_contiguous()) return t;
  at::Tensor buffer = t.contiguous();
  finish.push_back([t, buffer]() mutable { t.copy_(buffer); });
  return buffer;
}


class MpiWork final : public Work {
 public:
  MpiWork(std::string what, int rank, int size, Timeout timeout, bool cancellable, WaitedFor waited, bool debug)
      : what_(std::move(what)), rank_(rank), size_(size), timeout_(timeout),
        cancellable_(cancellable), waited_(waited), debug_(debug) {}

  std::vector<MPI_Request> requests;
  std::vector<at::Tensor> keep_alive;
  std::vector<std::function<void()>> finish;

  bool isCompleted() override {
    if (!error_.empty()) throw CommError(error_);
    if (done_) return true;
    int flag = 0;
    if (!requests.empty()) {
      mpi_check(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag,
                            MPI_STATUSES_IGNORE),
                what_);
    } else {
      flag = 1;
    }
    if (flag) {
      done_ = true;
      for (auto& f : finish) f();
      finish.clear();
      keep_alive.clear();
    }
    return done_;
  }

  void wait() override {
    auto start = std::chrono::steady_clock::now();
    int polls = 0;
    while (!isCompleted()) {
      if (communication_failed()) {
        // The failure that ended the job first: it is what the user acts on.
        give_up(str(communication_failure(), " (", what_, " on rank ", rank_, " was abandoned because of it)"),
                /*timed_out=*/false);
      }
      // Spin briefly, then yield: ranks are often oversubscribed on few cores.
      if (++polls > 1000) {
        if (std::chrono::steady_clock::now() - start > timeout_) {
          give_up(str(what_, " on rank ", rank_, " of ", size_, " did not complete within ",
                      timeout_.count() / 1000.0, " s: ", timeout_advice(waited_, debug_)),
                  /*timed_out=*/true);
        }
        std::this_thread::sleep_for(std::chrono::microseconds(polls > 100000 ? 200 : 5));
      }
    }
  }

 private:
  // Stops waiting. A point-to-point request is withdrawn, so its buffer is
  // free again and the communicator stays usable. A collective cannot be
  // withdrawn: MPI may still write into its buffers, which are therefore kept
  // until the process ends, and a collective that timed out is recorded as
  // the process's communication failure (the job should end: run_main).
  [[noreturn]] void give_up(std::string error, bool timed_out) {
    error_ = std::move(error);
    if (cancellable_) {
      for (auto& request : requests) {
        MPI_Cancel(&request);
        MPI_Wait(&request, MPI_STATUS_IGNORE);
      }
      keep_alive.clear();
    } else {
      keep_until_exit(std::move(keep_alive));
      keep_alive.clear();
      if (timed_out) record_communication_failure(error_);
    }
    finish.clear();
    if (timed_out) throw TimeoutError(error_);
    throw CommError(error_);
  }

  static void keep_until_exit(std::vector<at::Tensor> buffers) {
    static std::mutex mutex;
    static auto* kept = new std::vector<at::Tensor>();  // never freed: MPI may write there
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& b : buffers) kept->push_back(std::move(b));
  }

  std::string what_;
  int rank_;
  int size_;
  Timeout timeout_;
  bool cancellable_;
  WaitedFor waited_;  // with debug_ (REMAT_DEBUG_COLLECTIVES), what a timeout advises
  bool debug_;
  bool done_ = false;
  std::string error_;
};

// Ends the process if a blocking start-up call has not returned by the
// collective timeout. MPI_Init waits for every rank of the job (Open MPI
// exchanges their addresses there) and has no timeout of its own: a rank
// stopped before it, as a loaded machine still loading LibTorch made likely,
// held the others there for good. No MPI call is possible yet, so the
// process exits with the error; mpirun then ends the job.
class StartupDeadline {
 public:
  StartupDeadline(std::string what, std::chrono::milliseconds limit)
      : thread_([this, what = std::move(what), limit] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (done_cv_.wait_for(lock, limit, [this] { return done_; })) return;
          std::fprintf(stderr, "%s remat timeout: %s did not complete within %g s: a peer has not reached it (it "
                       "exited, stalled or is still starting); raise REMAT_COMM_TIMEOUT_S if start-up is only slow\n",
                       log_prefix().c_str(), what.c_str(), limit.count() / 1000.0);
          std::fflush(stderr);
          std::_Exit(1);
        }) {}
  ~StartupDeadline() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_one();
    thread_.join();
  }
  StartupDeadline(const StartupDeadline&) = delete;
  StartupDeadline& operator=(const StartupDeadline&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread thread_;  // last: starts once the members it uses exist
};

// "1 on ranks 1, 3; <not set> on ranks 0, 2": each value with the ranks that hold it.
std::string values_by_rank(const std::vector<std::string>& values) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(values.size()); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == values[r]; });
    if (it == groups.end()) {
      groups.emplace_back(values[r], std::vector<int>{});
      it = groups.end() - 1;
    }
    it->second.push_back(r);
  }
  std::string out;
  for (const auto& [value, ranks] : groups) {
    out += str(out.empty() ? "" : "; ", value.empty() ? "<not set>" : "'" + value + "'", " on rank",
               ranks.size() > 1 ? "s" : "");
    for (size_t i = 0; i < ranks.size(); ++i) out += str(i == 0 ? " " : ", ", ranks[i]);
  }
  return out;
}

// Every rank's `mine`, cut to kSlot - 1 bytes ("..." marks a cut), in rank
// order: an all-gather of fixed slots that waits with the collective timeout.
std::vector<std::string> gather_strings(MPI_Comm comm, int rank, int size, const std::string& mine,
                                        const std::string& what) {
  constexpr int kSlot = 256;
  at::Tensor slot = at::zeros({kSlot}, at::kChar);
  std::memcpy(slot.data_ptr(), mine.data(), std::min<size_t>(mine.size(), kSlot - 1));
  at::Tensor all = at::zeros({static_cast<int64_t>(kSlot) * size}, at::kChar);
  MpiWork work(what, rank, size, knobs::comm_timeout(), /*cancellable=*/false, WaitedFor::kCollective,
               /*debug=*/false);
  work.keep_alive = {slot, all};
  work.requests.resize(1);
  mpi_check(MPI_Iallgather(slot.data_ptr(), kSlot, MPI_CHAR, all.data_ptr(), kSlot, MPI_CHAR, comm,
                           &work.requests[0]),
            what);
  work.wait();
  std::vector<std::string> values;
  for (int r = 0; r < size; ++r) {
    values.emplace_back(static_cast<const char*>(all.data_ptr()) + static_cast<size_t>(r) * kSlot);
    if (values[r].size() == static_cast<size_t>(kSlot - 1)) values[r] += "...";
  }
  return values;
}

// REMAT_DEBUG_COLLECTIVES changes what every collective exchanges (a
// description goes first, on a communicator of its own): a rank that read it
// differently waits for a call the others never make, and did so for good at
// start-up. So the ranks agree on it in the communicator's first exchange,
// whose shape no setting changes: every rank parses every rank's value with
// the same rule and raises the same error where one is bad or they differ.
bool agreed_debug_collectives(MPI_Comm comm, int rank, int size) {
  const char* name = knobs::kDebugCollectives;
  // Longer values are no boolean either: shown cut, as 63 bytes and "...".
  std::string mine = knobs::get(name).value_or("");
  if (mine.size() >= 63) mine = mine.substr(0, 63) + "...";
  std::vector<std::string> values =
      gather_strings(comm, rank, size, mine, str("agreeing on ", name, " at start-up"));
  std::vector<bool> on;
  for (int r = 0; r < size; ++r) {
    try {
      on.push_back(!values[r].empty() && knobs::parse_bool(name, values[r]));
    } catch (const ConfigError& e) {
      throw ConfigError(str(e.what(), " (rank ", r, "'s value; the ranks have ", values_by_rank(values), ")"));
    }
  }
  if (std::find(on.begin(), on.end(), !on[0]) != on.end()) {
    throw ConfigError(str("the ranks of this job were started with different ", name, ": ", values_by_rank(values),
                          ". It changes what every collective exchanges, so every rank must have the same value: "
                          "set it for all ranks (remat-run passes every REMAT_* variable on; with mpirun, -x ",
                          name, ") or for none"));
  }
  return on[0];
}

}  // namespace

// ---------------------------------------------------------------------------

MpiSession::MpiSession() {
  if (initialized()) return;
  // Open MPI 5 will not initialise without a home directory (a process
  // started directly, not by mpirun, by a runner that clears HOME, as Bazel's
  // test runner does): take the user's from the password database.
  const char* home = std::getenv("HOME");
  if (home == nullptr || *home == '\0') {
    const passwd* user = getpwuid(getuid());
    ::setenv("HOME", user != nullptr && user->pw_dir != nullptr ? user->pw_dir : "/tmp", 1);
  }
  int provided = 0;
  {
    StartupDeadline deadline("MPI_Init (every rank of the job starting MPI)", knobs::comm_timeout());
    mpi_check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
  }
  owns_ = true;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_ && !finalized) MPI_Finalize();
}

bool MpiSession::initialized() {
  int flag = 0;
  MPI_Initialized(&flag);
  return flag != 0;
}

void MpiSession::abort(int code) {
  if (initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

struct MpiCommunicator::Launch {
  const char* op;
  std::string signature;  // compared across ranks in debug mode
  bool collective = true;
  Timeout timeout{0};
  std::vector<at::Tensor> tensors;  // the caller's: checked for device, kept alive
  std::vector<StagedRole> roles;    // one per tensor: what the call does with it
  // Starts the transfer on `args`: `tensors`, or their host stand-ins.
  std::function<void(MpiWork&, std::vector<at::Tensor>& args)> start;
};

std::shared_ptr<MpiCommunicator> MpiCommunicator::world() {
  REMAT_CHECK(MpiSession::initialized(),
              "MPI is not initialised: create a remat::MpiSession (or call "
              "remat::Runtime::init) before asking for a communicator");
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm dup = MPI_COMM_NULL;
  {
    // Nonblocking, so that a rank that never comes is a timeout, not a hang.
    MpiWork work("duplicating MPI_COMM_WORLD", rank, size, knobs::comm_timeout(), /*cancellable=*/false,
                 WaitedFor::kCollective, /*debug=*/false);
    work.requests.resize(1);
    mpi_check(MPI_Comm_idup(MPI_COMM_WORLD, &dup, &work.requests[0]), "duplicating MPI_COMM_WORLD");
    work.wait();
  }
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  bool debug = false;
  try {
    debug = agreed_debug_collectives(dup, rank, size);
  } catch (...) {
    MPI_Comm_free(&dup);
    throw;
  }
  return std::shared_ptr<MpiCommunicator>(new MpiCommunicator(dup, debug));
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, bool debug) : Communicator(0, 1), comm_(comm), debug_(debug) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  if (debug_) mpi_check(MPI_Comm_dup(comm_, &check_comm_), "duplicating for debug checks");
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (check_comm_ != MPI_COMM_NULL) MPI_Comm_free(&check_comm_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::verifyCollective(const std::string& description, Timeout timeout) {
  constexpr int kLength = 512;
  if (check_comm_ == MPI_COMM_NULL) {
    mpi_check(MPI_Comm_dup(comm_, &check_comm_), "duplicating for debug checks");
  }
  std::vector<char> mine(kLength, 0);
  std::memcpy(mine.data(), description.data(), std::min<size_t>(description.size(), kLength - 1));
  std::vector<char> all(static_cast<size_t>(kLength) * size_, 0);
  MpiWork work(str("debug check before ", description), rank_, size_,
               timeout.count() > 0 ? timeout : default_timeout_, /*cancellable=*/false,
               WaitedFor::kDebugCheck, /*debug=*/true);
  work.requests.resize(1);
  mpi_check(MPI_Iallgather(mine.data(), kLength, MPI_CHAR, all.data(), kLength, MPI_CHAR,
                           check_comm_, &work.requests[0]),
            "debug check");
  work.wait();
  for (int r = 0; r < size_; ++r) {
    std::string theirs(all.data() + static_cast<size_t>(r) * kLength);
    if (theirs != mine.data()) {
      throw CommError(str("collective mismatch on a communicator of ", size_, " ranks: rank ",
                          rank_, " called ", mine.data(), " but rank ", r, " called ", theirs,
                          ". Every rank must call the same collectives in the same order "
                          "with the same dtypes and shapes"));
    }
  }
}

std::shared_ptr<Work> MpiCommunicator::launch(Launch&& l) {
  std::vector<c10::Device> devices;
  for (const auto& t : l.tensors) {
    if (!t.defined()) throw CommError(str(l.op, ": got an undefined tensor"));
    devices.push_back(t.device());
  }
  const StagingPlan plan = plan_staging(devices, stage_cpu_, l.op, "mpi");
  auto [what, timeout] = begin_call(l.op, l.signature, l.timeout, l.collective);
  if (debug_ && l.collective) verifyCollective(what, timeout);
  auto work = std::make_shared<MpiWork>(
      what, rank_, size_, timeout, /*cancellable=*/!l.collective,
      l.collective ? WaitedFor::kCollective : WaitedFor::kPointToPoint, debug_);
  work->keep_alive = l.tensors;
  // On a memory trace: its buffers, and its span from launch to completion.
  const uint64_t span = begin_trace_span("collective", l.op, what);
  try {
    MemoryCategoryScope buffers(MemoryCategory::kCommunication);
    if (!plan.stage) {
      l.start(*work, l.tensors);
    } else {
      auto staging = std::make_shared<HostStaging>(plan);
      std::vector<at::Tensor> host = staging->stage(l.tensors, l.roles);
      work->keep_alive.insert(work->keep_alive.end(), host.begin(), host.end());
      note_staged(staging->bytes(), plan.pinned, what);
      l.start(*work, host);
      // After the op's own finishing steps, which write the stand-ins.
      work->finish.push_back([staging] { staging->finish(); });
    }
  } catch (...) {
    end_trace_span(span);
    throw;
  }
  if (span != 0) work->finish.push_back([span] { end_trace_span(span); });
  return work;
}

void MpiCommunicator::note_staged(int64_t bytes, bool pinned, const std::string& what) {
  if (staged_bytes_ == 0) {
    log().debug("mpi backend: {} tensors go through {} host buffers ({} bytes copied for {}, the first)",
                pinned ? "CUDA" : "CPU (forced by a test)", pinned ? "pinned" : "ordinary", bytes, what);
  }
  staged_bytes_ += bytes;
}

std::vector<std::string> MpiCommunicator::gatherStrings(const std::string& mine, const std::string& what) {
  return gather_strings(comm_, rank_, size_, mine, what);
}

std::shared_ptr<Work> MpiCommunicator::allReduce(at::Tensor& tensor, const AllReduceOptions& opts) {
  check_reduce_op(opts.op, tensor.scalar_type(), "allReduce");
  Launch l{"allReduce", str(describe(tensor), ", op=", to_string(opts.op))};
  l.timeout = opts.timeout;
  l.tensors = {tensor};
  l.roles = {StagedRole::kInOut};
  l.start = [this, opts](MpiWork& work, std::vector<at::Tensor>& args) {
    Reduction red = reduction_for(args[0].scalar_type(), opts.op, "allReduce");
    at::Tensor buffer = writable(args[0], work.finish);
    work.keep_alive.push_back(buffer);
    if (red.divide_after) {
      int n = size_;
      work.finish.insert(work.finish.begin(), [buffer, n]() mutable { buffer.div_(n); });
    }
    work.requests.resize(1);
    mpi_check(MPI_Iallreduce(MPI_IN_PLACE, buffer.data_ptr(), to_count(buffer.numel(), "allReduce"),
                             red.type, red.op, comm_, &work.requests[0]),
              "allReduce");
  };
  return launch(std::move(l));
}

std::shared_ptr<Work> MpiCommunicator::allGather(at::Tensor& output, const at::Tensor& input,
                                                 const AllGatherOptions& opts) {
  check_gather_flat(output, input, size_);
  Launch l{"allGather", describe(input)};
  l.timeout = opts.timeout;
  l.tensors = {output, input};
  l.roles = {StagedRole::kOut, StagedRole::kIn};
  l.start = [this](MpiWork& work, std::vector<at::Tensor>& args) {
    at::Tensor in = args[1].contiguous();
    at::Tensor out = writable(args[0], work.finish);
    work.keep_alive.push_back(in);
    work.keep_alive.push_back(out);
    int bytes = to_count(in.numel() * in.element_size(), "allGather");
    work.requests.resize(1);
    mpi_check(MPI_Iallgather(in.data_ptr(), bytes, MPI_BYTE, out.data_ptr(), bytes, MPI_BYTE,
                             comm_, &work.requests[0]),
              "allGather");
  };
  return launch(std::move(l));
}

std::shared_ptr<Work> MpiCommunicator::allGather(std::vector<at::Tensor>& outputs,
                                                 const at::Tensor& input,
                                                 const AllGatherOptions& opts) {
  Launch l{"allGatherList", check_gather_list(outputs, input, rank_, size_)};
  l.timeout = opts.timeout;
  l.tensors = outputs;
  l.tensors.push_back(input);
  l.roles.assign(outputs.size(), StagedRole::kOut);
  l.roles.push_back(StagedRole::kIn);
  l.start = [this](MpiWork& work, std::vector<at::Tensor>& args) {
    std::vector<at::Tensor> outs(args.begin(), args.begin() + size_);
    const at::Tensor& input = args[size_];
    int64_t element = input.element_size();
    std::vector<int> counts(size_), displs(size_);
    int64_t total = 0;
    for (int r = 0; r < size_; ++r) {
      counts[r] = to_count(outs[r].numel() * element, "allGather");
      displs[r] = to_count(total, "allGather");
      total += outs[r].numel() * element;
    }
    at::Tensor in = input.contiguous();
    at::Tensor flat = at::empty({total / std::max<int64_t>(element, 1)}, input.options());
    work.keep_alive.push_back(in);
    work.keep_alive.push_back(flat);
    work.finish.push_back([outs, flat]() mutable {
      int64_t offset = 0;
      for (auto& o : outs) {
        o.copy_(flat.narrow(0, offset, o.numel()).view(o.sizes()));
        offset += o.numel();
      }
    });
    work.requests.resize(1);
    mpi_check(MPI_Iallgatherv(in.data_ptr(), counts[rank_], MPI_BYTE, flat.data_ptr(),
                              counts.data(), displs.data(), MPI_BYTE, comm_, &work.requests[0]),
              "allGather");
  };
  return launch(std::move(l));
}

std::shared_ptr<Work> MpiCommunicator::reduceScatter(at::Tensor& output, const at::Tensor& input,
                                                     const ReduceScatterOptions& opts) {
  check_scatter(output, input, size_);
  check_reduce_op(opts.op, input.scalar_type(), "reduceScatter");
  Launch l{"reduceScatter", str(describe(input), ", op=", to_string(opts.op))};
  l.timeout = opts.timeout;
  l.tensors = {output, input};
  l.roles = {StagedRole::kOut, StagedRole::kIn};
  l.start = [this, opts](MpiWork& work, std::vector<at::Tensor>& args) {
    Reduction red = reduction_for(args[1].scalar_type(), opts.op, "reduceScatter");
    at::Tensor in = args[1].contiguous();
    at::Tensor out = writable(args[0], work.finish);
    work.keep_alive.push_back(in);
    work.keep_alive.push_back(out);
    if (red.divide_after) {
      int n = size_;
      work.finish.insert(work.finish.begin(), [out, n]() mutable { out.div_(n); });
    }
    work.requests.resize(1);
    mpi_check(MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(),
                                        to_count(out.numel(), "reduceScatter"), red.type,
                                        red.op, comm_, &work.requests[0]),
              "reduceScatter");
  };
  return launch(std::move(l));
}

std::shared_ptr<Work> MpiCommunicator::broadcast(at::Tensor& tensor, const BroadcastOptions& opts) {
  check_root(opts.root, size_, "broadcast");
  Launch l{"broadcast", str(describe(tensor), ", root=", opts.root)};
  l.timeout = opts.timeout;
  l.tensors = {tensor};
  // The root's tensor is only read; the others' only written.
  l.roles = {rank_ == opts.root ? StagedRole::kIn : StagedRole::kOut};
  l.start = [this, opts](MpiWork& work, std::vector<at::Tensor>& args) {
    at::Tensor buffer = writable(args[0], work.finish);
    work.keep_alive.push_back(buffer);
    work.requests.resize(1);
    mpi_check(MPI_Ibcast(buffer.data_ptr(), to_count(buffer.nbytes(), "broadcast"), MPI_BYTE,
                         opts.root, comm_, &work.requests[0]),
              "broadcast");
  };
  return launch(std::move(l));
}

std::shared_ptr<Work> MpiCommunicator::barrier(const BarrierOptions& opts) {
  Launch l{"barrier", ""};
  l.timeout = opts.timeout;
  l.start = [this](MpiWork& work, std::vector<at::Tensor>&) {
    work.requests.resize(1);
    mpi_check(MPI_Ibarrier(comm_, &work.requests[0]), "barrier");
  };
  return launch(std::move(l));
}

std::shared_ptr<Work> MpiCommunicator::send(const at::Tensor& tensor, int dst,
                                            const SendRecvOptions& opts) {
  check_peer(dst, rank_, size_, "send");
  Launch l{"send", str(describe(tensor), ", dst=", dst, ", tag=", opts.tag), false};
  l.timeout = opts.timeout;
  l.tensors = {tensor};
  l.roles = {StagedRole::kIn};
  l.start = [this, dst, opts](MpiWork& work, std::vector<at::Tensor>& args) {
    at::Tensor buffer = args[0].contiguous();
    work.keep_alive.push_back(buffer);
    work.requests.resize(1);
    mpi_check(MPI_Isend(buffer.data_ptr(), to_count(buffer.nbytes(), "send"), MPI_BYTE, dst,
                        opts.tag, comm_, &work.requests[0]),
              "send");
  };
  return launch(std::move(l));
}

std::shared_ptr<Work> MpiCommunicator::recv(at::Tensor& tensor, int src, const SendRecvOptions& opts) {
  check_peer(src, rank_, size_, "recv");
  Launch l{"recv", str(describe(tensor), ", src=", src, ", tag=", opts.tag), false};
  l.timeout = opts.timeout;
  l.tensors = {tensor};
  l.roles = {StagedRole::kOut};
  l.start = [this, src, opts](MpiWork& work, std::vector<at::Tensor>& args) {
    at::Tensor buffer = writable(args[0], work.finish);
    work.keep_alive.push_back(buffer);
    work.requests.resize(1);
    mpi_check(MPI_Irecv(buffer.data_ptr(), to_count(buffer.nbytes(), "recv"), MPI_BYTE, src,
                        opts.tag, comm_, &work.requests[0]),
              "recv");
  };
  return launch(std::move(l));
}

std::shared_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  if (debug_) verifyCollective(str("split(seq=", seq_, ")"), default_timeout_);
  // MPI_Comm_split blocks with no timeout: every rank first meets in a
  // barrier that has one, so a missing rank is a timeout here, not a hang.
  barrier()->wait();
  ++seq_;
  MPI_Comm sub = MPI_COMM_NULL;
  mpi_check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub), "split");
  if (sub == MPI_COMM_NULL) return nullptr;
  return std::shared_ptr<MpiCommunicator>(new MpiCommunicator(sub, debug_));
}

}  // namespace remat::internal
