// The device an engine trains on: train.device and EngineOptions::device,
// their resolution on a machine with or without CUDA (the CUDA cases through
// the resolver's CudaDevices seam), the model's placement, Engine::device()
// and Engine::to_device. On a GPU the placement itself runs in gpu_test.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "engine/auto_values.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/internal/device.h"
#include "models/gpt.h"
#include "runtime/device_memory.h"
#include "runtime/error.h"
#include "tests/error_of.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

using internal::CudaDevices;
using internal::resolve_device;
using testing::error_of;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kVocab = 13, kLayers = 2;

// This suite asserts the CPU machine's behaviour; where CUDA is visible,
// auto is the GPU (gpu_test trains there) and "cuda" is not refused.
bool cuda_here() { return internal::visible_cuda_devices().count > 0; }

Config parse(const std::string& device) {
  return parse_config(str(R"({"train": {"device": ")", device, R"("}})"), "<test>");
}

TEST(DeviceConfig, AcceptsAutoCpuCudaAndCudaN) {
  EXPECT_EQ(parse_config("{}", "<test>").train.device, "auto");
  for (const char* spec : {"auto", "cpu", "cuda", "cuda:0", "cuda:7", "cuda:12"}) {
    EXPECT_EQ(parse(spec).train.device, spec);
  }
  EXPECT_EQ(parse_config("{}", "<test>", {"train.device=cuda:1"}).train.device, "cuda:1");
}

TEST(DeviceConfig, RefusesWhatIsNotADeviceNamingTheKey) {
  for (const char* spec : {"gpu", "CPU", "cuda:", "cuda:x", "cuda:-1", "cuda0", "cpu:0", "", "cuda:1:2"}) {
    const std::string e = error_of<ConfigError>([&] { parse(spec); });
    EXPECT_THAT(e, HasSubstr(str("'train.device' = \"", spec, "\" is not a device"))) << spec;
    EXPECT_THAT(e, HasSubstr("give auto")) << spec;
  }
  // The closest device is offered where one is close.
  for (const auto& [spec, near] : std::vector<std::pair<std::string, std::string>>{
           {"CPU", "cpu"}, {"gpu", "cuda"}, {"Cuda", "cuda"}, {"GPU:1", "cuda:1"}, {"cuda0", "cuda:0"},
           {"CUDA:3", "cuda:3"}, {"Auto", "auto"}}) {
    EXPECT_THAT(error_of<ConfigError>([&] { parse(spec); }), HasSubstr(str("(did you mean \"", near, "\"?)")))
        << spec;
  }
  EXPECT_THAT(error_of<ConfigError>([] { parse("tpu"); }), Not(HasSubstr("did you mean")));
  EXPECT_THAT(device_spec_problem("Cuda", "--device"), HasSubstr("'--device' = \"Cuda\" is not a device"));
  // From an override, the override is named.
  EXPECT_THAT(error_of<ConfigError>([] { parse_config("{}", "<test>", {"train.device=tpu"}); }),
              HasSubstr("--set train.device=tpu"));
}

TEST(DeviceResolution, AutoIsTheCpuWithoutCudaAndTheLocalRanksDeviceWithIt) {
  EXPECT_EQ(resolve_device("auto", 3, {}, "train.device"), at::Device(at::kCPU));
  EXPECT_EQ(resolve_device("auto", 0, {true, 0}, "train.device"), at::Device(at::kCPU));
  EXPECT_EQ(resolve_device("cpu", 1, {true, 4}, "train.device"), at::Device(at::kCPU));
  EXPECT_EQ(resolve_device("auto", 1, {true, 4}, "train.device"), at::Device(at::kCUDA, 1));
  EXPECT_EQ(resolve_device("auto", 5, {true, 4}, "train.device"), at::Device(at::kCUDA, 1));  // local rank % devices
  EXPECT_EQ(resolve_device("cuda", 6, {true, 4}, "train.device"), at::Device(at::kCUDA, 2));
  EXPECT_EQ(resolve_device("cuda:3", 0, {true, 4}, "train.device"), at::Device(at::kCUDA, 3));
  // This machine.
  EXPECT_EQ(resolve_device("auto", 0, internal::visible_cuda_devices(), "train.device"),
            cuda_here() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
}

TEST(DeviceResolution, CudaWhereNoneIsVisibleIsRefusedSayingWhatToChange) {
  for (const char* spec : {"cuda", "cuda:0"}) {
    const std::string e = error_of<ConfigError>([&] { resolve_device(spec, 0, {}, "train.device"); });
    EXPECT_THAT(e, HasSubstr(str("'train.device' = \"", spec, "\" asks for a CUDA device")));
    EXPECT_THAT(e, HasSubstr("no CUDA device is visible"));
    EXPECT_THAT(e, HasSubstr("set train.device to auto or cpu"));
  }
  const std::string e = error_of<ConfigError>([] { resolve_device("cuda:2", 0, {true, 2}, "EngineOptions::device"); });
  EXPECT_THAT(e, HasSubstr("'EngineOptions::device' = \"cuda:2\" names CUDA device 2, but this process sees 2 "
                           "(cuda:0 to cuda:1)"));
  EXPECT_THAT(error_of<ConfigError>([] { resolve_device("gpu", 0, {}, "EngineOptions::device"); }),
              HasSubstr("'EngineOptions::device' = \"gpu\" is not a device"));
}

struct Blocks : torch::nn::Module {
  Blocks() {
    blocks = register_module("blocks", torch::nn::ModuleList(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4)));
    register_buffer("scale", at::ones({4}));
  }
  torch::nn::ModuleList blocks{nullptr};
};

TEST(DevicePlacement, AModelOnTheDeviceIsLeftAloneAndAMetaOneRefused) {
  Blocks model;
  std::map<std::string, const void*> before;
  for (const auto& item : model.named_parameters()) before[item.key()] = item.value().data_ptr();
  EXPECT_EQ(internal::place_model(model, at::Device(at::kCPU)), 0);
  for (const auto& item : model.named_parameters()) EXPECT_EQ(item.value().data_ptr(), before[item.key()]);

  // A parameter with a shape and no values: found before anything moves.
  model.blocks[1]->register_parameter("lazy", at::empty({4}, at::TensorOptions().device(at::kMeta)));
  const std::string e = error_of<ConfigError>([&] { internal::place_model(model, at::Device(at::kCPU)); });
  EXPECT_THAT(e, HasSubstr("parameter 'blocks.1.lazy' is on the meta device"));
  EXPECT_THAT(e, HasSubstr("materialise the model first"));
  for (const auto& item : model.named_parameters()) {
    if (item.key() != "blocks.1.lazy") {
      EXPECT_EQ(item.value().data_ptr(), before[item.key()]);
    }
  }
}

struct Trained {
  models::Gpt model{nullptr};
  std::unique_ptr<Engine> engine;

  explicit Trained(const std::string& config_device = "", const std::string& option_device = "") {
    std::string json = R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"params": {"lr": 0.01}})";
    if (!config_device.empty()) json = str(json, R"(, "train": {"device": ")", config_device, R"("})");
    EngineOptions options;
    options.layout = testing::layout_ptr(1);
    options.blocks = "blocks";
    options.device = option_device;
    at::manual_seed(5);
    model = models::Gpt(testing::small_gpt(kVocab, kLayers, 0.0));
    engine = initialize(model, json + "}", options);
  }
};

TEST(EngineDevice, TrainsOnTheCpuHereWithoutCopyingTheModel) {
  if (cuda_here()) GTEST_SKIP() << "CUDA is visible: auto places the model on the GPU";
  at::manual_seed(5);
  models::Gpt model(testing::small_gpt(kVocab, kLayers, 0.0));
  std::map<std::string, const void*> before;
  for (const auto& item : model->named_parameters()) before[item.key()] = item.value().data_ptr();
  EngineOptions options;
  options.layout = testing::layout_ptr(1);
  options.blocks = "blocks";
  auto engine = initialize(model, R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}})",
                           options);
  EXPECT_EQ(engine->device(), at::Device(at::kCPU));
  for (const auto& item : model->named_parameters()) {
    EXPECT_EQ(item.value().data_ptr(), before[item.key()]) << item.key() << " was copied";
  }
  // A batch already there is the same tensor, not a copy.
  at::Tensor x = at::randint(kVocab, {2, 12}, at::kLong);
  EXPECT_TRUE(engine->to_device(x).is_same(x));
  EXPECT_FALSE(engine->to_device(at::Tensor()).defined());
  const std::vector<at::Tensor> batch = engine->to_device(std::vector<at::Tensor>{x, x + 1});
  ASSERT_EQ(batch.size(), 2u);
  EXPECT_TRUE(batch[0].is_same(x));
  at::Tensor loss = engine->forward([&] { return model->loss(batch[0], batch[1].remainder(kVocab)); });
  engine->backward(loss);
  EXPECT_TRUE(engine->step());
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.device().is_cpu());
}

TEST(EngineDevice, CpuAskedForEitherWayTrainsLikeAuto) {
  if (cuda_here()) GTEST_SKIP() << "CUDA is visible: auto is the GPU";
  at::Tensor x = at::randint(kVocab, {2, 12}, at::kLong), y = at::randint(kVocab, {2, 12}, at::kLong);
  std::vector<double> losses;
  for (const auto& [config_device, option_device] :
       std::vector<std::pair<std::string, std::string>>{{"", ""}, {"cpu", ""}, {"cuda", "cpu"}}) {
    Trained t(config_device, option_device);
    EXPECT_EQ(t.engine->device(), at::Device(at::kCPU));
    for (int step = 0; step < 2; ++step) {
      t.engine->backward(t.engine->forward([&] { return t.model->loss(x, y); }));
      t.engine->step();
    }
    losses.push_back(t.engine->last_metrics().loss);
  }
  EXPECT_EQ(losses[1], losses[0]);
  EXPECT_EQ(losses[2], losses[0]);  // EngineOptions::device overrides the config's
}

// A batch on another device than the model's (on a GPU: one left on the
// host) fails in LibTorch's first kernel that sees both; the engine's error
// says where the model is and how a batch gets there, and the next forward
// goes ahead. Here the other device is the meta device.
TEST(EngineDevice, AForwardThatMixesDevicesSaysWhereTheModelIsAndHowABatchGetsThere) {
  Trained t("cpu");
  at::Tensor x = at::randint(kVocab, {2, 12}, at::kLong), y = at::randint(kVocab, {2, 12}, at::kLong);
  const at::Tensor elsewhere = at::ones({2, 12}, at::TensorOptions().device(at::kMeta));
  const std::string error = error_of<Error>([&] {
    t.engine->forward([&] {
      at::Tensor shifted = x.to(at::kFloat) + elsewhere;  // a kernel that sees both devices
      return t.model->loss(x, y) + shifted.sum();
    });
  });
  EXPECT_THAT(error, HasSubstr("remat::Engine::forward: the forward mixed devices ("));
  EXPECT_THAT(error, HasSubstr("the model is on cpu: move each batch"));
  EXPECT_THAT(error, HasSubstr("engine->to_device(t)"));
  t.engine->backward(t.engine->forward([&] { return t.model->loss(x, y); }));
  EXPECT_TRUE(t.engine->step());
  // Other errors of the forward pass through as they are.
  EXPECT_THAT(error_of<std::exception>([&] {
                t.engine->forward([&] { return t.model->loss(x, y) + at::ones({3}).view({2}).sum(); });
              }),
              ::testing::AllOf(HasSubstr("is invalid for input of size 3"),
                               ::testing::Not(HasSubstr("mixed devices"))));
}

TEST(EngineDevice, CudaIsRefusedWhereNoneIsVisibleAndTheNextInitializeGoesAhead) {
  if (cuda_here()) GTEST_SKIP() << "CUDA is visible";
  EXPECT_THAT(error_of<ConfigError>([] { Trained t("cuda"); }),
              HasSubstr("'train.device' = \"cuda\" asks for a CUDA device, but no CUDA device is visible"));
  EXPECT_THAT(error_of<ConfigError>([] { Trained t("", "cuda:0"); }),
              HasSubstr("'EngineOptions::device' = \"cuda:0\" asks for a CUDA device"));
  EXPECT_THAT(error_of<ConfigError>([] { Trained t("", "gpu"); }),
              HasSubstr("'EngineOptions::device' = \"gpu\" is not a device"));
  Trained t("cpu");  // after a refusal the next initialize goes ahead
  EXPECT_EQ(t.engine->device(), at::Device(at::kCPU));
}

// What a GPU user does (skipped without CUDA; ctest's device_test_np1 on a
// GPU machine): a model built on the CPU is placed on the local rank's device
// and trains on batches moved by to_device; its save, host tensors, loads
// into a CPU engine with the same values, and the CPU engine's save loads
// back onto the GPU, where the optimizer steps with the loaded state; the
// export holds host tensors.
std::map<std::string, at::Tensor> host_values(const torch::nn::Module& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model.named_parameters()) out[item.key()] = item.value().detach().cpu().clone();
  return out;
}

void train_steps(Trained& t, int steps) {
  for (int i = 0; i < steps; ++i) {
    at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(40 + t.engine->global_steps()));
    at::Tensor x = t.engine->to_device(at::randint(kVocab, {2, 12}, gen, at::kLong));
    at::Tensor y = t.engine->to_device(at::randint(kVocab, {2, 12}, gen, at::kLong));
    EXPECT_EQ(x.device(), t.engine->device());
    t.engine->backward(t.engine->forward([&] { return t.model->loss(x, y); }));
    t.engine->step();
  }
}

TEST(EngineDeviceGpu, PlacesTrainsAndSavesToTheCpuAndBack) {
  if (!cuda_here()) GTEST_SKIP() << "no CUDA device is visible: this case runs on a GPU machine";
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / str("remat_device_test_", ::getppid());
  fs::remove_all(dir);
  Trained gpu;  // auto: the local rank's CUDA device
  ASSERT_TRUE(gpu.engine->device().is_cuda());
  for (const auto& p : gpu.model->parameters()) EXPECT_EQ(p.device(), gpu.engine->device());
  train_steps(gpu, 2);
  gpu.engine->save_checkpoint((dir / "from_gpu").string());
  const auto trained_on_gpu = host_values(*gpu.model);

  Trained cpu("cpu");
  cpu.engine->load_checkpoint((dir / "from_gpu").string());
  for (const auto& [name, value] : host_values(*cpu.model)) {
    EXPECT_TRUE(at::equal(value, trained_on_gpu.at(name))) << name << " differs after the GPU save's load on the CPU";
  }
  train_steps(cpu, 1);  // the loaded optimizer state steps on the CPU
  cpu.engine->save_checkpoint((dir / "from_cpu").string());
  const auto trained_on_cpu = host_values(*cpu.model);

  gpu.engine->load_checkpoint((dir / "from_cpu").string());
  for (const auto& item : gpu.model->named_parameters()) {
    EXPECT_TRUE(item.value().is_cuda()) << item.key();
    EXPECT_TRUE(at::equal(item.value().detach().cpu(), trained_on_cpu.at(item.key()))) << item.key();
  }
  train_steps(gpu, 1);  // the loaded optimizer state is on the parameters' device
  EXPECT_TRUE(std::isfinite(gpu.engine->last_metrics().loss));

  const std::string exported = (dir / "model.pt").string();
  gpu.engine->export_model(exported);
  std::ifstream in(exported, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto& item : torch::pickle_load(bytes).toGenericDict()) {
    EXPECT_TRUE(item.value().toTensor().is_cpu()) << item.key().toStringRef() << " exported off the host";
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace remat

namespace remat {
namespace {

// "auto" for a model remat cannot estimate (engine/auto_values.h): bf16 and
// fp16 from the device the engine placed the model on, the batch by
// DeepSpeed's rule, and an "auto" micro-batch that nothing derives refused,
// asking for a number.
TEST(EngineDevice, AutoValuesAreDecidedFromThePlacedDevice) {
  EngineOptions options;
  options.layout = testing::layout_ptr(1);
  options.blocks = "blocks";
  at::manual_seed(5);
  models::Gpt model(testing::small_gpt(kVocab, kLayers, 0.0));
  auto engine = initialize(model, R"({"train_micro_batch_size_per_gpu": 2, "train_batch_size": "auto",
      "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}})", options);
  const Config& c = engine->config();
  EXPECT_TRUE(undecided_autos(c).empty());
  EXPECT_EQ(c.train_batch_size, 2);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  const at::Device device = engine->device();
  if (device.is_cuda()) {
    EXPECT_EQ(c.bf16.enabled, cuda_computes_bf16(device.has_index() ? device.index() : 0));
    EXPECT_NE(c.bf16.enabled, c.fp16.enabled);  // one of them on a GPU
  } else {
    EXPECT_FALSE(c.bf16.enabled);
    EXPECT_FALSE(c.fp16.enabled);
  }
  at::Tensor x = at::randint(kVocab, {2, 12}, at::kLong);
  engine->backward(engine->forward([&] { return model->loss(engine->to_device(x), engine->to_device(x)); }));
  EXPECT_TRUE(engine->step());

  models::Gpt other(testing::small_gpt(kVocab, kLayers, 0.0));
  const std::string auto_micro = R"({"train_micro_batch_size_per_gpu": "auto"})";
  EXPECT_THAT(error_of<ConfigError>([&] { initialize(other, auto_micro, options); }),
              HasSubstr("a model given to remat::initialize cannot be estimated before it runs: give "
                        "train_micro_batch_size_per_gpu a number"));
  // Derived from the other two, it needs no estimate.
  auto derived = initialize(other, R"({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 8,
      "gradient_accumulation_steps": 2})", options);
  EXPECT_EQ(derived->config().train_micro_batch_size_per_gpu, 4);
}

// Two steps of `model` under `engine` on the first `micro` rows of `rows`: the losses.
std::vector<double> two_steps(Engine& engine, models::Gpt& model, const at::Tensor& rows, int64_t micro) {
  std::vector<double> losses;
  for (int step = 0; step < 2; ++step) {
    const at::Tensor x = engine.to_device(rows.narrow(0, step, micro));
    at::Tensor loss = engine.forward([&] { return model->loss(x, x); });
    losses.push_back(loss.item<double>());
    engine.backward(loss);
    engine.step();
  }
  return losses;
}

// An "auto" micro-batch for a model given to initialize, with
// EngineOptions::micro_batch (its bound and a micro-batch's loss): the
// candidates up to the bound measured through the wiring, the knee chosen
// and said, and training after it is the training given that number, bit
// for bit (dropout on: the passes leave the RNG as they found it).
TEST(EngineDevice, AMeasuredAutoMicroBatchTrainsAsTheNumberGiven) {
  EngineOptions options;
  options.layout = testing::layout_ptr(1);
  options.blocks = "blocks";
  const at::Tensor rows = at::randint(kVocab, {10, 12}, at::kLong);
  at::manual_seed(5);
  models::Gpt model(testing::small_gpt(kVocab, kLayers, 0.1));
  // A buffer the forward moves, as a batch norm's running statistics: the
  // search puts it back.
  at::Tensor calls = model->register_buffer("calls", at::zeros({1}));
  options.micro_batch.fit = [](int64_t limit) { return MicroBatchChoice{std::min<int64_t>(limit, 8), "the test's bound"}; };
  options.micro_batch.loss = [&](int64_t micro) {
    const at::Tensor x = rows.narrow(0, 0, micro).to(training_device(Config{}));
    calls.add_(1);
    return model->loss(x, x);
  };
  options.micro_batch.tokens_per_sample = 12;
  int64_t micro = 0;
  std::vector<double> measured;
  {
    auto engine = initialize(model, R"({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"})",
                             options);
    const MicroBatchSearch* search = engine->micro_batch_search();
    ASSERT_NE(search, nullptr);
    EXPECT_EQ(search->candidates, (std::vector<int64_t>{1, 2, 4, 8}));
    micro = *engine->config().train_micro_batch_size_per_gpu;
    EXPECT_EQ(micro, search->chosen_micro());
    EXPECT_EQ(engine->config().train_batch_size, micro);
    EXPECT_THAT(auto_lines(engine->config()).back(),
                HasSubstr(str("train_micro_batch_size_per_gpu \"auto\" -> ", micro, ": the throughput knee")));
    EXPECT_THAT(auto_lines(engine->config()).back(), HasSubstr("; 8: the test's bound"));
    EXPECT_EQ(model->named_buffers()["calls"].item<float>(), 0.0F) << "the search's passes moved a buffer";
    measured = two_steps(*engine, model, rows, micro);
  }
  at::manual_seed(5);
  models::Gpt given(testing::small_gpt(kVocab, kLayers, 0.1));
  EngineOptions plain = options;
  plain.micro_batch = {};
  auto engine = initialize(given, str(R"({"train_micro_batch_size_per_gpu": )", micro, "}"), plain);
  EXPECT_EQ(engine->micro_batch_search(), nullptr);
  EXPECT_EQ(two_steps(*engine, given, rows, micro), measured) << "micro-batch " << micro;

  // A loss without a bound is refused: the candidates need one.
  models::Gpt unbounded(testing::small_gpt(kVocab, kLayers, 0.0));
  options.micro_batch.fit = nullptr;
  EXPECT_THAT(error_of<ConfigError>([&] { initialize(unbounded, R"({"train_micro_batch_size_per_gpu": "auto"})",
                                                     options); }),
              HasSubstr("EngineOptions::micro_batch.loss is set but micro_batch.fit is not"));
}

}  // namespace
}  // namespace remat
