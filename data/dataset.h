// Byte-level text data for remat-train.
//
// The vocabulary is the set of distinct bytes in the text. Training windows are
// drawn by a counter-based generator: window i of data-parallel rank r depends
// only on (seed, r, i), so the stream position is a single integer that a
// resumed run restores, and ranks draw different windows.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace remat::data {

// The corpus compiled into the binaries (data/corpus.inc).
std::string_view embedded_corpus();

// The largest data.path file load() reads: 256 MiB (each byte becomes an
// int64 token, so 2 GiB of tokens); a larger file or a device is refused.
inline constexpr int64_t kMaxCorpusBytes = int64_t{256} << 20;

class Dataset {
 public:
  // `source` names the text in errors. The first train_fraction of the text is
  // for training, the rest held out.
  Dataset(std::string text, double train_fraction, int64_t seq_len, std::string source);

  // The embedded corpus when `path` is empty, else the file. A missing, empty,
  // too short or too large file (kMaxCorpusBytes), or a directory, is a
  // ConfigError naming it.
  static Dataset load(const std::string& path, double train_fraction, int64_t seq_len);

  int64_t vocab_size() const { return static_cast<int64_t>(itos_.size()); }
  int64_t train_size() const { return train_end_; }
  int64_t val_size() const { return static_cast<int64_t>(tokens_.size()) - train_end_; }
  const std::string& source() const { return source_; }

  // Inputs and targets [batch, seq_len] (int64), windows first_window ... of the
  // training stream of data-parallel rank `dp_rank`.
  std::pair<at::Tensor, at::Tensor> train_batch(uint64_t seed, int dp_rank, int64_t first_window,
                                                int64_t batch) const;
  // Held-out batch `index` (the same on every rank).
  std::pair<at::Tensor, at::Tensor> val_batch(int64_t index, int64_t batch) const;

  at::Tensor encode(const std::string& text) const;  // unknown bytes map to id 0
  std::string decode(const at::Tensor& ids) const;

 private:
  std::pair<at::Tensor, at::Tensor> windows(const std::vector<int64_t>& starts) const;

  std::string source_;
  int64_t seq_len_;
  std::vector<int64_t> tokens_;
  int64_t train_end_ = 0;
  std::string itos_;
  std::array<int16_t, 256> stoi_{};
};

}  // namespace remat::data
