// A memory timeline: what a MemoryTracker counts, split by category, over
// the time of a recording, with spans (forward, backward, a block's
// recompute, a collective) on the same clock; written as Chrome's Trace Event
// JSON (Perfetto, chrome://tracing). docs/memory.md shows how to read one.
//
// Libraries mark what they allocate with a thread-local category scope, and
// mark spans; both cost one atomic load when nothing records:
//
//   { MemoryCategoryScope scope(MemoryCategory::kGatheredUnits); allocate(...); }
//   { TraceSpan span("recompute", region_name); ... }
//   classify_memory(p.grad(), MemoryCategory::kGradients);  // what autograd allocated
//
// A recording (one per process at a time) follows one tracker, which must
// keep its allocations (MemoryTrackerOptions::keep_allocations): each
// allocation counts in one category over its whole life (the innermost scope
// at its allocation, or the last classify_memory of its memory), so the
// categories add up to the tracker's count at every sample.
//
//   MemoryTracker tracker(MemoryTrackerOptions{/*keep_allocations=*/true});
//   ...
//   MemoryTrace trace(tracker, {{param, MemoryCategory::kParameters}});
//   step();
//   trace.stop();
//   trace.write("step.json");
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace remat {

class MemoryTracker;
struct TraceRecorder;

enum class MemoryCategory : uint8_t {
  kParameters,        // the model's parameters and the shards the optimizer steps
  kGradients,         // parameters' gradients (whole, bucketed or reduced into shards)
  kOptimizerState,    // the optimizer's moments, and what its step allocates
  kGatheredUnits,     // ZeRO-3 units' parameters while gathered
  kSavedActivations,  // what the forward (or a recompute) allocates and autograd keeps
  kCheckpointInputs,  // checkpoint regions' kept inputs (whole, partitioned, fetched back)
  kHostCopies,        // offloaded host copies (checkpoint inputs, activations)
  kCommunication,     // collectives' buffers
  kOther,             // everything else: in backward mostly activations' gradients
  // The optimizer offloaded to the host (ZeRO-Offload): its float32 master
  // shards, their gradients and its state, in host memory (on a GPU under the
  // CPU's counter, apart from the device's).
  kHostOptimizer,
  // Stage 3's parameter shards offloaded to the host (offload_param) and
  // their gradients, in host memory (on a GPU under the CPU's counter).
  kHostParameters,
};
constexpr size_t kMemoryCategories = 11;
// "parameters", "gradients", ..., "other": the names in the trace.
const char* memory_category_name(MemoryCategory category);

// This thread's allocations while the scope lives count in `category`; the
// innermost scope wins. Scopes nest and end in reverse order.
class MemoryCategoryScope {
 public:
  explicit MemoryCategoryScope(MemoryCategory category);
  ~MemoryCategoryScope();
  MemoryCategoryScope(const MemoryCategoryScope&) = delete;
  MemoryCategoryScope& operator=(const MemoryCategoryScope&) = delete;

 private:
  MemoryCategory previous_;
};
// The innermost scope's category on this thread, else kOther.
MemoryCategory current_memory_category();

// Whether a trace records in this process.
bool memory_trace_active();

// While a trace records: the allocation holding `tensor`'s storage counts in
// `category` from its allocation on (e.g. a gradient autograd allocated, a
// region's input kept for its recompute). Nothing otherwise.
void classify_memory(const at::Tensor& tensor, MemoryCategory category);

// A span of this thread's time on the trace: `kind` "phase" (forward,
// backward, optimizer step) or "recompute" (`name` the region).
class TraceSpan {
 public:
  TraceSpan(const char* kind, const std::string& name);
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  std::shared_ptr<TraceRecorder> recorder_;
  int64_t begin_ns_ = 0;
  const char* kind_;
  std::string name_;
};

// A span that ends on another call (a collective, from its launch to its
// completion): 0 when nothing records. Ending 0, or a span twice, does nothing.
uint64_t begin_trace_span(const char* kind, const char* name, const std::string& detail);
void end_trace_span(uint64_t id);

struct MemoryTraceSample {
  int64_t t_ns = 0;  // since the trace's start
  std::array<int64_t, kMemoryCategories> bytes{};
  int64_t tracked = 0;  // the tracker's current() then
};

struct MemoryTraceSpan {
  std::string kind, name, detail;
  int64_t begin_ns = 0, end_ns = 0;
  int thread = 0;      // 1: the thread that started the trace
  bool async = false;  // begun and ended by begin_trace_span / end_trace_span
};

struct ChromeTraceOptions {
  // Counter samples per device at most: the first, the last, and of each
  // run of consecutive samples between them the lowest and the highest, so
  // the peak stays in.
  int max_samples = 4000;
  int pid = 0;
  std::string process_name = "remat";
};

class MemoryTrace {
 public:
  struct Known {
    at::Tensor tensor;
    MemoryCategory category;
  };
  // Starts recording what `tracker` counts from now on, on every thread it
  // sees. Memory live now counts in the category it was allocated in, or in
  // `known`'s for the allocations holding those tensors, or in kOther for
  // what the tracker counts but does not keep. An Error if the tracker does
  // not keep allocations or another trace records.
  MemoryTrace(MemoryTracker& tracker, const std::vector<Known>& known = {});
  ~MemoryTrace();
  MemoryTrace(const MemoryTrace&) = delete;
  MemoryTrace& operator=(const MemoryTrace&) = delete;

  void stop();  // idempotent; the destructor stops too

  // The devices with memory or traffic in the trace.
  std::vector<c10::DeviceType> devices() const;
  // One sample at the start, one after each allocation or free on `device`,
  // one at the stop.
  std::vector<MemoryTraceSample> samples(c10::DeviceType device) const;
  std::vector<MemoryTraceSpan> spans() const;  // ended ones, by begin time

  // Chrome's Trace Event JSON: per device a counter "<device> memory by
  // category" (one series per category, in bytes; after the first sample
  // only those that hold memory or just stopped holding it) and "<device>
  // memory tracked" (the tracker's count), "X" events for spans and "b"/"e"
  // pairs for async spans, and `other_data` with the peak under "otherData".
  std::string chrome_json(const ChromeTraceOptions& options, const nlohmann::json& other_data) const;
  std::string chrome_json(const ChromeTraceOptions& options = {}) const;
  // Written to `path` (a temporary file of a unique name beside it, then
  // renamed); an Error naming the path if it cannot be, the temporary file removed.
  void write(const std::string& path, const ChromeTraceOptions& options, const nlohmann::json& other_data) const;

 private:
  std::shared_ptr<TraceRecorder> recorder_;
};

// A ConfigError naming `flag` and what to change unless a file can be
// written at `path` by the rule of every output (runtime/output_file.h: a
// regular file or a new one; it is not created).
void check_trace_path(const std::string& path, const std::string& flag);

}  // namespace remat
