// Engine::load_pretrained: a safetensors file written here from the published
// format (not by remat's writer) loads into a model of the test's own at
// every ZeRO stage, with bf16, offloaded optimizer, frozen parameters and
// tensor parallelism: the parameters equal the file's values bitwise
// (converted where the dtypes differ), the engine trains on exactly as one
// whose model held those values at initialize, and each rank reads only its
// share. Every mismatch is one error, the same on every rank, with nothing
// written; the name options; a load after a step is refused.
#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/safetensors.h"
#include "nn/module_call.h"
#include "parallel/layers.h"
#include "parallel/tensor_split.h"
#include "parallel/zero.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "tests/error_of.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::error_of;
using testing::world;
using Tensors = std::vector<std::pair<std::string, at::Tensor>>;

constexpr int64_t kVocab = 13, kWidth = 8, kHidden = 16, kSeq = 5;

// A block of a column-parallel and a row-parallel linear (split across the
// tensor-parallel group, plain at size 1), called through remat::forward.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const parallel::Group& group) {
    namespace tp = parallel;
    col = register_module("col", tp::ColumnParallelLinear(tp::ParallelLinearOptions(kWidth, kHidden), group));
    row = register_module(
        "row", tp::RowParallelLinear(tp::ParallelLinearOptions(kHidden, kWidth).input_is_parallel(true), group));
  }
  at::Tensor forward(const at::Tensor& x) { return x + row(at::tanh(col(x))); }
  parallel::ColumnParallelLinear col{nullptr};
  parallel::RowParallelLinear row{nullptr};
};
TORCH_MODULE(Block);

// An embedding, two blocks, a buffer the forward uses, a norm and a head.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(const parallel::Group& group) {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kWidth));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(Block(group));
    scale = register_buffer("scale", at::ones({kWidth}));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    head = register_module("head", torch::nn::Linear(kWidth, kVocab));
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) {
    at::Tensor h = embed(x);
    for (size_t i = 0; i < blocks->size(); ++i) h = remat::forward(blocks->ptr<BlockImpl>(i), h);
    at::Tensor logits = head(norm(h * scale.to(h.scalar_type())));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}).to(at::kFloat), y.reshape({-1}));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  at::Tensor scale;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kBool: return "BOOL";
    default: throw Error("dtype_name: not used here");
  }
}

// The published layout: an 8-byte little-endian header length, the JSON
// header (keys sorted, so the data follows the same order), the bytes.
void write_safetensors(const std::string& path, Tensors tensors) {
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  nlohmann::json header = {{"__metadata__", {{"format", "pt"}}}};
  std::string data;
  for (const auto& [name, t] : tensors) {
    const at::Tensor c = t.contiguous();
    const int64_t begin = static_cast<int64_t>(data.size()), n = c.numel() * static_cast<int64_t>(c.element_size());
    data.append(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(n));
    header[name] = {{"dtype", dtype_name(c.scalar_type())}, {"shape", c.sizes().vec()}, {"data_offsets", {begin, begin + n}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t length = text.size();
  unsigned char bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(length >> (8 * i));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes), 8);
  out << text << data;
  ASSERT_TRUE(out.good()) << path;
}

// A folder every rank sees, made by rank 0.
std::string shared_dir(const std::string& name) {
  const std::string dir = (fs::temp_directory_path() / ("remat_pretrained_test_" + name)).string();
  if (world()->rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  world()->barrier();
  return dir;
}

// The whole values a file holds for Net (by the model's names), drawn from
// their own generator: each parameter's whole shape, `dtypes` per name (float32
// otherwise); and the buffer.
Tensors pretrained_values(const std::map<std::string, at::ScalarType>& dtypes = {}) {
  Net shapes(parallel::Group{});
  at::Generator gen = at::detail::createCPUGenerator(77);
  Tensors out;
  for (const auto& [name, split] : parallel::parameter_splits(*shapes)) {
    const auto it = dtypes.find(name);
    out.emplace_back(name, at::randn(split.full_sizes, gen).mul(0.3).to(it == dtypes.end() ? at::kFloat : it->second));
  }
  out.emplace_back("scale", at::rand({kWidth}, gen).add(0.5));
  return out;
}

struct Sharding {
  int stage = 0, tp = 1;
  bool bf16 = false, offload = false, frozen = false, offload_param = false;
  std::string label() const {
    return str("stage ", stage, ", tp ", tp, bf16 ? ", bf16" : "", offload ? ", offload_optimizer" : "",
               frozen ? ", frozen embedding" : "", offload_param ? ", offload_param" : "");
  }
};

Config config_of(const Sharding& s) {
  Config c;
  c.train_micro_batch_size_per_gpu = 2;
  c.train.seed = 3;
  c.optimizer.type = "AdamW";
  c.optimizer.lr = 1e-2;
  c.bf16.enabled = s.bf16;
  c.tensor_parallel.size = s.tp;
  c.zero_optimization.stage = s.stage;
  c.zero_optimization.reduce_bucket_size = 100;  // several buckets
  c.zero_optimization.stage3_param_persistence_threshold = 0;
  c.zero_optimization.offload_optimizer.device = s.offload ? parallel::OffloadDevice::kCpu : parallel::OffloadDevice::kNone;
  c.zero_optimization.offload_param.device = s.offload_param ? parallel::OffloadDevice::kCpu : parallel::OffloadDevice::kNone;
  return c;
}

struct Built {
  Net model{nullptr};
  std::unique_ptr<Engine> engine;
};

// Net under `s`'s engine; `install`: these whole values put into the model
// before initialize (the reference a load must match).
Built make(const Sharding& s, const Tensors* install = nullptr) {
  const auto& layout = testing::layout_ptr(s.tp);
  at::manual_seed(1);
  Built r;
  r.model = Net(layout->tp_group());
  if (install) {
    at::NoGradGuard no_grad;
    std::map<std::string, parallel::TensorSplit> splits;
    for (auto& [name, split] : parallel::parameter_splits(*r.model)) splits.emplace(name, split);
    auto params = r.model->named_parameters();
    for (const auto& [name, value] : *install) {
      if (name == "scale") {
        r.model->scale.copy_(value);
      } else {
        params[name].copy_(parallel::share_of(value.to(at::kFloat), splits.at(name), s.tp, layout->tp_rank()));
      }
    }
  }
  if (s.frozen) r.model->embed->weight.requires_grad_(false);
  EngineOptions options;
  options.layout = layout;
  r.engine = initialize(r.model, config_of(s), options);
  return r;
}

std::pair<at::Tensor, at::Tensor> batch(int64_t step) {
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100 * step + world()->rank()));
  return {at::randint(kVocab, {2, kSeq}, gen, at::kLong), at::randint(kVocab, {2, kSeq}, gen, at::kLong)};
}

// The evaluated loss, then the losses of three training steps.
std::vector<double> losses(Built& r) {
  std::vector<double> out;
  auto [x, y] = batch(0);
  out.push_back(r.engine->evaluate([&] { return r.model->loss(x, y); }).item<double>());
  for (int64_t step = 1; step <= 3; ++step) {
    std::tie(x, y) = batch(step);
    at::Tensor loss = r.engine->forward([&] { return r.model->loss(x, y); });
    r.engine->backward(loss);
    r.engine->step();
    out.push_back(r.engine->last_metrics().loss);
  }
  return out;
}

std::map<std::string, at::Tensor> masters(Engine& engine) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, value] : engine.sharding().full_parameters()) out[name] = value;
  return out;
}

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && at::equal(a, b);
}

// Every stage, bf16, offload, frozen parameters and tensor parallelism, from a
// file holding bf16, fp16 and float32 tensors.
TEST(LoadPretrained, EveryShardingHoldsTheFilesValuesAndTrainsAsIfInitialisedWithThem) {
  const std::string dir = shared_dir("every");
  const Tensors values = pretrained_values({{"embed.weight", at::kBFloat16}, {"blocks.0.col.weight", at::kHalf}});
  const std::string path = dir + "/model.safetensors";
  if (world()->rank() == 0) write_safetensors(path, values);
  world()->barrier();
  std::vector<Sharding> setups = {{0}, {1}, {2}, {3}, {3, 1, true}, {2, 1, true, true}, {3, 1, false, true},
                               {0, 1, false, false, true}, {1, 1, false, false, true},
                               {3, 1, true, false, true}, {1, 1, true, true}, {3, 1, false, false, false, true},
                               {3, 1, true, true, true, true}};
  if (world()->size() == 2) setups.insert(setups.end(), {{0, 2}, {3, 2}, {1, 2, true}});
  for (const Sharding& s : setups) {
    SCOPED_TRACE(s.label());
    Built loaded = make(s);
    const PretrainedReport report = loaded.engine->load_pretrained(path);
    EXPECT_EQ(report.loaded, static_cast<int64_t>(values.size()));
    EXPECT_EQ(report.kept, 0);
    EXPECT_EQ(report.file_bytes, static_cast<int64_t>(fs::file_size(path)));
    // The optimizer's tensors hold the file's values, converted to float32, bitwise.
    const auto& layout = testing::layout(s.tp);
    std::map<std::string, parallel::TensorSplit> splits;
    for (auto& [name, split] : parallel::parameter_splits(*loaded.model)) splits.emplace(name, split);
    const auto held = masters(*loaded.engine);
    for (const auto& [name, value] : values) {
      if (name == "scale") {
        EXPECT_TRUE(bitwise_equal(loaded.model->scale, value.to(loaded.model->scale.scalar_type()))) << name;
        continue;
      }
      const at::Tensor want = parallel::share_of(value.to(at::kFloat), splits.at(name), s.tp, layout.tp_rank());
      EXPECT_TRUE(bitwise_equal(held.at(name), want.contiguous())) << name;
    }
    // The model computes with them (16-bit copies, offloaded masters, stage
    // 3's shards): the same losses, evaluated and trained, as a model that
    // held them at initialize.
    Built reference = make(s, &values);
    EXPECT_EQ(losses(loaded), losses(reference));
    for (const auto& [name, value] : masters(*reference.engine)) {
      EXPECT_TRUE(bitwise_equal(masters(*loaded.engine).at(name), value)) << name << " after training";
    }
  }
}

// At stage 3 on two ranks, and at tensor-parallel size 2, each rank reads its
// half of the file's tensor data, and the ranks together read it once.
TEST(LoadPretrained, EachRankReadsOnlyWhatItHolds) {
  if (world()->size() != 2) GTEST_SKIP() << "two ranks";
  const std::string dir = shared_dir("share");
  const Tensors values = pretrained_values();
  const std::string path = dir + "/model.safetensors";
  if (world()->rank() == 0) write_safetensors(path, values);
  world()->barrier();
  int64_t data = 0, buffer = 0;
  for (const auto& [name, value] : values) (name == "scale" ? buffer : data) += value.numel() * 4;
  {
    Built r = make({3});
    const int64_t mine = r.engine->load_pretrained(path).bytes_read - buffer;  // the buffer: whole, every rank
    at::Tensor all = at::empty({2}, at::kLong);
    world()->allGather(all, at::tensor({mine}, at::kLong))->wait();
    EXPECT_EQ(all.sum().item<int64_t>(), data) << "stage 3: every element once";
    EXPECT_LE(mine, data / 2 + 4 * kWidth) << "stage 3: this rank's shard (padding aside)";
  }
  {
    Built r = make({0, 2});
    const int64_t mine = r.engine->load_pretrained(path).bytes_read - buffer;
    int64_t replicated = 0;  // norm, head, embedding and the row-parallel biases: whole on both ranks
    for (const auto& [name, split] : parallel::parameter_splits(*r.model)) {
      if (split.kind == parallel::SplitKind::kReplicated) replicated += 4 * c10::multiply_integers(split.full_sizes);
    }
    EXPECT_EQ(mine, replicated + (data - replicated) / 2) << "tp 2: this rank's share of each split parameter";
  }
}

// Missing, unexpected, mapped twice, another shape and an integer dtype, all
// in one ConfigError, the same on every rank; nothing is written.
TEST(LoadPretrained, EveryMismatchInOneErrorAndNothingWritten) {
  const std::string dir = shared_dir("mismatch");
  Tensors values = pretrained_values();
  Tensors bad;
  for (const auto& [name, value] : values) {
    if (name == "norm.bias" || name == "blocks.1.row.bias") continue;  // missing
    if (name == "head.bias") {
      bad.emplace_back(name, at::zeros({kVocab + 1}));  // another shape
    } else if (name == "norm.weight") {
      bad.emplace_back(name, at::ones({kWidth}, at::kLong));  // integer
    } else {
      bad.emplace_back(name, value);
    }
  }
  bad.emplace_back("extra.weight", at::zeros({2}));                // unexpected
  bad.emplace_back("old.embed", values.front().second);            // renamed onto embed.weight, twice
  const std::string path = dir + "/bad.safetensors";
  if (world()->rank() == 0) write_safetensors(path, bad);
  world()->barrier();
  Built r = make({3});
  const auto before = masters(*r.engine);
  PretrainedOptions options;
  options.rename = {{"old\\.embed", "embed.weight"}};
  const std::string message = error_of<ConfigError>([&] { r.engine->load_pretrained(path, options); });
  EXPECT_THAT(message, HasSubstr("2 model parameters the file lacks: 'blocks.1.row.bias', 'norm.bias'"));
  EXPECT_THAT(message, HasSubstr("1 file tensors the model has no parameter or buffer for: 'extra.weight'"));
  EXPECT_THAT(message, HasSubstr("'embed.weight' (from 'embed.weight' and 'old.embed')"));
  EXPECT_THAT(message, HasSubstr("'head.bias' is [14] in the file, the model's [13]"));
  EXPECT_THAT(message, HasSubstr("'norm.weight' is I64 in the file, the model's Float"));
  EXPECT_THAT(message, HasSubstr("nothing was loaded"));
  // The same text on every rank.
  at::Tensor length = at::tensor({static_cast<int64_t>(std::hash<std::string>{}(message) >> 1)}, at::kLong);
  at::Tensor all = at::empty({world()->size()}, at::kLong);
  world()->allGather(all, length)->wait();
  EXPECT_TRUE(at::equal(all, all[0].expand({world()->size()})));
  for (const auto& [name, value] : masters(*r.engine)) EXPECT_TRUE(bitwise_equal(value, before.at(name))) << name;
  EXPECT_TRUE(at::equal(r.model->scale, at::ones({kWidth})));
  // Counted beyond the first few of a kind.
  Tensors many = values;
  for (int i = 0; i < 11; ++i) many.emplace_back(str("stray.", i), at::zeros({1}));
  if (world()->rank() == 0) write_safetensors(dir + "/many.safetensors", many);
  world()->barrier();
  EXPECT_THAT(error_of<ConfigError>([&] { r.engine->load_pretrained(dir + "/many.safetensors"); }),
              HasSubstr("11 file tensors the model has no parameter or buffer for: 'stray.0', 'stray.1'"));
  EXPECT_THAT(error_of<ConfigError>([&] { r.engine->load_pretrained(dir + "/absent.safetensors"); }),
              HasSubstr("absent.safetensors"));
  // Not safetensors at all: a zip archive (a pickle export) and a device are said as such.
  if (world()->rank() == 0) {
    std::ofstream zip(dir + "/model.pt", std::ios::binary);
    zip << std::string("PK\x03\x04", 4) << std::string(60, '\0');
  }
  world()->barrier();
  EXPECT_THAT(error_of<ConfigError>([&] { r.engine->load_pretrained(dir + "/model.pt"); }),
              HasSubstr("is a zip archive (a PyTorch pickle"));
  const std::string device = error_of<ConfigError>([&] { r.engine->load_pretrained("/dev/null"); });
  EXPECT_THAT(device, HasSubstr("'/dev/null' is not a file nor a folder"));
  EXPECT_THAT(device, ::testing::Not(HasSubstr("SafetensorsSet")));
  // A load that fits still works after the refused ones.
  EXPECT_EQ(r.engine->load_pretrained(dir + "/many.safetensors", {{}, "", "stray\\..*"}).ignored, 11);
}

// rename (first full match wins; other names stay), allow_missing (kept as
// initialised) and ignore (left unread), and a pattern that is not one.
TEST(LoadPretrained, RenameAllowMissingAndIgnore) {
  const std::string dir = shared_dir("names");
  const Tensors values = pretrained_values();
  Tensors file;
  for (const auto& [name, value] : values) {
    if (name == "head.weight" || name == "head.bias") continue;  // kept as initialised
    const bool block = name.rfind("blocks.", 0) == 0;
    file.emplace_back(block ? "model.layers." + name.substr(7) : name, value);
  }
  file.emplace_back("model.layers.0.rotary.inv_freq", at::ones({4}));
  const std::string path = dir + "/named.safetensors";
  if (world()->rank() == 0) write_safetensors(path, file);
  world()->barrier();
  Built r = make({1});
  const auto before = masters(*r.engine);
  PretrainedOptions options;
  options.rename = {{"model\\.layers\\.(\\d+)\\.(.*)", "blocks.$1.$2"}, {"model\\.layers\\.(.*)", "never.$1"}};
  options.allow_missing = "head\\..*";
  options.ignore = ".*\\.inv_freq";
  const PretrainedReport report = r.engine->load_pretrained(path, options);
  EXPECT_EQ(report.kept, 2);
  EXPECT_EQ(report.ignored, 1);
  const auto held = masters(*r.engine);
  for (const auto& [name, value] : values) {
    if (name == "scale") continue;
    const at::Tensor& want = name.rfind("head.", 0) == 0 ? before.at(name) : value;
    EXPECT_TRUE(bitwise_equal(held.at(name), want)) << name;
  }
  // allow_missing matches whole names: "head" alone does not allow head.weight.
  options.allow_missing = "head";
  EXPECT_THAT(error_of<ConfigError>([&] { r.engine->load_pretrained(path, options); }),
              HasSubstr("2 model parameters the file lacks: 'head.weight', 'head.bias'"));
  options.allow_missing = "head\\.(";
  EXPECT_THAT(error_of<ConfigError>([&] { r.engine->load_pretrained(path, options); }),
              HasSubstr("PretrainedOptions::allow_missing 'head\\.(' is not a regular expression"));
}

// A sharded set written by remat's SafetensorsWriter (several files and an
// index) loads from its folder and from its index, the same values.
TEST(LoadPretrained, LoadsAShardedSetByItsFolderOrIndex) {
  const std::string dir = shared_dir("sharded");
  const Tensors values = pretrained_values({{"head.weight", at::kBFloat16}});
  if (world()->rank() == 0) {
    std::vector<SafetensorsPlanned> plan;
    for (const auto& [name, value] : values) plan.push_back({name, value.scalar_type(), value.sizes().vec()});
    SafetensorsWriter out(dir + "/set", plan, {/*max_shard_bytes=*/600});
    for (auto it = values.rbegin(); it != values.rend(); ++it) out.write(it->first, it->second);
    out.finish();
    ASSERT_GT(out.paths().size(), 3u) << "several shards and the index";
  }
  world()->barrier();
  for (const std::string& path : {dir + "/set", dir + "/set/model.safetensors.index.json"}) {
    Built r = make({3});
    EXPECT_EQ(r.engine->load_pretrained(path).loaded, static_cast<int64_t>(values.size())) << path;
    const auto held = masters(*r.engine);
    for (const auto& [name, value] : values) {
      if (name != "scale") {
        EXPECT_TRUE(bitwise_equal(held.at(name), value.to(at::kFloat))) << path << ": " << name;
      }
    }
  }
}

// After an optimizer step the optimizer's state belongs to the weights it
// stepped: a load is refused, the weights untouched.
TEST(LoadPretrained, RefusedAfterTheFirstStep) {
  const std::string dir = shared_dir("late");
  const std::string path = dir + "/model.safetensors";
  if (world()->rank() == 0) write_safetensors(path, pretrained_values());
  world()->barrier();
  Built r = make({2});
  auto [x, y] = batch(1);
  r.engine->backward(r.engine->forward([&] { return r.model->loss(x, y); }));
  EXPECT_THAT(error_of<Error>([&] { r.engine->load_pretrained(path); }), HasSubstr("inside a step"));
  r.engine->step();
  const auto before = masters(*r.engine);
  EXPECT_THAT(error_of<Error>([&] { r.engine->load_pretrained(path); }),
              HasSubstr("the engine has taken 1 optimizer steps"));
  for (const auto& [name, value] : masters(*r.engine)) EXPECT_TRUE(bitwise_equal(value, before.at(name))) << name;
}

}  // namespace
}  // namespace remat
