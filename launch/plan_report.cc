#include "launch/plan_report.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat {
namespace {

namespace fs = std::filesystem;

// `text` as one word for sh.
std::string shell_quoted(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace

void check_plan_report_dir(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    throw ConfigError(str("--plan-report '", dir, "' is a file, not a folder: give a folder for frontier.csv and "
                          "frontier.png (it is created when missing)"));
  }
  fs::create_directories(dir, ec);
  if (ec) {
    throw ConfigError(str("--plan-report: cannot create the folder '", dir, "' (", ec.message(),
                          "): give a folder this process can create or write"));
  }
  const fs::path probe = fs::path(dir) / ".remat-plan-report-probe";
  std::ofstream out(probe);
  const int err = errno;
  if (!out) {
    throw ConfigError(str("--plan-report: cannot write in the folder '", dir, "' (", std::strerror(err),
                          "): give a writable folder"));
  }
  out.close();
  fs::remove(probe, ec);
}

bool plot_frontier(const std::string& dir) {
  const fs::path script = fs::path(dir) / "plot_frontier.py";
  const fs::path csv = fs::path(dir) / "frontier.csv", png = fs::path(dir) / "frontier.png";
  {
    std::ofstream out(script, std::ios::trunc);
    out << plot_frontier_script();
    if (!out) {
      log_rank0().warn("--plan-report: cannot write {} ({}): the frontier stays a CSV", script.string(),
                       std::strerror(errno));
      return false;
    }
  }
  const std::string command =
      str("python3 ", shell_quoted(script.string()), " ", shell_quoted(csv.string()), " ", shell_quoted(png.string()));
  if (std::system("python3 -c 'import matplotlib' >/dev/null 2>&1") != 0) {
    log_rank0().warn("--plan-report: python3 with matplotlib is not here (Debian: apt-get install "
                     "python3-matplotlib), so the frontier is not drawn; to draw it: {}", command);
    return false;
  }
  if (std::system((command + " >/dev/null 2>&1").c_str()) != 0) {
    log_rank0().warn("--plan-report: drawing the frontier failed; run it to see why: {}", command);
    return false;
  }
  log_rank0().info("--plan-report: drew the frontier in {}", png.string());
  return true;
}

}  // namespace remat
