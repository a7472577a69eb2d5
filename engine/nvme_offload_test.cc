// zero_optimization.offload_optimizer.device "nvme" through the engine (issue
// 53, item 1), and offload_param.device "nvme" (item 2: stage 3's shards
// mapped from a file per rank; at the end of this file), under mpirun at 1
// and 2 ranks: the Adam moments in a file per
// rank under nvme_path, stepped in sub-groups through host buffers. Losses
// and final weights bitwise those of device "cpu" at stages 1-3 and hybrid,
// float32 and bf16, accumulation, clipping, AdamW and Adam; saves read the
// state from the files and resume across nvme, cpu and none, at another
// data-parallel size too; the folder's faults (missing, not a folder,
// unwritable, in use by another job) are ConfigErrors naming it, a crashed
// run's leftovers are removed, and the state file goes with the engine.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "engine/config.h"
#include "engine/engine.h"
#include "models/gpt.h"
#include "optim/optimizer.h"
#include "parallel/nvme_optimizer.h"
#include "parallel/zero.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "tests/error_of.h"
#include "tests/offload_runs.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using remat::testing::expect_same;
using remat::testing::job_dir;
using remat::testing::TrainedRun;
using remat::testing::world;

struct NvmeSetup {
  int stage = 2;
  parallel::OffloadDevice device = parallel::OffloadDevice::kNvme;
  std::string nvme_path;
  bool bf16 = false;
  std::string optimizer = "AdamW";
  int steps = 4;
  int micro_steps = 1;
  int hybrid = 0;
  int ranks = 0;  // the first `ranks` ranks train (0: all)
  int tp = 1;     // tensor parallel size
  std::vector<std::string> frozen;  // parameters made requires_grad false before initialize
  // offload_param (stage 3): the shards' device, and with "nvme" its folder
  // and the elements kept in memory.
  parallel::OffloadDevice param_device = parallel::OffloadDevice::kNone;
  std::string param_path;
  int64_t max_in_cpu = 0;
};

Config config_of(const NvmeSetup& s) {
  Config c;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = s.micro_steps;
  c.gradient_clipping = 1.0;
  c.train.seed = 9;
  c.optimizer.type = s.optimizer;
  c.optimizer.lr = 1e-2;
  c.optimizer.weight_decay = 0.01;
  c.bf16.enabled = s.bf16;
  c.tensor_parallel.size = s.tp;
  c.zero_optimization.stage = s.stage;
  c.zero_optimization.reduce_bucket_size = 900;  // several buckets
  c.zero_optimization.stage3_param_persistence_threshold = 40;
  c.zero_optimization.hybrid_shard_size = s.hybrid;
  c.zero_optimization.offload_optimizer.device = s.device;
  c.zero_optimization.offload_param.device = s.param_device;
  if (!s.param_path.empty()) c.zero_optimization.offload_param.nvme_path = s.param_path;
  c.zero_optimization.offload_param.max_in_cpu = s.max_in_cpu;
  c.zero_optimization.offload_optimizer.nvme_path = s.nvme_path;
  c.zero_optimization.offload_optimizer.buffer_count = 3;
  c.deepspeed_tuning.sub_group_size = 1000;  // many sub-groups, each across parameters' ends
  return c;
}

TrainedRun train(const NvmeSetup& s, const std::string& from = "", const std::string& save_to = "", int save_at = -1) {
  const int n = s.ranks > 0 ? s.ranks : world()->size();
  auto group = world()->split(world()->rank() < n ? 0 : -1, world()->rank());
  if (world()->rank() >= n) return {};
  auto layout = std::make_shared<ParallelLayout>(group, ParallelDims::from_world(group->size(), s.tp));
  models::GptOptions o = remat::testing::small_gpt(29, 3, /*dropout=*/0.1);
  if (s.tp > 1) o.tensor_parallel = layout->tp_group();
  at::manual_seed(9);
  models::Gpt model(o);
  for (const auto& name : s.frozen) model->named_parameters()[name].requires_grad_(false);
  EngineOptions options;
  options.layout = layout;
  auto engine = initialize(model, config_of(s), options);
  if (!from.empty()) engine->load_checkpoint(from);
  const bool nvme = s.device == parallel::OffloadDevice::kNvme && s.stage > 0;
  EXPECT_EQ(parallel::nvme_optimizer_stats(engine->optimizer()).has_value(), nvme);
  if (nvme) {
    EXPECT_TRUE(optim::optimizer_state_tensors(engine->optimizer()).empty()) << "no state in memory";
  }
  return remat::testing::train_to(*engine, model, *layout, o.vocab_size, s.steps, s.micro_steps, {save_to, save_at});
}

std::string nvme_dir(const std::string& name) { return job_dir("remat_nvme_", name); }

// train(s)'s ConfigError while rank 0's `folder` is locked as another job's
// would be: held here by this process, and flock locks per open file
// description, so the engine's own open is refused as another process's.
std::string error_while_locked(const fs::path& folder, const NvmeSetup& s) {
  int fd = -1;
  if (world()->rank() == 0) {
    fs::create_directories(folder);
    fd = ::open((folder / "lock").c_str(), O_RDWR | O_CREAT, 0644);
    EXPECT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0) << folder;
  }
  world()->barrier()->wait();
  const std::string e = testing::error_of<ConfigError>([&] { train(s); });
  if (fd >= 0) ::close(fd);
  return e;
}

// Saved at step 2 of 4 with `device` (the optimizer's or the shards') set as
// each pair's first, resumed with its second: the last two steps and the
// final weights equal `whole` trained without a stop. At 2 ranks a save made
// with it on disk, resumed at 1 rank, equals the one-rank resume of the same
// save made with "cpu". Saves go to job folders prefixed `prefix`.
using DevicePairs = std::vector<std::pair<parallel::OffloadDevice, parallel::OffloadDevice>>;
void expect_saves_resume(const NvmeSetup& whole, parallel::OffloadDevice NvmeSetup::*device, const DevicePairs& pairs,
                         const std::string& prefix) {
  using D = parallel::OffloadDevice;
  const TrainedRun reference = train(whole);
  for (const auto& [saved, resumed] : pairs) {
    const std::string what = str(parallel::offload_device_names()[static_cast<int>(saved)], " -> ",
                                 parallel::offload_device_names()[static_cast<int>(resumed)]);
    const std::string dir = job_dir(prefix, "s");
    NvmeSetup first = whole;
    first.*device = saved;
    first.steps = 2;
    train(first, "", dir, 2);
    NvmeSetup second = whole;
    second.*device = resumed;
    const TrainedRun rest = train(second, dir);
    ASSERT_EQ(rest.losses.size(), 2u) << what;
    for (size_t i = 0; i < 2; ++i) EXPECT_EQ(rest.losses[i], reference.losses[i + 2]) << what << ", step " << i + 3;
    for (const auto& [name, value] : reference.final_params) {
      EXPECT_TRUE(at::equal(value, rest.final_params.at(name))) << what << ": " << name;
    }
  }
  if (world()->size() == 1) return;
  const std::string nvme_save = job_dir(prefix, "dp_nvme"), cpu_save = job_dir(prefix, "dp_cpu");
  NvmeSetup first = whole;
  first.steps = 2;
  first.*device = D::kNvme;
  train(first, "", nvme_save, 2);
  first.*device = D::kCpu;
  train(first, "", cpu_save, 2);
  NvmeSetup one = whole;
  one.ranks = 1;
  one.*device = D::kNvme;
  const TrainedRun from_nvme = train(one, nvme_save);
  one.*device = D::kCpu;
  const TrainedRun from_cpu = train(one, cpu_save);
  if (world()->rank() == 0) expect_same(from_cpu, from_nvme, "2 ranks -> 1");
}

TEST(NvmeOptimizer, EveryStageTrainsBitwiseAsCpu) {
  const std::string path = nvme_dir("stages");
  for (int stage : {1, 2, 3}) {
    for (bool bf16 : {false, true}) {
      for (int micro : {1, 2}) {
        NvmeSetup s;
        s.stage = stage;
        s.bf16 = bf16;
        s.micro_steps = micro;
        s.nvme_path = path;
        s.device = parallel::OffloadDevice::kCpu;
        const TrainedRun cpu = train(s);
        s.device = parallel::OffloadDevice::kNvme;
        const TrainedRun nvme = train(s);
        expect_same(cpu, nvme, str("stage ", stage, bf16 ? " bf16" : " float32", ", micro-steps ", micro));
        EXPECT_LT(nvme.losses.back(), nvme.losses.front()) << "trains";
      }
    }
  }
  if (world()->size() > 1) {
    for (int stage : {1, 3}) {
      NvmeSetup s;
      s.stage = stage;
      s.hybrid = 1;
      s.nvme_path = path;
      s.device = parallel::OffloadDevice::kCpu;
      const TrainedRun cpu = train(s);
      s.device = parallel::OffloadDevice::kNvme;
      expect_same(cpu, train(s), str("stage ", stage, " hybrid"));
    }
  }
}

TEST(NvmeOptimizer, AdamTrainsBitwiseAsCpuAndSgdIsRefused) {
  const std::string path = nvme_dir("adam");
  NvmeSetup s;
  s.optimizer = "Adam";
  s.nvme_path = path;
  s.device = parallel::OffloadDevice::kCpu;
  const TrainedRun cpu = train(s);
  s.device = parallel::OffloadDevice::kNvme;
  expect_same(cpu, train(s), "Adam");
  s.optimizer = "SGD";
  const std::string e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("optimizer.type is \"SGD\": use AdamW or Adam with it, or offload_optimizer.device \"cpu\""),
            std::string::npos) << e;
}

// Frozen parameters are handed through and never stepped (no state on disk
// for them), the others bitwise as with "cpu"; the frozen ones unchanged.
TEST(NvmeOptimizer, FrozenParametersAreNotSteppedAndTheRestAsCpu) {
  const std::string path = nvme_dir("frozen");
  for (int stage : {1, 3}) {
    for (bool bf16 : {false, true}) {
      NvmeSetup s;
      s.stage = stage;
      s.bf16 = bf16;
      s.nvme_path = path;
      s.frozen = {"pos_emb.weight", "blocks.1.ln1.weight"};
      s.device = parallel::OffloadDevice::kCpu;
      const TrainedRun cpu = train(s);
      s.device = parallel::OffloadDevice::kNvme;
      const TrainedRun nvme = train(s);
      const std::string what = str("stage ", stage, bf16 ? " bf16" : " float32", ", frozen");
      expect_same(cpu, nvme, what);
      at::manual_seed(9);
      models::Gpt fresh(remat::testing::small_gpt(29, 3, /*dropout=*/0.1));
      for (const auto& name : s.frozen) {
        EXPECT_TRUE(at::equal(nvme.final_params.at(name).to(at::kFloat), fresh->named_parameters()[name].detach()))
            << what << ": " << name << " was stepped";
      }
    }
  }
}

// The metrics count no optimizer state in memory and the state file's bytes
// on disk, each step reading and writing all of it once; the host holds less
// than with "cpu" (the moments, less the buffers); the file goes with the engine.
TEST(NvmeOptimizer, StateIsOnDiskNotInMemoryAndRemovedAtTheEnd) {
  const std::string path = nvme_dir("files");
  NvmeSetup s;
  s.nvme_path = path;
  s.steps = 2;
  const TrainedRun run = train(s);
  s.device = parallel::OffloadDevice::kCpu;
  const TrainedRun cpu = train(s);
  const nlohmann::json& m = run.metrics.back();
  EXPECT_EQ(m.at("optimizer_state_bytes").get<int64_t>(), 0);
  const int64_t on_disk = m.at("nvme_state_bytes").get<int64_t>();
  const int64_t moments = cpu.metrics.back().at("optimizer_state_bytes").get<int64_t>();
  EXPECT_GE(on_disk, moments - 8 * 64) << "the moments (less LibTorch's step counts) on disk, padded";
  EXPECT_EQ(m.at("nvme_read_bytes").get<int64_t>(), on_disk);
  EXPECT_EQ(m.at("nvme_written_bytes").get<int64_t>(), on_disk);
  EXPECT_GT(m.at("nvme_step_ms").get<double>(), 0);
  EXPECT_LT(m.at("host_optimizer_bytes").get<int64_t>(), cpu.metrics.back().at("host_optimizer_bytes").get<int64_t>());
  EXPECT_EQ(cpu.metrics.back().count("nvme_state_bytes"), 0u) << "a run without nvme keeps its keys";
  const fs::path mine = fs::path(path) / "remat-optimizer" / str("rank", world()->rank());
  EXPECT_TRUE(fs::exists(mine / "lock"));
  EXPECT_FALSE(fs::exists(mine / str("rank", world()->rank(), ".optimizer"))) << "the state file is removed";
  // The float32 masters in their own file, out of host memory: the host keeps
  // their gradients (4 bytes an element), "cpu" masters and gradients (8).
  EXPECT_GE(m.at("nvme_master_bytes").get<int64_t>(), 4 * run.metrics.back().at("nvme_state_bytes").get<int64_t>() / 8 - 4096);
  // Each step's Adam read and rewrote every master in the file once: half
  // the moments' bytes (4 an element against 8), the file's padding aside.
  for (const nlohmann::json& step : run.metrics) {
    const int64_t read = step.at("nvme_master_read_bytes").get<int64_t>();
    EXPECT_EQ(step.at("nvme_master_written_bytes").get<int64_t>(), read);
    EXPECT_LE(2 * read, moments);
    EXPECT_GE(2 * read, moments - 8 * 64);
    EXPECT_LE(read, step.at("nvme_master_bytes").get<int64_t>());
  }
  EXPECT_EQ(cpu.metrics.back().count("nvme_master_read_bytes"), 0u);
  const fs::path masters = fs::path(path) / "remat-masters" / str("rank", world()->rank());
  EXPECT_TRUE(fs::exists(masters / "lock"));
  EXPECT_FALSE(fs::exists(masters / str("rank", world()->rank(), ".masters"))) << "the masters' file is removed";
}

// A save reads the moments from the files; a resume writes them back: the
// run resumed at step 2 of 4 equals the one that never stopped, whichever of
// nvme, cpu and none saved and resumed, and at 1 rank of 2.
TEST(NvmeOptimizer, SavesResumeAcrossNvmeCpuAndNone) {
  using D = parallel::OffloadDevice;
  NvmeSetup whole;
  whole.nvme_path = nvme_dir("saves");
  whole.device = D::kCpu;
  expect_saves_resume(whole, &NvmeSetup::device,
                      {{D::kNvme, D::kNvme}, {D::kNvme, D::kCpu}, {D::kNvme, D::kNone}, {D::kCpu, D::kNvme},
                       {D::kNone, D::kNvme}},
                      "remat_nvme_save_");
}

// The folder's faults, each a ConfigError naming it and what to change; the
// lock of another job is refused; a crashed run's file is removed.
TEST(NvmeOptimizer, FolderFaultsAreClearAndLeftoversRemoved) {
  const std::string path = nvme_dir("faults");
  NvmeSetup s;
  s.steps = 1;
  s.nvme_path = path + "/missing";
  std::string e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("nvme_path '" + path + "/missing' does not exist"), std::string::npos) << e;
  const std::string file = path + "/a_file";
  if (world()->rank() == 0) std::ofstream(file) << "x";
  world()->barrier()->wait();
  s.nvme_path = file;
  e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("is not a folder"), std::string::npos) << e;
  s.nvme_path = "/proc/self";  // a folder where nothing can be made, even as root
  e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("cannot write its folder '/proc/self/remat-masters/rank"), std::string::npos) << e;
  // A symlink loop is not said to be missing; '~' is not expanded, and said.
  const std::string loop = path + "/loop";
  if (world()->rank() == 0) fs::create_symlink(loop, loop);
  world()->barrier()->wait();
  s.nvme_path = loop;
  e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("nvme_path '" + loop + "' cannot be opened (Too many levels of symbolic links)"),
            std::string::npos) << e;
  s.nvme_path = "~/remat_nvme_no_such_folder";
  e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("does not exist on rank 0: give a folder on a fast local disk (each rank keeps its optimizer's "
                   "float32 masters under it); remat does not expand '~': write the home folder out"),
            std::string::npos) << e;
  s.nvme_path = "";
  e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("needs 'zero_optimization.offload_optimizer.nvme_path'"), std::string::npos) << e;
  // A rank's lock that is a folder, and a rank's folder that is a dangling
  // symbolic link: each named (they were said as "cannot write its folder
  // (Is a directory)" and "(File exists)").
  const std::string odd = path + "/odd";
  const fs::path odd0 = fs::path(odd) / "remat-masters" / "rank0";
  if (world()->rank() == 0) fs::create_directories(odd0 / "lock");
  world()->barrier()->wait();
  s.nvme_path = odd;
  e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("rank 0 cannot open its lock file '" + (odd0 / "lock").string() + "' (Is a directory): give a "
                   "folder this job can write"), std::string::npos) << e;
  if (world()->rank() == 0) {
    fs::remove_all(odd0);
    fs::create_symlink(path + "/gone", odd0);
  }
  world()->barrier()->wait();
  e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("rank 0 cannot write its folder '" + odd0.string() + "': it is a symbolic link to '" + path +
                   "/gone', which does not exist"), std::string::npos) << e;

  // Another job's lock on rank 0's folder (held here by this process).
  s.nvme_path = path;
  const fs::path rank0 = fs::path(path) / "remat-optimizer" / "rank0";
  e = error_while_locked(rank0, s);
  EXPECT_NE(e.find("is in use by another job: rank 0's folder '" + rank0.string() + "' is locked"),
            std::string::npos) << e;

  // What a killed run left: removed under the lock, and the run trains.
  // What remat did not write there (a user's saves) stays, folders and files.
  // A killed run of more ranks (rank 7 of 8) left its files too: rank 0
  // removes them under that rank's lock (they stayed, for good, before);
  // those of a folder another job holds locked (rank 8's, here) stay.
  const fs::path rank7 = fs::path(path) / "remat-optimizer" / "rank7";
  const fs::path masters7 = fs::path(path) / "remat-masters" / "rank7";
  const fs::path rank8 = fs::path(path) / "remat-optimizer" / "rank8";
  int held8 = -1;
  if (world()->rank() == 0) {
    for (const fs::path& dir : {rank7, masters7, rank8}) {
      fs::create_directories(dir);
      std::ofstream(dir / "lock");
    }
    std::ofstream(rank7 / "rank7.optimizer") << "stale state";
    std::ofstream(masters7 / "rank7.masters") << "stale masters";
    std::ofstream(rank7 / "notes.txt") << "mine";
    std::ofstream(rank8 / "rank8.optimizer") << "a live job's";
    held8 = ::open((rank8 / "lock").c_str(), O_RDWR);
    ASSERT_EQ(::flock(held8, LOCK_EX | LOCK_NB), 0);
    std::ofstream(rank0 / "rank0.optimizer.crashed") << "stale state";
    fs::create_directories(rank0 / "saves" / "step_00000002");
    std::ofstream(rank0 / "saves" / "step_00000002" / "manifest.json") << "{}";
    std::ofstream(rank0 / "notes.txt") << "mine";
  }
  world()->barrier()->wait();
  const TrainedRun run = train(s);
  EXPECT_EQ(run.losses.size(), 1u);
  EXPECT_FALSE(fs::exists(rank0 / "rank0.optimizer.crashed"));
  if (world()->rank() == 0) {
    EXPECT_TRUE(fs::exists(rank0 / "saves" / "step_00000002" / "manifest.json")) << "a user's folder is not removed";
    EXPECT_TRUE(fs::exists(rank0 / "notes.txt")) << "a file remat did not write is not removed";
    EXPECT_FALSE(fs::exists(rank7 / "rank7.optimizer")) << "a larger killed run's state is removed";
    EXPECT_FALSE(fs::exists(masters7 / "rank7.masters")) << "and its masters";
    EXPECT_TRUE(fs::exists(rank7 / "notes.txt")) << "a file remat did not write is not removed";
    EXPECT_TRUE(fs::exists(rank8 / "rank8.optimizer")) << "a folder another job holds is left alone";
    ::close(held8);
  }

  // A disk too small (a file-size limit here: EFBIG, as ENOSPC would be):
  // refused at start naming the masters' file, the first reserved (the
  // moments' file's own refusal is nvme_optimizer_store_test's), and no
  // state file left.
  ::signal(SIGXFSZ, SIG_IGN);
  rlimit cap{4096, RLIM_INFINITY};
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &cap), 0);
  e = testing::error_of<Error>([&] { train(s); });
  rlimit none{RLIM_INFINITY, RLIM_INFINITY};
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &none), 0);
  const fs::path masters0 = fs::path(path) / "remat-masters" / "rank0";
  EXPECT_NE(e.find("bytes for its optimizer's float32 masters in '" + masters0.string() +
                   "/rank0.masters' (File too large after 4096 bytes): free space on that disk, give nvme_path a "
                   "larger one"),
            std::string::npos) << e;
  EXPECT_FALSE(fs::exists(masters0 / "rank0.masters")) << "the masters' file goes with the refusal";
  const fs::path mine = fs::path(path) / "remat-optimizer" / str("rank", world()->rank());
  EXPECT_FALSE(fs::exists(mine / str("rank", world()->rank(), ".optimizer"))) << "the unsized file is removed";
}

// sub_group_size 0 or below with "nvme": a configuration error naming the key
// and what to give (it was an internal check of the store's, at initialize).
TEST(NvmeOptimizer, SubGroupSizeBelowOneIsAConfigError) {
  for (const char* size : {"0", "-5"}) {
    const std::string e = testing::error_of<ConfigError>([&] {
      parse_config(str(R"({"zero_optimization": {"stage": 2, "sub_group_size": )", size,
                       R"(, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})"),
                   "<nvme_offload_test>");
    });
    EXPECT_NE(e.find(str("'zero_optimization.sub_group_size' = ", size, " with offload_optimizer device \"nvme\": "
                         "the optimizer state is stepped in sub-groups of that many elements; set 1024 or more")),
              std::string::npos) << e;
  }
  EXPECT_EQ(*parse_config(R"({"zero_optimization": {"stage": 2, "sub_group_size": 0}})", "<nvme_offload_test>")
                 .deepspeed_tuning.sub_group_size, 0) << "without nvme it changes nothing, and is taken";
}

// ---------------------------------------------------------------------------
// offload_param.device "nvme": the shards mapped from a file under nvme_path.

NvmeSetup param_setup(const std::string& path, parallel::OffloadDevice params) {
  NvmeSetup s;
  s.stage = 3;
  s.device = parallel::OffloadDevice::kNone;
  s.nvme_path = path;
  s.param_device = params;
  s.param_path = path;
  return s;
}

// Bitwise as "cpu": float32 and bf16, accumulation, the optimizer on the
// device, the host or the disk beside, frozen parameters, and max_in_cpu
// keeping the first units' shards in memory; the shards' bytes are on disk,
// not in host memory, and the file goes with the engine.
TEST(NvmeParameters, Stage3TrainsBitwiseAsCpu) {
  using D = parallel::OffloadDevice;
  const std::string path = nvme_dir("params");
  struct Case {
    bool bf16;
    int micro;
    D optimizer;
    int64_t max_in_cpu;
    bool frozen;
  };
  const Case cases[] = {{false, 1, D::kNone, 0, false}, {true, 2, D::kNone, 0, false},
                        {false, 2, D::kCpu, 0, false},  {true, 1, D::kNvme, 0, false},
                        {false, 1, D::kNvme, 700, true}};
  for (const Case& c : cases) {
    NvmeSetup s = param_setup(path, D::kCpu);
    s.bf16 = c.bf16;
    s.micro_steps = c.micro;
    s.device = c.optimizer;
    s.max_in_cpu = c.max_in_cpu;
    if (c.frozen) s.frozen = {"pos_emb.weight", "blocks.1.ln1.weight"};
    const std::string what = str(c.bf16 ? "bf16" : "float32", ", micro-steps ", c.micro, ", optimizer on ",
                                 parallel::offload_device_names()[static_cast<int>(c.optimizer)], ", max_in_cpu ",
                                 c.max_in_cpu, c.frozen ? ", frozen" : "");
    const TrainedRun cpu = train(s);
    s.param_device = D::kNvme;
    const TrainedRun nvme = train(s);
    expect_same(cpu, nvme, what);
    EXPECT_LT(nvme.losses.back(), nvme.losses.front()) << what << ": trains";
    const nlohmann::json& m = nvme.metrics.back();
    const int64_t on_disk = m.at("nvme_parameter_bytes").get<int64_t>();
    const int64_t held = cpu.metrics.back().at("host_parameter_bytes").get<int64_t>();
    EXPECT_GT(on_disk, 0) << what;
    // The shards left host memory (each page-padded on disk); what stays is
    // their gradients and the shards within max_in_cpu.
    EXPECT_LT(m.at("host_parameter_bytes").get<int64_t>(), held) << what;
    EXPECT_GE(on_disk + m.at("host_parameter_bytes").get<int64_t>(), held) << what;
    EXPECT_EQ(cpu.metrics.back().count("nvme_parameter_bytes"), 0u) << "a run without it keeps its keys";
    // Each step rewrote the shards on disk it stepped, and read them for
    // that and for the gathers: with every shard on disk and trainable, each
    // is gathered in the forward and the backward of every micro-step, and
    // the shards' float32 gradients are the bytes it wrote.
    const int64_t read = m.at("nvme_parameter_read_bytes").get<int64_t>();
    const int64_t written = m.at("nvme_parameter_written_bytes").get<int64_t>();
    EXPECT_GT(written, 0) << what;
    EXPECT_LE(written, on_disk) << what;
    EXPECT_GE(read, 2 * written) << what;
    if (c.max_in_cpu == 0 && !c.frozen) {
      EXPECT_EQ(written, m.at("host_parameter_bytes").get<int64_t>()) << what;
      EXPECT_GE(read, (1 + 2 * c.micro) * written) << what;
    }
    const fs::path mine = fs::path(path) / "remat-parameters" / str("rank", world()->rank());
    EXPECT_TRUE(fs::exists(mine / "lock")) << what;
    EXPECT_FALSE(fs::exists(mine / str("rank", world()->rank(), ".parameters"))) << what << ": the file is removed";
  }
}

// Saves read the shards from the file and a resume writes them back: resumed
// at step 2 of 4 equals the run that never stopped, across nvme, cpu and
// none, and a 2-rank nvme save resumed at 1 rank equals the cpu save's.
TEST(NvmeParameters, SavesResumeAcrossNvmeCpuAndNone) {
  using D = parallel::OffloadDevice;
  expect_saves_resume(param_setup(nvme_dir("param_saves"), D::kCpu), &NvmeSetup::param_device,
                      {{D::kNvme, D::kNvme}, {D::kNvme, D::kNone}, {D::kNone, D::kNvme}, {D::kCpu, D::kNvme}},
                      "remat_nvme_param_save_");
}

// The folder's faults name offload_param's key; a crashed run's file is
// removed; a disk too small for the shards stops every rank at start.
TEST(NvmeParameters, FolderFaultsAreClearAndLeftoversRemoved) {
  using D = parallel::OffloadDevice;
  const std::string path = nvme_dir("param_faults");
  NvmeSetup s = param_setup(path + "/missing", D::kNvme);
  s.steps = 1;
  std::string e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("zero_optimization.offload_param.nvme_path '" + path + "/missing' does not exist on rank"),
            std::string::npos) << e;
  EXPECT_NE(e.find("each rank keeps its parameter shards under it"), std::string::npos) << e;
  s.param_path = "";
  e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("needs 'zero_optimization.offload_param.nvme_path'"), std::string::npos) << e;
  s.param_path = path;
  s.stage = 2;
  e = testing::error_of<ConfigError>([&] { train(s); });
  EXPECT_NE(e.find("'zero_optimization.offload_param.device' = \"nvme\" needs stage 3"), std::string::npos) << e;
  s.stage = 3;

  const fs::path rank0 = fs::path(path) / "remat-parameters" / "rank0";
  e = error_while_locked(rank0, s);
  EXPECT_NE(e.find("zero_optimization.offload_param.nvme_path '" + path + "' is in use by another job: rank 0's "
                   "folder '" + rank0.string() + "' is locked"), std::string::npos) << e;

  if (world()->rank() == 0) {
    std::ofstream(rank0 / "rank0.parameters") << "stale shards";
    std::ofstream(rank0 / "notes.txt") << "mine";
  }
  world()->barrier()->wait();
  EXPECT_EQ(train(s).losses.size(), 1u);
  if (world()->rank() == 0) {
    EXPECT_FALSE(fs::exists(rank0 / "rank0.parameters")) << "the crashed run's file is removed, and the run's own";
    EXPECT_TRUE(fs::exists(rank0 / "notes.txt")) << "a file remat did not write is not removed";
  }

  // Rank 0's disk cannot hold the shards (a file-size limit: EFBIG, as ENOSPC
  // would be): every rank stops at start with rank 0's reason.
  ::signal(SIGXFSZ, SIG_IGN);
  rlimit cap{4096, RLIM_INFINITY};
  if (world()->rank() == 0) {
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &cap), 0);
  }
  e = testing::error_of<ConfigError>([&] { train(s); });
  rlimit none{RLIM_INFINITY, RLIM_INFINITY};
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &none), 0);
  EXPECT_NE(e.find("rank 0 cannot reserve"), std::string::npos) << e;
  EXPECT_NE(e.find("for its parameter shards in '" + rank0.string() +
                   "/rank0.parameters' (File too large after 0 bytes)"), std::string::npos) << e;
  if (world()->size() > 1) {
    EXPECT_NE(e.find("(placing tensors on NVMe failed on rank 0 of 2; every rank stops with this error)"),
              std::string::npos) << e;
  }

  // The same at tensor parallel 2 (each data-parallel group one rank): rank
  // 1, whose disk holds its shards, stops with rank 0's reason too, rather
  // than waiting in its next collective until rank 0's exit aborts it.
  if (world()->size() == 2) {
    s.tp = 2;
    if (world()->rank() == 0) {
      ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &cap), 0);
    }
    e = testing::error_of<ConfigError>([&] { train(s); });
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &none), 0);
    EXPECT_NE(e.find("rank 0 cannot reserve"), std::string::npos) << e;
    EXPECT_NE(e.find("(placing tensors on NVMe failed on rank 0 of 2; every rank stops with this error)"),
              std::string::npos) << e;
    EXPECT_FALSE(fs::exists(fs::path(path) / "remat-parameters" / str("rank", world()->rank()) /
                            str("rank", world()->rank(), ".parameters"))) << "no file left";
  }
}

}  // namespace
}  // namespace remat
