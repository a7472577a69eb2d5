#include "runtime/agreement.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/error.h"

namespace remat {
namespace {

// key \0 value \0 ... (keys in map order, so equal maps encode equally).
std::string encode(const std::map<std::string, std::string>& settings) {
  std::string out;
  for (const auto& [key, value] : settings) {
    out.append(key).push_back('\0');
    out.append(value).push_back('\0');
  }
  return out;
}

std::map<std::string, std::string> decode(const std::string& text) {
  std::map<std::string, std::string> out;
  size_t at = 0;
  while (at < text.size()) {
    const size_t k = text.find('\0', at);
    if (k == std::string::npos) break;
    const size_t v = text.find('\0', k + 1);
    if (v == std::string::npos) break;
    out[text.substr(at, k - at)] = text.substr(k + 1, v - k - 1);
    at = v + 1;
  }
  return out;
}

int64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  int64_t out;
  std::memcpy(&out, &h, sizeof out);
  return out;
}

// "0-2, 5" from {0, 1, 2, 5}.
std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) out += (j == i + 1 ? ", " : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace

void require_same_settings(Communicator& group, const std::map<std::string, std::string>& settings,
                           const std::string& what) {
  const int n = group.size();
  if (n == 1) return;
  const std::string mine = encode(settings);
  // One number per rank first: the common case moves 8 bytes a rank.
  at::Tensor hash = at::full({1}, fnv1a(mine), at::kLong);
  at::Tensor hashes = at::empty({n}, at::kLong);
  group.allGather(hashes, hash)->wait();
  if ((hashes == hashes[0]).all().item<bool>()) return;

  at::Tensor length = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lengths = at::empty({n}, at::kLong);
  group.allGather(lengths, length)->wait();
  at::Tensor bytes = at::empty({static_cast<int64_t>(mine.size())}, at::kByte);
  if (!mine.empty()) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  std::vector<at::Tensor> all;
  for (int r = 0; r < n; ++r) all.push_back(at::empty({lengths[r].item<int64_t>()}, at::kByte));
  group.allGather(all, bytes)->wait();

  std::vector<std::map<std::string, std::string>> per_rank;
  for (const auto& t : all) {
    per_rank.push_back(decode(std::string(static_cast<const char*>(t.data_ptr()), t.numel())));
  }
  std::map<std::string, bool> keys;
  for (const auto& m : per_rank) {
    for (const auto& item : m) keys[item.first] = true;
  }
  std::string differences;
  int shown = 0, differing = 0;
  for (const auto& item : keys) {
    const std::string& key = item.first;
    // value (or "<not set>") -> ranks holding it, in first-seen order.
    std::vector<std::pair<std::string, std::vector<int>>> values;
    for (int r = 0; r < n; ++r) {
      auto it = per_rank[r].find(key);
      const std::string v = it == per_rank[r].end() ? "<not set>" : it->second;
      auto slot = std::find_if(values.begin(), values.end(), [&](const auto& e) { return e.first == v; });
      if (slot == values.end()) {
        values.push_back({v, {r}});
      } else {
        slot->second.push_back(r);
      }
    }
    if (values.size() == 1) continue;
    ++differing;
    if (++shown > 8) continue;
    differences += "\n  " + key + ":";
    for (const auto& [v, ranks] : values) {
      differences += str(" ", v, " on rank", ranks.size() > 1 ? "s " : " ", rank_list(ranks), ";");
    }
    differences.pop_back();
  }
  if (differing > 8) differences += str("\n  (and ", differing - 8, " more)");
  throw ConfigError(str("the ranks of this job were started with different ", what, " (", differing,
                        differing == 1 ? " key differs" : " keys differ", "):", differences,
                        "\nEvery rank must run the same configuration: give every rank the same "
                        "file, --set overrides and flags"));
}

}  // namespace remat
