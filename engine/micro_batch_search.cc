#include "engine/micro_batch_search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "runtime/error.h"

namespace remat {
namespace {

// "41.2k" tokens/s, "950" below a thousand.
std::string rate(double tokens_per_s) {
  char text[32];
  if (tokens_per_s >= 1000) {
    std::snprintf(text, sizeof text, "%.1fk", tokens_per_s / 1000);
  } else {
    std::snprintf(text, sizeof text, "%.0f", tokens_per_s);
  }
  return text;
}

std::string percent(double fraction) {
  char text[16];
  std::snprintf(text, sizeof text, "%g %%", fraction * 100);
  return text;
}

// `value` at least (1 - tolerance) x `best`, the edge included (a relative
// slack of 1e-9 for the rounding of the product).
bool within(double value, double best, double tolerance) {
  return value >= best * (1.0 - tolerance) - 1e-9 * best;
}

}  // namespace

std::vector<int64_t> micro_batch_candidates(int64_t fit, int64_t divides) {
  REMAT_CHECK_GE(fit, 1, "micro_batch_candidates: the largest micro-batch that fits");
  std::vector<int64_t> raw;
  for (int64_t m = 1; m < fit; m *= 2) raw.push_back(m);
  raw.push_back(fit);
  std::vector<int64_t> out;
  for (int64_t m : raw) {
    if (divides > 0) {
      m = std::min(m, divides);
      while (divides % m != 0) --m;  // ends at 1 at the latest
    }
    if (out.empty() || out.back() < m) out.push_back(m);
  }
  return out;
}

size_t throughput_knee(const std::vector<MicroBatchTrial>& trials, double tolerance) {
  REMAT_CHECK(!trials.empty(), "throughput_knee: no candidate was measured");
  double best = 0;
  for (const auto& t : trials) best = std::max(best, t.tokens_per_s);
  for (size_t i = 0; i < trials.size(); ++i) {
    if (within(trials[i].tokens_per_s, best, tolerance)) return i;
  }
  return trials.size() - 1;  // not reached: the best is within itself
}

std::string MicroBatchSearch::why() const {
  const MicroBatchTrial& c = trials.at(chosen);
  double best = 0;
  int64_t best_micro = 0;
  for (const auto& t : trials) {
    if (t.tokens_per_s > best) best = t.tokens_per_s, best_micro = t.micro;
  }
  return str("the throughput knee: the smallest measured micro-batch whose forward+backward tokens/s per rank (",
             rate(c.tokens_per_s), ") is within ", percent(tolerance), " of the best (", rate(best), " at ",
             best_micro, "); ", trials.size(), " of ", candidates.size(), " candidates up to ", candidates.back(),
             " (the largest that fits) measured in ", std::round(seconds * 10) / 10, " s",
             stopped.empty() ? std::string() : str(" (", stopped, ")"));
}

std::string MicroBatchSearch::line() const {
  std::string out = "micro-batch search (forward+backward tokens/s per rank, the slowest rank's):";
  for (size_t i = 0; i < trials.size(); ++i) {
    out += str(" ", trials[i].micro, ": ", rate(trials[i].tokens_per_s), i == chosen ? " *" : "");
  }
  const size_t left = candidates.size() - trials.size();
  if (left > 0) {
    out += left == 1 ? str(" (", candidates.back(), " not measured)")
                     : str(" (", left, " more up to ", candidates.back(), " not measured)");
  }
  return str(out, "; chose ", chosen_micro(), ", the smallest within ", percent(tolerance), " of the best, in ",
             std::round(seconds * 10) / 10, " s", stopped.empty() ? std::string() : str(" (", stopped, ")"));
}

nlohmann::json MicroBatchSearch::to_json() const {
  nlohmann::json measured = nlohmann::json::array();
  for (const auto& t : trials) {
    measured.push_back({{"micro", t.micro}, {"seconds", t.seconds}, {"tokens_per_s", t.tokens_per_s}});
  }
  return {{"candidates", candidates}, {"measured", measured}, {"chosen", chosen_micro()},
          {"tolerance", tolerance}, {"stopped", stopped}, {"seconds", seconds}};
}

namespace {

// Whether a candidate whose pass takes `seconds` (the slowest rank's) is
// over the per-candidate budget: timed by its warm-up alone.
bool over_budget(double seconds, const MicroBatchSearchOptions& o) {
  return seconds * (1 + o.min_passes) > o.candidate_seconds;
}

// Timed passes at `micro` (as many as a pass of `seconds`, the slowest
// rank's, allows: every rank runs the same number), the slowest rank's fastest.
double timed(int64_t micro, double seconds, const MicroBatchPass& pass, const SlowestOfRanks& slowest,
             const MicroBatchSearchOptions& o) {
  const double wanted = std::ceil(o.timed_seconds / std::max(seconds, 1e-9));
  const int passes = static_cast<int>(std::clamp<double>(wanted, o.min_passes, std::max(o.max_passes, o.min_passes)));
  double fastest = pass(micro);
  for (int i = 1; i < passes; ++i) fastest = std::min(fastest, pass(micro));
  return slowest({fastest}).at(0);
}

double tokens_per_s(int64_t micro, int64_t tokens_per_sample, double seconds) {
  return static_cast<double>(micro * tokens_per_sample) / std::max(seconds, 1e-12);
}

// One candidate: its warm-up, then its timed passes. `last` is set when the
// warm-up alone exceeds the per-candidate budget (its time is then the
// warm-up's).
MicroBatchTrial measure(int64_t micro, int64_t tokens_per_sample, const MicroBatchPass& pass,
                        const SlowestOfRanks& slowest, const MicroBatchSearchOptions& o, bool& last) {
  double warm = 0;
  for (int i = 0; i < std::max(o.warmup, 1); ++i) warm = std::max(warm, pass(micro));
  warm = slowest({warm}).at(0);  // every rank decides the passes alike
  last = over_budget(warm, o);
  const double seconds = last ? warm : timed(micro, warm, pass, slowest, o);
  return {micro, seconds, tokens_per_s(micro, tokens_per_sample, seconds)};
}

// The candidates near the best (within twice the tolerance) timed again, each
// keeping its faster round: a round slowed by something else running moves
// the choice less. Candidates over the budget are not timed again.
void confirm(std::vector<MicroBatchTrial>& trials, int64_t tokens_per_sample, const MicroBatchPass& pass,
             const SlowestOfRanks& slowest, const MicroBatchSearchOptions& o) {
  double best = 0;
  for (const auto& t : trials) best = std::max(best, t.tokens_per_s);
  for (auto& t : trials) {
    if (!within(t.tokens_per_s, best, 2 * o.tolerance) || over_budget(t.seconds, o)) continue;
    t.seconds = std::min(t.seconds, timed(t.micro, t.seconds, pass, slowest, o));
    t.tokens_per_s = tokens_per_s(t.micro, tokens_per_sample, t.seconds);
  }
}

}  // namespace

MicroBatchSearch search_micro_batch(const std::vector<int64_t>& candidates, int64_t tokens_per_sample,
                                    const MicroBatchPass& pass, const SlowestOfRanks& slowest,
                                    const MicroBatchSearchOptions& options) {
  REMAT_CHECK(!candidates.empty(), "search_micro_batch: no candidate");
  REMAT_CHECK(options.tolerance >= 0 && options.tolerance < 1, "search_micro_batch: tolerance ", options.tolerance,
              " must be in [0, 1)");
  const auto start = std::chrono::steady_clock::now();
  MicroBatchSearch s;
  s.candidates = candidates;
  s.tolerance = options.tolerance;
  double best = 0;
  int flat = 0;  // candidates in a row that did not beat the best by more than the tolerance
  for (size_t i = 0; i < candidates.size(); ++i) {
    bool last = false;
    const MicroBatchTrial t = measure(candidates[i], std::max<int64_t>(tokens_per_sample, 1), pass, slowest, options,
                                      last);
    s.trials.push_back(t);
    const bool more = i + 1 < candidates.size();
    if (more && last) {
      s.stopped = str("a pass at ", t.micro, " took ", std::round(t.seconds * 100) / 100, " s, past the budget of ",
                      options.candidate_seconds, " s per candidate");
      break;
    }
    flat = i > 0 && t.tokens_per_s <= best * (1 + options.tolerance) ? flat + 1 : 0;
    best = std::max(best, t.tokens_per_s);
    if (more && flat >= std::max(options.patience, 1)) {
      s.stopped = flat == 1 ? str(t.micro, " did not beat the best before it by more than ", percent(options.tolerance))
                            : str(flat, " candidates in a row, up to ", t.micro,
                                  ", did not beat the best before them by more than ", percent(options.tolerance));
      break;
    }
  }
  if (options.confirm) confirm(s.trials, std::max<int64_t>(tokens_per_sample, 1), pass, slowest, options);
  s.chosen = throughput_knee(s.trials, options.tolerance);
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return s;
}

}  // namespace remat
