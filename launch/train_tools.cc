#include "launch/train_tools.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "engine/auto_values.h"
#include "runtime/device_memory.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/output_file.h"

namespace remat {
namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

double host_bytes_per_rank() { return static_cast<double>(rank_memory(c10::Device(c10::DeviceType::CPU)).per_rank()); }

namespace {

std::string shell_quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace

const std::string& plot_memory_trace_script();  // tools/plot_memory_trace.py, compiled in

std::string memory_plot_path(const std::string& trace) {
  const std::string suffix = ".json";
  if (trace.size() > suffix.size() && trace.compare(trace.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return trace.substr(0, trace.size() - suffix.size()) + ".png";
  }
  return trace + ".png";
}

std::string memory_plot_script_path(const std::string& trace) {
  const std::string png = memory_plot_path(trace);
  return png.substr(0, png.size() - 4) + ".plot.py";
}

namespace {

// The plotting script written beside the trace, for drawing the plot by hand
// (a temporary file renamed over its path), and what to run with it: "run
// CMD", or why the script is not there and how to draw the plot without it.
std::string run_by_hand(const std::string& trace, const std::string& png) {
  const std::string script = memory_plot_script_path(trace);
  std::string tmp;
  const int fd = open_temporary_beside(script, tmp);
  const std::string& text = plot_memory_trace_script();
  int err = fd < 0 ? errno : 0;
  if (err == 0 && ::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    err = errno != 0 ? errno : ENOSPC;
  }
  // Checked at start too (check_plot_script_path): it may have changed since.
  const std::string what = err == 0 ? not_a_regular_file(script) : std::string();
  if (err == 0 && what.empty() && ::rename(tmp.c_str(), script.c_str()) != 0) err = errno;
  if (fd >= 0) ::close(fd);
  if (err == 0 && what.empty()) {
    return str("run python3 ", shell_quoted(script), " ", shell_quoted(trace), " ", shell_quoted(png));
  }
  if (fd >= 0) ::unlink(tmp.c_str());
  return str("its plotting script could not be written to '", shown_path(script), "' (",
             what.empty() ? std::string(std::strerror(err)) : "it is " + what + " now",
             "): draw the plot with tools/plot_memory_trace.py of remat's source, given the trace and the plot's path");
}

}  // namespace

void check_plot_script_path(const std::string& trace) {
  const std::string script = memory_plot_script_path(trace);
  check_output_file({"the plot script beside --memory-trace", script, "memory.plot.py"});
  // Written only when the plot cannot be drawn, over a file of that name:
  // one remat wrote before may be replaced, a file of the user's may not.
  std::ifstream existing(script);
  std::string first;
  if (existing && std::getline(existing, first)) {
    std::string second;
    std::getline(existing, second);
    const std::string& ours = plot_memory_trace_script();
    if (ours.compare(0, first.size() + 1 + second.size(), first + "\n" + second) != 0) {
      throw ConfigError(str("--memory-trace '", shown_path(trace), "': '", shown_path(script),
                            "' exists and is not remat's plotting script, which is written there when the plot "
                            "cannot be drawn: move that file, or give --memory-trace another name"));
    }
  }
}

std::string plot_memory_trace(const std::string& trace, const std::string& png) {
  std::string script = (std::filesystem::temp_directory_path() / "remat_plot_XXXXXX.py").string();
  const int fd = ::mkstemps(script.data(), 3);
  if (fd < 0) {
    return str("its plot was not drawn (no temporary file: ", std::strerror(errno), "); ", run_by_hand(trace, png));
  }
  const std::string& text = plot_memory_trace_script();
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  std::string output;
  int status = -1;
  if (written) {
    // The first python3 that has matplotlib (a virtual environment's may not).
    const std::string command =
        str("for p in python3 /usr/bin/python3; do command -v \"$p\" >/dev/null 2>&1 && "
            "\"$p\" -c 'import matplotlib' >/dev/null 2>&1 && exec \"$p\" ",
            shell_quoted(script), " ", shell_quoted(trace), " ", shell_quoted(png), " 2>&1; done; exit 3");
    if (FILE* pipe = ::popen(command.c_str(), "r")) {
      char buffer[512];
      while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
      status = ::pclose(pipe);
    }
  }
  ::unlink(script.c_str());
  if (status == 0) return "";
  if (WIFEXITED(status) && WEXITSTATUS(status) == 3) {
    return str("its plot needs python3 with matplotlib (Debian/Ubuntu: apt-get install python3-matplotlib); "
               "then ", run_by_hand(trace, png));
  }
  while (!output.empty() && output.back() == '\n') output.pop_back();
  if (output.size() > 300) output = "..." + output.substr(output.size() - 300);
  return str("drawing its plot failed (", output.empty() ? "exit status " + std::to_string(status) : output,
             "); to see why, ", run_by_hand(trace, png));
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (b >= 1024 && u < 5) {
    b /= 1024;
    ++u;
  }
  return str(std::round(b * 10) / 10, " ", units[u]);
}

std::pair<std::string, std::string> human_bytes_apart(double a, double b) {
  // One more digit until the two differ, at most three; then the bytes.
  auto shown = [](double bytes, int digits) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    int u = 0;
    while (bytes >= 1024 && u < 5) {
      bytes /= 1024;
      ++u;
    }
    char text[64];
    std::snprintf(text, sizeof text, "%.*f %s", u == 0 ? 0 : digits, bytes, units[u]);
    return std::string(text);
  };
  for (int digits = 1; digits <= 3; ++digits) {
    if (shown(a, digits) != shown(b, digits) || a == b) {
      return digits == 1 ? std::make_pair(human_bytes(a), human_bytes(b))
                         : std::make_pair(shown(a, digits), shown(b, digits));
    }
  }
  return {str(static_cast<int64_t>(a), " B"), str(static_cast<int64_t>(b), " B")};
}

double memory_per_rank(c10::Device device) { return static_cast<double>(rank_memory(device).per_rank()); }

namespace {

// The GPT's cold estimate inputs at `micro`: the capacity beside the peak on
// a GPU; on the CPU only for "auto" (the figures otherwise as they were).
// Either way what each rank has (rank_memory), the figure the fit is judged by.
MemoryEstimateInputs gpt_inputs(const Config& c, int64_t vocab, int64_t micro, c10::Device device) {
  MemoryEstimateInputs inputs = cold_gpt_inputs(c, vocab, micro, device.type());
  if (device.is_cuda() || c.activation_checkpointing.device_memory_budget_auto) {
    const RankMemory m = rank_memory(device);
    inputs.device_capacity_bytes = m.per_rank();
    inputs.device_capacity_given = m.given;
  }
  return inputs;
}

}  // namespace

MicroBatchChooser gpt_micro_batch_fit(const Config& c, const GptAutoFacts& f) {
  return [c, f](int64_t limit) -> MicroBatchChoice {
    if (f.have <= 0) {
      return {0, str("the memory each rank has is unknown here (", f.have_what,
                     "): set REMAT_MEMORY_PER_RANK_BYTES, or give train_micro_batch_size_per_gpu a number")};
    }
    const int64_t sequences = std::max<int64_t>(1, f.train_tokens / std::max(1, c.model.seq_len));
    const int64_t cap = std::min(limit, sequences);
    const auto budget = static_cast<int64_t>(f.have * 0.9);
    const int64_t micro = largest_fitting_micro_batch(
        c, f.world_size, budget, cap, [&](int64_t m) { return gpt_inputs(c, f.vocab, m, f.device); });
    const std::string of = str(human_bytes(static_cast<double>(budget)), ", nine tenths of the ",
                               human_bytes(f.have), " each rank has (", f.have_what, ")");
    if (micro < 1) {
      const std::string why = str("the estimated peak of one sequence per rank exceeds ", of);
      if (f.none_fits == nullptr) return {0, why};
      *f.none_fits = why;
      return {1, why + "; shown at micro-batch 1, which does not fit"};
    }
    const int64_t peak =
        estimate_memory(c, f.world_size, gpt_inputs(c, f.vocab, micro, f.device)).configured().peak_bytes;
    // Where the bound, not the memory, stopped it.
    const std::string bound = micro < cap           ? std::string()
                              : cap == sequences    ? " (the training split's sequences of model.seq_len)"
                              : cap == limit && limit < kMaxAutoMicroBatch ? " (train_batch_size / data-parallel size)"
                                                                           : " (remat's bound)";
    return {micro, str("the largest micro-batch", bound.empty() ? "" : str(" up to ", cap, bound),
                       " whose estimated peak per rank (", human_bytes(static_cast<double>(peak)), ") fits ", of)};
  };
}

bool decide_gpt_autos(Config& c, const GptAutoFacts& f) {
  decide_precision_autos(c, f.device.str(), f.device.is_cuda(), f.computes_bf16, f.assumed_gpu);
  const bool measured = c.is_undecided_auto("train_micro_batch_size_per_gpu") &&
                        !(c.train_batch_size && c.gradient_accumulation_steps);
  if (!measured) decide_batch_autos(c, f.dp);
  return measured;
}

MemoryEstimate check_memory_estimate(const Config& c, const BatchSizes& batch, int64_t vocab, int world_size,
                                     c10::Device device) {
  const MemoryEstimateInputs inputs = gpt_inputs(c, vocab, batch.micro_batch_per_gpu, device);
  const MemoryEstimate e = estimate_memory(c, world_size, inputs);
  log_rank0().info("{}", e.line());
  const double have = memory_per_rank(device);
  const MemoryEstimateRow& row = e.configured();
  if (have > 0 && static_cast<double>(row.peak_bytes) > have) {
    const std::string change = cheapest_fitting_change(e, static_cast<int64_t>(have));
    const auto [need, has] = human_bytes_apart(static_cast<double>(row.peak_bytes), have);
    throw ConfigError(str("this config needs about ", need, " per rank (", e.line(), ") but about ", has,
                          " is available to each rank", device.is_cuda() ? "'s GPU" : " on this host", ": ",
                          change.empty() ? "no ZeRO stage or checkpointing policy fits; lower "
                                           "train_micro_batch_size_per_gpu, model.seq_len or the model's size "
                                           "(model.n_layer, model.d_model, model.d_ff)"
                                         : "the cheapest change that fits: " + change,
                          ". remat-estimate prints the whole table"));
  }
  return e;
}

Progress::Progress(int64_t first, int64_t total, int64_t every, bool enabled)
  : first_(first), total_(total), every_(every), enabled_(enabled), terminal_(use_bar()), start_(Clock::now()) {}

// REMAT_PROGRESS=bar|lines; unset: a bar when stdout is a terminal and no
// launcher is in between (Open MPI hands ranks a pty, so remat-run decides).
bool Progress::use_bar() {
  auto mode = knobs::get(knobs::kProgress);
  if (mode) {
    if (*mode != "bar" && *mode != "lines") {
      throw ConfigError(str(knobs::kProgress, "='", *mode, "' must be bar or lines"));
    }
    return *mode == "bar";
  }
  return ::isatty(::fileno(stdout)) != 0 && !knobs::get("OMPI_COMM_WORLD_SIZE");
}

void Progress::step(int64_t step, double loss, double tokens_per_s, int64_t peak) {
  show(step, loss, tokens_per_s, human_bytes(static_cast<double>(peak)));
}

void Progress::step(int64_t step, double tokens_per_s, const StepMetrics& m) {
  std::string peak = human_bytes(static_cast<double>(m.mem_peak_bytes - m.mem_base_bytes));
  if (m.cuda_allocator) {
    peak += str("  cuda ", human_bytes(static_cast<double>(m.cuda_peak_allocated_bytes)), " / ",
                human_bytes(static_cast<double>(m.cuda_peak_reserved_bytes)));
  }
  show(step, m.loss, tokens_per_s, peak, m.loss_scale);
}

void Progress::show(int64_t step, double loss, double tokens_per_s, const std::string& peak,
                    double loss_scale) {
  if (!enabled_) return;
  double elapsed = ms_between(start_, Clock::now()) / 1000;
  double eta = (step > first_) ? elapsed / (step - first_) * (total_ - step) : 0;
  const std::string scale = loss_scale > 0 ? str("  scale ", loss_scale) : std::string();
  if (terminal_) {
    int width = 30, filled = static_cast<int>(width * step / std::max<int64_t>(total_, 1));
    std::printf("\r[%s%s] %lld/%lld loss %.4f%s  %.0f tok/s  peak %s  ETA %02d:%02d ",
                std::string(filled, '=').c_str(), std::string(width - filled, ' ').c_str(),
                static_cast<long long>(step), static_cast<long long>(total_), loss, scale.c_str(), tokens_per_s,
                peak.c_str(), static_cast<int>(eta) / 60, static_cast<int>(eta) % 60);
    if (step == total_) std::printf("\n");
  } else if (step % every_ == 0 || step == first_ + 1 || step == total_) {
    std::printf("step %lld/%lld  loss %.4f%s  %.0f tok/s  peak %s  eta %.0fs\n",
                static_cast<long long>(step), static_cast<long long>(total_), loss, scale.c_str(), tokens_per_s,
                peak.c_str(), eta);
  }
  std::fflush(stdout);
}

void Progress::line(const std::string& text) {
  if (!enabled_) return;
  std::printf("%s%s\n", terminal_ ? "\n" : "", text.c_str());
  std::fflush(stdout);
}

// A resumed run's --metrics file keeps only the lines of the steps up to the
// one it resumed at: a run resumed from an earlier step writes the later ones
// again. Rewritten to a temporary file beside it, then renamed over it; a
// device or fifo is left as it is.
void keep_metrics_through(const std::string& path, int64_t step) {
  std::error_code ec;
  const std::string real = std::filesystem::canonical(path, ec).string();  // through a symbolic link
  struct stat st {};
  if (ec || ::stat(real.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  std::ifstream in(real);
  std::string line, kept;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    // A line cut short by a killed run is not a step: dropped too.
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() <= step) {
      kept += line + "\n";
    } else {
      ++dropped;
    }
  }
  if (dropped == 0) return;
  auto failed = [&](const std::string& what) {
    return ConfigError(str("cannot rewrite the --metrics file '", path, "' to keep its steps up to ", step,
                           ": ", what, " (", std::strerror(errno), "); give a file path in a writable folder"));
  };
  std::string tmp;
  const int fd = open_temporary_beside(real, tmp);
  if (fd < 0) throw failed("cannot create a file beside it");
  ::fchmod(fd, st.st_mode & 07777);
  const bool written = ::write(fd, kept.data(), kept.size()) == static_cast<ssize_t>(kept.size()) && ::fsync(fd) == 0;
  // Renamed while open (and so locked): a writer at work is never taken for a stale one.
  if (!written || ::rename(tmp.c_str(), real.c_str()) != 0) {
    const ConfigError error = failed(str("writing '", tmp, "' failed"));
    ::close(fd);
    ::unlink(tmp.c_str());
    throw error;
  }
  ::close(fd);
  log().info("--metrics '{}': kept the lines of steps up to {}, dropped {} later or incomplete ones", path, step,
             dropped);
}

}  // namespace remat
