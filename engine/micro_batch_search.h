// train_micro_batch_size_per_gpu "auto" by measurement (docs/config.md,
// "auto"): the candidates up to what fits, one forward+backward timed at
// each, and the throughput knee: the smallest candidate whose tokens/s is
// within a tolerance of the best. The rule and the search's driver are here,
// free of any model: the engine gives the driver a pass (one forward and
// backward of a micro-batch through its wiring) and the slowest of the ranks'
// times (an all-reduce), so every rank decides the same.
//
//   remat::MicroBatchSearch s = remat::search_micro_batch(
//       remat::micro_batch_candidates(/*fit=*/300), /*tokens_per_sample=*/64,
//       [&](int64_t micro) { return seconds_of_one_pass(micro); },
//       [&](std::vector<double> t) { return slowest_over_ranks(t); });
//   s.chosen_micro();  // e.g. 16
//   s.line();          // "micro-batch search: ... -> 16"
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace remat {

struct MicroBatchSearchOptions {
  // The knee: the smallest candidate whose tokens/s is at least
  // (1 - tolerance) x the best; and growth stops once `patience` candidates
  // in a row do not beat the best before them by more than (1 + tolerance)
  // (more than one: a pass slowed by something else running does not end the
  // search).
  double tolerance = 0.05;
  int patience = 2;
  // Untimed passes per candidate (the first allocations, the kernels' set-up).
  int warmup = 1;
  // Timed passes per candidate: at least min_passes, more up to timed_seconds
  // of them (at most max_passes); the candidate's time is the fastest.
  int min_passes = 3;
  int max_passes = 32;
  double timed_seconds = 0.2;
  // Once growth stops, the candidates within twice the tolerance of the best
  // are timed again and keep their faster round, before the knee is taken.
  bool confirm = true;
  // Growth stops at the first candidate whose warm-up pass takes more than
  // candidate_seconds / (1 + min_passes): that candidate is timed by its
  // warm-up alone and is the last. Each candidate costs about
  // candidate_seconds at most.
  double candidate_seconds = 2.0;
};

// One candidate measured: the slowest rank's fastest pass.
struct MicroBatchTrial {
  int64_t micro = 0;
  double seconds = 0;       // one forward+backward
  double tokens_per_s = 0;  // per rank: micro x tokens per sample / seconds
};

// The candidates up to `fit` (>= 1): the powers of two below it and `fit`
// itself. With `divides` > 0 (train_batch_size / data-parallel size), each
// becomes the largest divisor of `divides` at most itself, without repeats.
std::vector<int64_t> micro_batch_candidates(int64_t fit, int64_t divides = 0);

// The knee of `trials` (ascending micro-batches, at least one): the index of
// the smallest micro-batch whose tokens/s is at least (1 - tolerance) x the
// best (the edge included; equal figures: the smaller micro-batch).
size_t throughput_knee(const std::vector<MicroBatchTrial>& trials, double tolerance);

// A finished search: what was measured, what was chosen, why it stopped.
struct MicroBatchSearch {
  std::vector<int64_t> candidates;  // every candidate up to the fit
  std::vector<MicroBatchTrial> trials;  // those measured, ascending
  size_t chosen = 0;                    // index into trials
  double tolerance = 0.05;
  std::string stopped;  // why growth stopped before the last candidate; empty: every candidate measured
  double seconds = 0;   // the search's wall time (this rank)

  int64_t chosen_micro() const { return trials.at(chosen).micro; }
  // The reason of the decided value (AutoValue::why).
  std::string why() const;
  // One line for the log: the candidates, each measured one's tokens/s, the choice.
  std::string line() const;
  nlohmann::json to_json() const;
};

// The seconds of one pass at `micro` on this rank (it may run collectives:
// every rank calls it alike).
using MicroBatchPass = std::function<double(int64_t micro)>;
// The slowest rank's value of each element (every rank gets the same); the
// identity for one process.
using SlowestOfRanks = std::function<std::vector<double>(std::vector<double>)>;

// Measures the candidates in order, each after options.warmup passes, until
// `patience` in a row stop improving the best tokens/s by more than the
// tolerance, a pass exceeds the per-candidate budget or the candidates end;
// times those near the best again (options.confirm); chooses the knee. Every decision to go on is taken on `slowest`'s figures, so every
// rank measures the same candidates with the same number of passes.
MicroBatchSearch search_micro_batch(const std::vector<int64_t>& candidates, int64_t tokens_per_sample,
                                    const MicroBatchPass& pass, const SlowestOfRanks& slowest,
                                    const MicroBatchSearchOptions& options = {});

}  // namespace remat
