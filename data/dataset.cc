#include "data/dataset.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "runtime/error.h"

extern "C" {
extern const char remat_corpus_begin[];
extern const char remat_corpus_end[];
}

namespace remat::data {
namespace {

// SplitMix64: a well-mixed 64-bit value from a counter.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

std::string_view embedded_corpus() {
  return std::string_view(remat_corpus_begin, remat_corpus_end - remat_corpus_begin);
}

Dataset::Dataset(std::string text, double train_fraction, int64_t seq_len, std::string source)
    : source_(std::move(source)), seq_len_(seq_len) {
  if (text.empty()) {
    throw ConfigError(str("data: '", source_, "' is empty; point data.path at a text file"));
  }
  std::array<bool, 256> seen{};
  for (unsigned char c : text) seen[c] = true;
  stoi_.fill(-1);
  for (int c = 0; c < 256; ++c) {
    if (seen[c]) {
      stoi_[c] = static_cast<int16_t>(itos_.size());
      itos_.push_back(static_cast<char>(c));
    }
  }
  tokens_.reserve(text.size());
  for (unsigned char c : text) tokens_.push_back(stoi_[c]);
  train_end_ = static_cast<int64_t>(static_cast<double>(tokens_.size()) * train_fraction);
  const int64_t need = seq_len_ + 2;
  if (train_end_ < need || val_size() < need) {
    throw ConfigError(str("data: '", source_, "' has ", tokens_.size(),
                          " bytes: too short for windows of model.seq_len=", seq_len_,
                          " in both splits (data.train_fraction=", train_fraction,
                          "); use a longer text or a shorter seq_len"));
  }
}

Dataset Dataset::load(const std::string& path, double train_fraction, int64_t seq_len) {
  if (path.empty()) {
    return Dataset(std::string(embedded_corpus()), train_fraction, seq_len, "<embedded corpus>");
  }
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw ConfigError(str("data: data.path '", path, "' is a directory; point it at a text file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ConfigError(str("data: cannot read data.path '", path,
                          "': check the path (leave data.path empty for the embedded corpus)"));
  }
  // Read in chunks up to the limit: a device like /dev/zero or a huge file
  // stops here instead of filling memory.
  std::string text;
  std::vector<char> chunk(1 << 20);
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    text.append(chunk.data(), static_cast<size_t>(in.gcount()));
    if (static_cast<int64_t>(text.size()) > kMaxCorpusBytes) {
      throw ConfigError(str("data: data.path '", path, "' holds more than ", kMaxCorpusBytes,
                            " bytes (the most remat-train's character corpus takes: it is held in "
                            "memory as one token per byte); give a smaller file"));
    }
  }
  return Dataset(std::move(text), train_fraction, seq_len, path);
}

std::pair<at::Tensor, at::Tensor> Dataset::windows(const std::vector<int64_t>& starts) const {
  const int64_t b = static_cast<int64_t>(starts.size());
  at::Tensor x = at::empty({b, seq_len_}, at::kLong), y = at::empty({b, seq_len_}, at::kLong);
  auto* xp = x.data_ptr<int64_t>();
  auto* yp = y.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    const int64_t* src = tokens_.data() + starts[i];
    std::copy(src, src + seq_len_, xp + i * seq_len_);
    std::copy(src + 1, src + 1 + seq_len_, yp + i * seq_len_);
  }
  return {x, y};
}

std::pair<at::Tensor, at::Tensor> Dataset::train_batch(uint64_t seed, int dp_rank,
                                                       int64_t first_window, int64_t batch) const {
  const uint64_t span = static_cast<uint64_t>(train_end_ - seq_len_ - 1);
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < batch; ++i) {
    uint64_t key = mix(seed) ^ mix((static_cast<uint64_t>(dp_rank) << 48) ^
                                   static_cast<uint64_t>(first_window + i));
    starts.push_back(static_cast<int64_t>(mix(key) % span));
  }
  return windows(starts);
}

std::pair<at::Tensor, at::Tensor> Dataset::val_batch(int64_t index, int64_t batch) const {
  const int64_t span = val_size() - seq_len_ - 1;
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < batch; ++i) {
    starts.push_back(train_end_ + static_cast<int64_t>(mix(0xe7a1ULL ^ (index * batch + i)) % span));
  }
  return windows(starts);
}

at::Tensor Dataset::encode(const std::string& text) const {
  at::Tensor ids = at::empty({static_cast<int64_t>(text.size())}, at::kLong);
  auto* p = ids.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) p[i] = std::max<int16_t>(stoi_[static_cast<unsigned char>(text[i])], 0);
  return ids;
}

std::string Dataset::decode(const at::Tensor& ids) const {
  at::Tensor flat = ids.to(at::kLong).contiguous().view(-1);
  std::string out;
  for (int64_t i = 0; i < flat.numel(); ++i) out.push_back(itos_.at(flat.data_ptr<int64_t>()[i]));
  return out;
}

}  // namespace remat::data
