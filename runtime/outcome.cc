#include "runtime/outcome.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/error.h"

namespace remat {
namespace {

enum Outcome : int64_t { kSucceeded = 0, kFailed = 1, kFailedConfig = 2 };

// Each rank's text, on every rank.
std::vector<std::string> all_gather_text(Communicator& group, const std::string& mine) {
  const int n = group.size();
  at::Tensor length = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lengths = at::empty({n}, at::kLong);
  group.allGather(lengths, length)->wait();
  const int64_t longest = std::max<int64_t>(lengths.max().item<int64_t>(), 1);
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  if (!mine.empty()) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({n * longest}, at::kByte);
  group.allGather(all, bytes)->wait();
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) {
    out.emplace_back(static_cast<const char*>(all.data_ptr()) + r * longest, lengths[r].item<int64_t>());
  }
  return out;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string out = ranks.size() > 1 ? "ranks " : "rank ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i > 0 ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

// The one error every rank throws: the failing ranks grouped by message.
std::string agreed_message(const std::vector<std::pair<std::string, std::vector<int>>>& failures,
                           const std::string& what, int n) {
  if (failures.size() == 1) {
    // One message keeps its own beginning (what callers and scripts match on).
    const auto& [message, ranks] = failures[0];
    return str(message, " (", what, " failed on ", ranks_text(ranks), " of ", n,
               static_cast<int>(ranks.size()) == n ? ")" : "; every rank stops with this error)");
  }
  std::string text = str(what, " failed on several ranks of ", n, ":");
  for (const auto& [message, ranks] : failures) text += str("\n  ", ranks_text(ranks), ": ", message);
  return text;
}

}  // namespace

void agree_on_outcome(Communicator& group, const std::string& what, const std::function<void()>& part) {
  if (group.size() == 1) {
    part();
    return;
  }
  int64_t outcome = kSucceeded;
  std::string message;
  try {
    part();
  } catch (const CommError&) {
    throw;
  } catch (const ConfigError& e) {
    outcome = kFailedConfig;
    message = e.what();
  } catch (const std::exception& e) {
    outcome = kFailed;
    message = e.what();
  }
  const int n = group.size();
  at::Tensor outcomes = at::empty({n}, at::kLong);
  group.allGather(outcomes, at::full({1}, outcome, at::kLong))->wait();
  if ((outcomes == kSucceeded).all().item<bool>()) return;
  const std::vector<std::string> messages = all_gather_text(group, message);
  std::vector<std::pair<std::string, std::vector<int>>> failures;
  int first = -1;
  for (int r = 0; r < n; ++r) {
    if (outcomes[r].item<int64_t>() == kSucceeded) continue;
    if (first < 0) first = r;
    auto slot = std::find_if(failures.begin(), failures.end(), [&](const auto& f) { return f.first == messages[r]; });
    if (slot == failures.end()) {
      failures.push_back({messages[r], {r}});
    } else {
      slot->second.push_back(r);
    }
  }
  const std::string text = agreed_message(failures, what, n);
  if (outcomes[first].item<int64_t>() == kFailedConfig) throw ConfigError(text);
  throw Error(text);
}

}  // namespace remat
