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

#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat {
namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Host memory available to this process: MemAvailable shared by the ranks on
// this host; 0 when unknown.
double available_bytes_per_rank() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (meminfo >> key) {
    if (key == "MemAvailable:") {
      meminfo >> kib;
      break;
    }
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  int local_ranks = 1;
  if (auto v = knobs::get("OMPI_COMM_WORLD_LOCAL_SIZE")) local_ranks = std::max(1, std::atoi(v->c_str()));
  return kib * 1024 / local_ranks;
}

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

std::string plot_memory_trace(const std::string& trace, const std::string& png) {
  const std::string by_hand = str("python3 tools/plot_memory_trace.py ", trace, " ", png);
  std::string script = (std::filesystem::temp_directory_path() / "remat_plot_XXXXXX.py").string();
  const int fd = ::mkstemps(script.data(), 3);
  if (fd < 0) return str("its plot was not drawn (no temporary file: ", std::strerror(errno), "); run ", by_hand);
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
               "then run ", by_hand);
  }
  while (!output.empty() && output.back() == '\n') output.pop_back();
  if (output.size() > 300) output = "..." + output.substr(output.size() - 300);
  return str("drawing its plot failed (", output.empty() ? "exit status " + std::to_string(status) : output,
             "); run ", by_hand, " to see why");
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

// A lower bound of what one rank needs, from the config alone (computed in
// double, so absurd sizes cannot overflow): fp32 parameters, gradients and
// AdamW's two moments (16 bytes a parameter: 4 + 4 + 8 / N at ZeRO stage 1,
// 4 + 12 / N at stage 2, 16 / N at stage 3 over N sharding ranks; all divided
// by the tensor-parallel size), each block's input kept for backward, and the logits. A run
// whose lower bound exceeds the memory there is refused before anything is
// built, naming the keys to change.
void check_memory_estimate(const Config& c, const BatchSizes& batch, int64_t vocab, int dp) {
  const auto& m = c.model;
  const double d = m.d_model, L = m.n_layer, T = m.seq_len, B = static_cast<double>(batch.micro_batch_per_gpu);
  const double params = (vocab + T) * d + L * (4 * d * d + 2 * d * m.d_ff) + vocab * d;
  const int hybrid = c.zero_optimization.hybrid_shard_size;
  const double n = hybrid > 0 && hybrid < dp ? hybrid : dp;
  const double per_param[] = {16, 8 + 8 / n, 4 + 12 / n, 16 / n};
  const double model_bytes = per_param[std::clamp(c.zero_optimization.stage, 0, 3)] * params /
                             static_cast<double>(c.tensor_parallel.size);
  const double activation_bytes = 4 * B * T * (L * d + vocab);
  const double need = model_bytes + activation_bytes;
  const double have = available_bytes_per_rank();
  if (have > 0 && need > have) {
    throw ConfigError(str("this config needs at least ", human_bytes(need), " per rank (model state ",
                          human_bytes(model_bytes), ", one step's activations ", human_bytes(activation_bytes),
                          " at train_micro_batch_size_per_gpu ", batch.micro_batch_per_gpu,
                          ") but about ", human_bytes(have),
                          " is available to each rank on this host: lower train_micro_batch_size_per_gpu, "
                          "model.seq_len or the model's size (model.n_layer, model.d_model, model.d_ff)"));
  }
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
  if (!enabled_) return;
  double elapsed = ms_between(start_, Clock::now()) / 1000;
  double eta = (step > first_) ? elapsed / (step - first_) * (total_ - step) : 0;
  if (terminal_) {
    int width = 30, filled = static_cast<int>(width * step / std::max<int64_t>(total_, 1));
    std::printf("\r[%s%s] %lld/%lld loss %.4f  %.0f tok/s  peak %s  ETA %02d:%02d ",
                std::string(filled, '=').c_str(), std::string(width - filled, ' ').c_str(),
                static_cast<long long>(step), static_cast<long long>(total_), loss, tokens_per_s,
                human_bytes(static_cast<double>(peak)).c_str(), static_cast<int>(eta) / 60,
                static_cast<int>(eta) % 60);
    if (step == total_) std::printf("\n");
  } else if (step % every_ == 0 || step == first_ + 1 || step == total_) {
    std::printf("step %lld/%lld  loss %.4f  %.0f tok/s  peak %s  eta %.0fs\n",
                static_cast<long long>(step), static_cast<long long>(total_), loss, tokens_per_s,
                human_bytes(static_cast<double>(peak)).c_str(), eta);
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
  std::string tmp = real + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) throw failed("cannot create a file beside it");
  ::fchmod(fd, st.st_mode & 07777);
  const bool written = ::write(fd, kept.data(), kept.size()) == static_cast<ssize_t>(kept.size()) && ::fsync(fd) == 0;
  if (::close(fd) != 0 || !written || ::rename(tmp.c_str(), real.c_str()) != 0) {
    const ConfigError error = failed(str("writing '", tmp, "' failed"));
    ::unlink(tmp.c_str());
    throw error;
  }
  log().info("--metrics '{}': kept the lines of steps up to {}, dropped {} later or incomplete ones", path, step,
             dropped);
}

}  // namespace remat
