#include "runtime/memory_trace.h"

#include <c10/core/Storage.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "runtime/error.h"
#include "runtime/internal/memory_reporter.h"
#include "runtime/output_file.h"

namespace remat {
namespace {

namespace fs = std::filesystem;

thread_local MemoryCategory t_category = MemoryCategory::kOther;

// The recording trace of this process, if any: g_active is the cheap test.
std::atomic<bool> g_active{false};
std::mutex g_mutex;
std::shared_ptr<TraceRecorder> g_recorder;
std::atomic<uint64_t> g_next_span{1};

std::shared_ptr<TraceRecorder> active_recorder() {
  if (!g_active.load(std::memory_order_acquire)) return nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_recorder;
}

const void* allocation_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  return t.storage().data();
}

c10::DeviceType slot_device(size_t slot) { return slot == 1 ? c10::DeviceType::CUDA : c10::DeviceType::CPU; }

}  // namespace

const char* memory_category_name(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kParameters: return "parameters";
    case MemoryCategory::kGradients: return "gradients";
    case MemoryCategory::kOptimizerState: return "optimizer state";
    case MemoryCategory::kGatheredUnits: return "gathered units";
    case MemoryCategory::kSavedActivations: return "saved activations";
    case MemoryCategory::kCheckpointInputs: return "checkpoint inputs";
    case MemoryCategory::kHostCopies: return "offloaded host copies";
    case MemoryCategory::kCommunication: return "communication buffers";
    case MemoryCategory::kOther: return "other";
    case MemoryCategory::kHostOptimizer: return "host optimizer";
    case MemoryCategory::kHostParameters: return "host parameters";
  }
  return "?";
}

MemoryCategoryScope::MemoryCategoryScope(MemoryCategory category) : previous_(t_category) { t_category = category; }
MemoryCategoryScope::~MemoryCategoryScope() { t_category = previous_; }
MemoryCategory current_memory_category() { return t_category; }

bool memory_trace_active() { return g_active.load(std::memory_order_relaxed); }

void classify_memory(const at::Tensor& tensor, MemoryCategory category) {
  if (!memory_trace_active()) return;
  auto recorder = active_recorder();
  const void* ptr = allocation_of(tensor);
  if (!recorder || ptr == nullptr) return;
  auto& reporter = *recorder->reporter;
  std::lock_guard<std::mutex> lock(reporter.mutex);
  auto it = reporter.allocations.find(ptr);
  if (it == reporter.allocations.end()) return;
  it->second.category = category;
  if (reporter.recorder == recorder.get() && it->second.record >= 0) {
    recorder->records[it->second.record].category = category;
  }
}

// ---------------------------------------------------------------------------
// The recording.

void TraceRecorder::on_allocation(MemoryTracker::Reporter::Allocation& allocation, int64_t tracked) {
  allocation.record = static_cast<int64_t>(records.size());
  records.push_back({allocation.category, allocation.slot});
  events.push_back({now_ns(), allocation.record, allocation.bytes, tracked});
}

void TraceRecorder::on_free(const MemoryTracker::Reporter::Allocation* allocation, size_t slot, int64_t bytes,
                            int64_t tracked) {
  const int64_t record = allocation != nullptr && allocation->record >= 0 ? allocation->record : remainder[slot];
  events.push_back({now_ns(), record, -bytes, tracked});
}

int TraceRecorder::thread_number() {
  const auto id = std::this_thread::get_id();
  auto it = std::find(threads.begin(), threads.end(), id);
  if (it != threads.end()) return static_cast<int>(it - threads.begin()) + 1;
  threads.push_back(id);
  return static_cast<int>(threads.size());
}

TraceSpan::TraceSpan(const char* kind, const std::string& name) : kind_(kind) {
  if (!memory_trace_active()) return;
  recorder_ = active_recorder();
  if (!recorder_) return;
  name_ = name;
  begin_ns_ = recorder_->now_ns();
}

TraceSpan::~TraceSpan() {
  if (!recorder_) return;
  TraceRecorder::Span span;
  span.kind = kind_;
  span.name = std::move(name_);
  span.begin_ns = begin_ns_;
  span.end_ns = recorder_->now_ns();
  std::lock_guard<std::mutex> lock(recorder_->span_mutex);
  if (!recorder_->recording) return;
  span.thread = recorder_->thread_number();
  recorder_->spans.push_back(std::move(span));
}

uint64_t begin_trace_span(const char* kind, const char* name, const std::string& detail) {
  if (!memory_trace_active()) return 0;
  auto recorder = active_recorder();
  if (!recorder) return 0;
  TraceRecorder::Span span;
  span.kind = kind;
  span.name = name;
  span.detail = detail;
  span.async = true;
  span.begin_ns = recorder->now_ns();
  const uint64_t id = g_next_span.fetch_add(1);
  std::lock_guard<std::mutex> lock(recorder->span_mutex);
  if (!recorder->recording) return 0;
  span.thread = recorder->thread_number();
  recorder->open.emplace(id, std::move(span));
  return id;
}

void end_trace_span(uint64_t id) {
  if (id == 0 || !memory_trace_active()) return;
  auto recorder = active_recorder();
  if (!recorder) return;
  std::lock_guard<std::mutex> lock(recorder->span_mutex);
  auto it = recorder->open.find(id);
  if (it == recorder->open.end()) return;
  it->second.end_ns = recorder->now_ns();
  recorder->spans.push_back(std::move(it->second));
  recorder->open.erase(it);
}

// ---------------------------------------------------------------------------

MemoryTrace::MemoryTrace(MemoryTracker& tracker, const std::vector<Known>& known) {
  const auto& reporter = tracker.reporter();
  if (!reporter->keep) {
    throw Error("remat::MemoryTrace: the tracker does not keep its allocations, so the memory live when the "
                "trace starts cannot be split by category: construct the MemoryTracker with "
                "MemoryTrackerOptions::keep_allocations = true (before the model is built, to count its "
                "parameters)");
  }
  std::lock_guard<std::mutex> global(g_mutex);
  if (g_recorder) {
    throw Error("remat::MemoryTrace: another memory trace records in this process: stop it before starting one");
  }
  recorder_ = std::make_shared<TraceRecorder>();
  TraceRecorder& r = *recorder_;
  r.reporter = reporter;
  {
    std::lock_guard<std::mutex> lock(reporter->mutex);
    for (const auto& k : known) {
      const void* ptr = allocation_of(k.tensor);
      auto it = ptr == nullptr ? reporter->allocations.end() : reporter->allocations.find(ptr);
      if (it != reporter->allocations.end()) it->second.category = k.category;
    }
    std::array<int64_t, TraceRecorder::kSlots> kept{};
    for (auto& [ptr, a] : reporter->allocations) {
      a.record = static_cast<int64_t>(r.records.size());
      r.records.push_back({a.category, a.slot});
      r.initial.emplace_back(a.record, a.bytes);
      kept[a.slot] += a.bytes;
    }
    for (size_t s = 0; s < TraceRecorder::kSlots; ++s) {
      r.remainder[s] = static_cast<int64_t>(r.records.size());
      r.records.push_back({MemoryCategory::kOther, s});
      r.initial.emplace_back(r.remainder[s], reporter->live[s] - kept[s]);
      r.tracked_at_start[s] = reporter->live[s];
    }
    r.start = TraceRecorder::Clock::now();
    reporter->recorder = &r;
  }
  {
    std::lock_guard<std::mutex> lock(r.span_mutex);
    r.thread_number();  // the starting thread is thread 1
  }
  g_recorder = recorder_;
  g_active.store(true, std::memory_order_release);
}

MemoryTrace::~MemoryTrace() {
  try {
    stop();
  } catch (...) {
  }
}

void MemoryTrace::stop() {
  TraceRecorder& r = *recorder_;
  {
    std::lock_guard<std::mutex> global(g_mutex);
    if (g_recorder == recorder_) {
      g_recorder.reset();
      g_active.store(false, std::memory_order_release);
    }
  }
  {
    std::lock_guard<std::mutex> lock(r.reporter->mutex);
    if (r.stopped) return;
    r.stopped = true;
    if (r.reporter->recorder == &r) r.reporter->recorder = nullptr;
    r.stop_ns = r.now_ns();
    r.tracked_at_stop = r.reporter->live;
  }
  std::lock_guard<std::mutex> lock(r.span_mutex);
  r.recording = false;
  // Async spans still open (a collective not yet waited for) end with the trace.
  for (auto& [id, span] : r.open) {
    span.end_ns = r.stop_ns;
    span.detail += span.detail.empty() ? "not complete when the trace stopped"
                                       : " (not complete when the trace stopped)";
    r.spans.push_back(std::move(span));
  }
  r.open.clear();
}

std::vector<c10::DeviceType> MemoryTrace::devices() const {
  const TraceRecorder& r = *recorder_;
  std::lock_guard<std::mutex> lock(r.reporter->mutex);
  std::array<bool, TraceRecorder::kSlots> seen{};
  for (const auto& [record, bytes] : r.initial) seen[r.records[record].slot] |= bytes != 0;
  for (const auto& e : r.events) seen[r.records[e.record].slot] = true;
  std::vector<c10::DeviceType> out;
  for (size_t s = 0; s < seen.size(); ++s) {
    if (seen[s]) out.push_back(slot_device(s));
  }
  return out;
}

std::vector<MemoryTraceSample> MemoryTrace::samples(c10::DeviceType device) const {
  const TraceRecorder& r = *recorder_;
  const size_t slot = MemoryTracker::Reporter::slot(device);
  std::lock_guard<std::mutex> lock(r.reporter->mutex);
  std::vector<MemoryTraceSample> out;
  MemoryTraceSample now;
  now.tracked = r.tracked_at_start[slot];
  for (const auto& [record, bytes] : r.initial) {
    const auto& rec = r.records[record];
    if (rec.slot == slot) now.bytes[static_cast<size_t>(rec.category)] += bytes;
  }
  out.push_back(now);
  for (const auto& e : r.events) {
    const auto& rec = r.records[e.record];
    if (rec.slot != slot) continue;
    now.t_ns = e.t_ns;
    now.bytes[static_cast<size_t>(rec.category)] += e.delta;
    now.tracked = e.tracked;
    out.push_back(now);
  }
  if (r.stopped) {
    now.t_ns = std::max(now.t_ns, r.stop_ns);
    now.tracked = r.tracked_at_stop[slot];
    out.push_back(now);
  }
  return out;
}

std::vector<MemoryTraceSpan> MemoryTrace::spans() const {
  TraceRecorder& r = *recorder_;
  std::lock_guard<std::mutex> lock(r.span_mutex);
  std::vector<MemoryTraceSpan> out;
  for (const auto& s : r.spans) out.push_back({s.kind, s.name, s.detail, s.begin_ns, s.end_ns, s.thread, s.async});
  std::stable_sort(out.begin(), out.end(),
                   [](const MemoryTraceSpan& a, const MemoryTraceSpan& b) { return a.begin_ns < b.begin_ns; });
  return out;
}

namespace {

// At most `max` samples: the first, the last, and of each of (max - 2) / 2
// runs of consecutive samples between them the lowest and the highest (in
// their order), so that the peak and the dips stay in.
std::vector<size_t> kept_samples(const std::vector<MemoryTraceSample>& s, int max) {
  std::vector<size_t> out;
  const size_t n = s.size();
  const size_t limit = static_cast<size_t>(std::max(max, 4));
  if (n <= limit) {
    for (size_t i = 0; i < n; ++i) out.push_back(i);
    return out;
  }
  const size_t runs = (limit - 2) / 2, inner = n - 2;
  out.push_back(0);
  for (size_t r = 0; r < runs; ++r) {
    const size_t begin = 1 + r * inner / runs, end = 1 + (r + 1) * inner / runs;
    if (begin >= end) continue;
    size_t low = begin, high = begin;
    for (size_t i = begin; i < end; ++i) {
      if (s[i].tracked < s[low].tracked) low = i;
      if (s[i].tracked > s[high].tracked) high = i;
    }
    out.push_back(std::min(low, high));
    if (low != high) out.push_back(std::max(low, high));
  }
  out.push_back(n - 1);
  return out;
}

double us(int64_t ns) { return static_cast<double>(ns) / 1000.0; }

// A sample's bytes by category name; with `previous`, only the categories
// that hold memory now or did at the previous sample (a counter series keeps
// its value until the next one that names it; chrome://tracing reads a
// missing one as 0).
nlohmann::json by_category(const MemoryTraceSample& s, const MemoryTraceSample* previous = nullptr) {
  nlohmann::json args = nlohmann::json::object();
  for (size_t c = 0; c < kMemoryCategories; ++c) {
    if (previous == nullptr || s.bytes[c] != 0 || previous->bytes[c] != 0) {
      args[memory_category_name(static_cast<MemoryCategory>(c))] = s.bytes[c];
    }
  }
  return args;
}

}  // namespace

std::string MemoryTrace::chrome_json(const ChromeTraceOptions& options) const {
  return chrome_json(options, nlohmann::json::object());
}

std::string MemoryTrace::chrome_json(const ChromeTraceOptions& options, const nlohmann::json& other_data) const {
  using nlohmann::json;
  json events = json::array();
  const int pid = options.pid;
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", options.process_name}}}});
  json categories = json::array();
  for (size_t c = 0; c < kMemoryCategories; ++c) {
    categories.push_back(memory_category_name(static_cast<MemoryCategory>(c)));
  }
  json peaks = json::object();
  for (c10::DeviceType device : devices()) {
    const std::string dev = c10::DeviceTypeName(device, /*lower_case=*/true);
    const auto all = samples(device);
    size_t top = 0;
    for (size_t i = 1; i < all.size(); ++i) {
      if (all[i].tracked > all[top].tracked) top = i;
    }
    peaks[dev] = {{"bytes", all[top].tracked}, {"at_ms", us(all[top].t_ns) / 1000.0},
                  {"by_category", by_category(all[top])}, {"samples", all.size()}};
    const MemoryTraceSample* previous = nullptr;
    for (size_t i : kept_samples(all, options.max_samples)) {
      const auto& s = all[i];
      events.push_back({{"ph", "C"}, {"name", dev + " memory by category"}, {"pid", pid}, {"ts", us(s.t_ns)},
                        {"args", by_category(s, previous)}});
      events.push_back({{"ph", "C"}, {"name", dev + " memory tracked"}, {"pid", pid}, {"ts", us(s.t_ns)},
                        {"args", {{"tracked", s.tracked}}}});
      previous = &s;
    }
  }
  int threads = 1;
  int64_t async_id = 0;
  for (const auto& s : spans()) {
    threads = std::max(threads, s.thread);
    if (s.async) {
      json args = json::object();
      if (!s.detail.empty()) args["call"] = s.detail;
      const int64_t id = ++async_id;
      events.push_back({{"ph", "b"}, {"cat", s.kind}, {"name", s.name}, {"id", id}, {"pid", pid}, {"tid", s.thread},
                        {"ts", us(s.begin_ns)}, {"args", args}});
      events.push_back({{"ph", "e"}, {"cat", s.kind}, {"name", s.name}, {"id", id}, {"pid", pid}, {"tid", s.thread},
                        {"ts", us(s.end_ns)}});
    } else {
      // Phases by their name ("forward"); other spans with their kind ("recompute blocks.3").
      const std::string name = s.kind == "phase" ? s.name : s.kind + " " + s.name;
      events.push_back({{"ph", "X"}, {"cat", s.kind}, {"name", name}, {"pid", pid}, {"tid", s.thread},
                        {"ts", us(s.begin_ns)}, {"dur", us(s.end_ns - s.begin_ns)}});
    }
  }
  for (int t = 1; t <= threads; ++t) {
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", t},
                      {"args", {{"name", t == 1 ? std::string("training thread") : "thread " + std::to_string(t)}}}});
  }
  json other = other_data.is_object() ? other_data : json::object();
  other["categories"] = categories;
  other["peak"] = peaks;
  json trace = {{"traceEvents", events}, {"displayTimeUnit", "ms"}, {"otherData", other}};
  return trace.dump();
}

void MemoryTrace::write(const std::string& path, const ChromeTraceOptions& options,
                        const nlohmann::json& other_data) const {
  const std::string text = chrome_json(options, other_data);
  // A file of a unique name beside the path: an existing PATH.tmp is the user's.
  std::string temporary;
  const int fd = open_temporary_beside(path, temporary);
  if (fd < 0) {
    throw Error(str("writing the memory trace '", shown_path(path), "' failed: cannot create a file beside it (",
                    std::strerror(errno), "): give a path in a writable folder"));
  }
  size_t done = 0;
  int err = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : ENOSPC;
      break;
    }
    done += static_cast<size_t>(n);
  }
  // Checked at start too: the path may have become a device, fifo or link
  // since. Renamed while open (and so locked): a writer at work is never
  // taken for a stale one.
  const std::string what = err == 0 ? not_a_regular_file(path) : std::string();
  if (err == 0 && what.empty() && ::rename(temporary.c_str(), path.c_str()) != 0) err = errno;
  const bool renamed = err == 0 && what.empty();
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0 || !what.empty()) {
    if (!renamed) ::unlink(temporary.c_str());
    throw Error(str("writing the memory trace '", shown_path(path), "' failed (",
                    what.empty() ? std::string(std::strerror(err)) : "it is " + what + " now",
                    "): free space there or give another path; the temporary file is removed"));
  }
}

void check_trace_path(const std::string& path, const std::string& flag) {
  check_output_file({flag, path, "memory.json"});
}

}  // namespace remat
