// engine/safetensors.h: files written and read back bitwise (every dtype,
// zero-size, scalars, views, shards with an index), every fault of a file
// refused at open with its own message, and the writer's misuse refused; a
// sharded set replaced half-way (a failed rename, a SIGKILL) refused, never
// read as a mix, a shard of another set refused by its export id, and a
// folder holding a file and an index read through the file.
#include "engine/safetensors.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <functional>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>

#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using ::remat::testing::error_of;
using ::testing::HasSubstr;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("remat_safetensors_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string at(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::recursive_directory_iterator(dir_)) names.push_back(e.path().lexically_relative(dir_));
    std::sort(names.begin(), names.end());
    return names;
  }
  fs::path dir_;
};

// Values of every dtype the format names, with bit patterns worth keeping.
std::vector<std::pair<std::string, at::Tensor>> every_dtype() {
  at::manual_seed(7);
  std::vector<std::pair<std::string, at::Tensor>> t;
  t.emplace_back("f32", at::randn({3, 5}));
  t.emplace_back("f16", at::randn({4, 2}).to(at::kHalf));
  t.emplace_back("bf16", at::randn({7}).to(at::kBFloat16));
  t.emplace_back("f64", at::randn({2, 3, 2}, at::kDouble));
  t.emplace_back("i64", at::randint(-(int64_t(1) << 40), int64_t(1) << 40, {5}, at::kLong));
  t.emplace_back("i32", at::randint(-100000, 100000, {3, 3}, at::kInt));
  t.emplace_back("i16", at::randint(-30000, 30000, {6}, at::kShort));
  t.emplace_back("i8", at::randint(-128, 128, {9}, at::kChar));
  t.emplace_back("u8", at::randint(0, 256, {2, 2}, at::kByte));
  t.emplace_back("bool", at::randint(0, 2, {3, 1}, at::kLong).to(at::kBool));
  t.emplace_back("empty", at::empty({0, 4}));
  t.emplace_back("scalar", at::scalar_tensor(2.5));
  return t;
}

std::vector<SafetensorsPlanned> plan_of(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<SafetensorsPlanned> plan;
  for (const auto& [name, value] : tensors) plan.push_back({name, value.scalar_type(), value.sizes().vec()});
  return plan;
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return x.numel() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) == 0;
}

TEST_F(SafetensorsTest, EveryDtypeRoundTripsBitwise) {
  const auto tensors = every_dtype();
  SafetensorsWriter out(at("m.safetensors"), plan_of(tensors), {0, {{"format", "pt"}, {"by", "remat"}}});
  for (auto it = tensors.rbegin(); it != tensors.rend(); ++it) out.write(it->first, it->second);  // any order
  const int64_t bytes = out.finish();
  EXPECT_EQ(bytes, static_cast<int64_t>(fs::file_size(at("m.safetensors"))));
  EXPECT_EQ(listing(), std::vector<std::string>{"m.safetensors"}) << "no temporary file left";

  auto file = SafetensorsFile::open(at("m.safetensors"));
  ASSERT_EQ(file->entries().size(), tensors.size());
  EXPECT_EQ(file->metadata(), (std::map<std::string, std::string>{{"by", "remat"}, {"format", "pt"}}));
  for (const auto& [name, value] : tensors) {
    const SafetensorsEntry* e = file->find(name);
    ASSERT_NE(e, nullptr) << name;
    EXPECT_EQ(e->dtype, value.scalar_type()) << name;
    EXPECT_EQ(e->shape, value.sizes().vec()) << name;
    EXPECT_TRUE(same_bits(file->tensor(name), value)) << name;
  }
  EXPECT_EQ(file->find("nope"), nullptr);
}


// The 8 bytes of `n`, little-endian.
std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return s;
}

void put(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A file made by hand: the header's length, the header, the data.
std::string raw_file(const std::string& header, const std::string& data = "") { return le64(header.size()) + header + data; }

std::string file_error(const std::string& path) {
  return error_of<ConfigError>([&] { SafetensorsFile::open(path); });
}

TEST_F(SafetensorsTest, ZeroSizeScalarsAndTheEmptyFileAreValid) {
  put(at("empty.safetensors"), raw_file("{}"));
  auto empty = SafetensorsFile::open(at("empty.safetensors"));
  EXPECT_TRUE(empty->entries().empty());
  EXPECT_EQ(empty->file_bytes(), 10);
  // A scalar, and zero-size tensors at the data's start, middle and end (begin == end).
  const float x = 1.5f;
  const std::string data(reinterpret_cast<const char*>(&x), 4);
  put(at("z.safetensors"),
      raw_file(R"({"a":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]},"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
               R"("b":{"dtype":"I64","shape":[2,0],"data_offsets":[4,4]}})",
               data));
  auto file = SafetensorsFile::open(at("z.safetensors"));
  ASSERT_EQ(file->entries().size(), 3u);
  EXPECT_EQ(file->entries()[0].name, "a") << "in the order of data offsets";
  EXPECT_EQ(file->tensor("a").sizes(), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(file->tensor("b").scalar_type(), at::kLong);
  EXPECT_EQ(file->tensor("s").dim(), 0);
  EXPECT_EQ(file->tensor("s").item<float>(), 1.5f);
}

struct BadFile {
  std::string what, bytes, message;
};

// Every fault the header lists, each in a file built by hand, refused at open
// with the file's name and its own words.
TEST_F(SafetensorsTest, EveryFaultOfAFileIsAConfigErrorNamingIt) {
  const std::string f4(4, '\0'), f8(8, '\0');
  auto one = [](const std::string& entry) { return R"({"w":)" + entry + "}"; };
  const std::vector<BadFile> cases = {
      {"shorter than 8 bytes", "abc", "is 3 bytes, shorter than the 8-byte header length"},
      {"empty", "", "is 0 bytes"},
      {"huge header length", le64(uint64_t(1) << 40) + "{}", "more than the 100000000 a safetensors reader accepts"},
      {"header length past the file", le64(100) + "{}", "its header length is 100 bytes but only 2 follow"},
      {"length of all ones", le64(~uint64_t(0)) + "{}", "its header length is 18446744073709551615"},
      {"no JSON", raw_file("{\"w\":"), "its header does not parse as JSON"},
      {"empty header", raw_file(""), "its header does not parse as JSON"},
      {"not UTF-8", raw_file("{\"w\xff\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}", f4), "UTF-8"},
      {"overlong UTF-8", raw_file("{\"\xc0\xaf\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}", f4), "UTF-8"},
      {"a list", raw_file("[1, 2]"), "its header is a JSON array, not an object"},
      {"an entry of a number", raw_file(R"({"w": 3})"), "tensor 'w' is described by number, not an object"},
      {"nested too deep", raw_file(R"({"w":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}})", f4), "its header nests deeper than 3 levels"},
      {"unknown dtype", raw_file(one(R"({"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]})"), "x"),
       "has dtype 'F8_E4M3', which remat does not read"},
      {"no dtype", raw_file(one(R"({"shape":[1],"data_offsets":[0,4]})"), f4), "has no dtype string"},
      {"an unknown key", raw_file(one(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1})"), f4),
       "has the key 'x'"},
      {"shape not a list", raw_file(one(R"({"dtype":"F32","shape":4,"data_offsets":[0,4]})"), f4), "has no shape array"},
      {"negative size", raw_file(one(R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})"), f4),
       "each size must be an integer >= 0"},
      {"fractional size", raw_file(one(R"({"dtype":"F32","shape":[1.0],"data_offsets":[0,4]})"), f4),
       "each size must be an integer >= 0"},
      {"size past int64", raw_file(one(R"({"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,4]})"), f4),
       "each size must be an integer >= 0"},
      {"bytes past int64", raw_file(one(R"({"dtype":"F32","shape":[4611686018427387904,2],"data_offsets":[0,4]})"), f4),
       "more elements than a 64-bit size holds"},
      {"overflow beside a zero", raw_file(one(R"({"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]})")),
       "more elements than a 64-bit size holds"},
      {"one offset", raw_file(one(R"({"dtype":"F32","shape":[1],"data_offsets":[0]})"), f4),
       "data_offsets [0]: they must be two integers"},
      {"negative offset", raw_file(one(R"({"dtype":"F32","shape":[1],"data_offsets":[-4,0]})"), f4),
       "they must be two integers"},
      {"no offsets", raw_file(one(R"({"dtype":"F32","shape":[1]})"), f4), "has data_offsets missing"},
      {"begin past end", raw_file(one(R"({"dtype":"F32","shape":[1],"data_offsets":[4,0]})"), f4), "begin is past end"},
      {"end past the data", raw_file(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})"), f4),
       "past the end of the data (4 bytes): the file is truncated"},
      {"size not the shape's", raw_file(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,4]})"), f4),
       "is 8 bytes, but its data_offsets [0, 4] hold 4"},
      {"overlap", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f8),
       "tensor 'b' at [4, 8) overlaps tensor 'a' at [0, 8)"},
      {"gap", raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"I8","shape":[1],"data_offsets":[6,7]}})", f8),
       "the data has a gap of 2 bytes at [4, 6) before tensor 'b'"},
      {"first not at 0", raw_file(one(R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})"), f8), "gap of 4 bytes at [0, 4)"},
      {"trailing bytes", raw_file(one(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})"), f8),
       "the tensors cover 4 bytes of data but the file holds 8"},
      {"a name twice", raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f8),
       "its header has the key 'w' twice in one object"},
      {"a key twice", raw_file(one(R"({"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]})"), f4),
       "has the key 'dtype' twice"},
      {"metadata not an object", raw_file(R"({"__metadata__":[]})"), "its __metadata__ is not an object"},
      {"metadata of a number", raw_file(R"({"__metadata__":{"a":1}})"), "its __metadata__ 'a' is a number, not a string"},
  };
  for (const auto& c : cases) {
    const std::string path = at("bad.safetensors");
    put(path, c.bytes);
    const std::string message = file_error(path);
    EXPECT_THAT(message, HasSubstr(c.message)) << c.what;
    EXPECT_THAT(message, HasSubstr("safetensors file '" + path + "': ")) << c.what;
    EXPECT_THAT(message, ::testing::AnyOf(HasSubstr("write it again"), HasSubstr("convert the file"))) << c.what;
  }
  EXPECT_THAT(file_error(at("missing.safetensors")), HasSubstr("cannot open it (No such file or directory): check the path"));
  EXPECT_THAT(file_error(dir_.string()), HasSubstr("it is a directory"));
  ASSERT_EQ(::mkfifo(at("fifo").c_str(), 0600), 0);
  EXPECT_THAT(file_error(at("fifo")), HasSubstr("it is not a regular file")) << "refused, not waited on";
  // The parser's message quotes the bytes it read: shown escaped, the error valid UTF-8.
  put(at("u.safetensors"), raw_file("{\"w\xff\": 1}"));
  EXPECT_THAT(file_error(at("u.safetensors")), HasSubstr("ill-formed UTF-8 byte; last read: '\"w\\xff'"));
}

// Data offsets need not be aligned: a misaligned tensor comes back as an
// aligned copy, an aligned one as a view of the mapping.
TEST_F(SafetensorsTest, MisalignedTensorsAreCopiedAlignedOnesAreViews) {
  const std::vector<float> values = {1.0f, -2.5f, 3.25f};
  const std::string floats(reinterpret_cast<const char*>(values.data()), 12);
  // m at 1 (misaligned), n at 16 (aligned: the data starts 8-byte aligned).
  const std::string data = std::string(1, '\x07') + floats + std::string(3, '\x01') + floats;
  std::string header =
      R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"m":{"dtype":"F32","shape":[3],"data_offsets":[1,13]},)"
      R"("c":{"dtype":"U8","shape":[3],"data_offsets":[13,16]},"n":{"dtype":"F32","shape":[3],"data_offsets":[16,28]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  put(at("m.safetensors"), raw_file(header, data));
  auto file = SafetensorsFile::open(at("m.safetensors"));
  for (const char* name : {"m", "n"}) {
    const at::Tensor t = file->tensor(name);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % alignof(float), 0u) << name;
    EXPECT_TRUE(at::equal(t, at::tensor(values))) << name;
  }
  // A view: the same bytes each time. A copy: new ones.
  EXPECT_EQ(file->tensor("n").data_ptr(), file->tensor("n").data_ptr());
  EXPECT_NE(file->tensor("m").data_ptr(), file->tensor("m").data_ptr());
}

TEST_F(SafetensorsTest, ABoolOtherThanZeroOrOneIsRefused) {
  put(at("b.safetensors"), raw_file(R"({"b":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})", std::string("\1\0\2", 3)));
  auto file = SafetensorsFile::open(at("b.safetensors"));
  EXPECT_THAT(error_of<ConfigError>([&] { file->tensor("b"); }),
              HasSubstr("tensor 'b' of dtype BOOL holds the byte 2 at 2, not 0 or 1"));
  EXPECT_THAT(error_of<ConfigError>([&] { file->tensor("c"); }), HasSubstr("has no tensor 'c' (it has 1 tensors)"));
}

// Views, strided, offset and expanded tensors are written as their values.
TEST_F(SafetensorsTest, ViewsAndExpandedTensorsAreWrittenAsTheirValues) {
  const at::Tensor base = at::arange(60, at::kFloat).reshape({6, 10});
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"transposed", base.t()},
      {"strided", base.slice(1, 1, 9, 3)},
      {"offset", base.select(0, 4)},
      {"expanded", at::arange(3, at::kLong).unsqueeze(1).expand({3, 5})},
      {"negated view", at::_neg_view(base.slice(0, 0, 2))},
  };
  if (at::hasCUDA()) tensors.emplace_back("cuda", base.to(at::kCUDA).to(at::kBFloat16));
  SafetensorsWriter out(at("v.safetensors"), plan_of(tensors));
  for (const auto& [name, value] : tensors) out.write(name, value);
  out.finish();
  auto file = SafetensorsFile::open(at("v.safetensors"));
  for (const auto& [name, value] : tensors) {
    EXPECT_TRUE(same_bits(file->tensor(name), value.resolve_neg().cpu())) << name;
  }
  EXPECT_TRUE(at::equal(file->tensor("negated view"), -base.slice(0, 0, 2)));
}

// Shards of at most 64 bytes of data, in plan order; a tensor larger than
// that alone in its shard; the index last, read back through SafetensorsSet.
TEST_F(SafetensorsTest, ShardsWithAnIndexRoundTrip) {
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"a", at::arange(8, at::kFloat)},            // 32 bytes
      {"b", at::arange(4, at::kInt)},              // 16: with a (48)
      {"big", at::arange(40, at::kDouble)},        // 320: alone
      {"c", at::ones({3}, at::kBFloat16)},         // 6
      {"z", at::empty({0}, at::kLong)},            // 0: with c
      {"d", at::arange(16, at::kFloat)},           // 64: alone (70 > 64)
  };
  const std::string folder = at("out");  // created: its parent exists
  SafetensorsWriter out(folder, plan_of(tensors), {64});
  const std::vector<std::string> names = {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                                          "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
                                          "model.safetensors.index.json"};
  std::vector<std::string> want_paths;
  for (const auto& n : names) want_paths.push_back((fs::path(folder) / n).string());
  EXPECT_EQ(out.paths(), want_paths);
  for (const auto& [name, value] : tensors) out.write(name, value);
  int64_t bytes = out.finish();
  int64_t on_disk = 0;
  for (const auto& p : want_paths) on_disk += static_cast<int64_t>(fs::file_size(p));
  EXPECT_EQ(bytes, on_disk);
  std::vector<std::string> listed;
  for (const auto& n : names) listed.push_back("out/" + n);
  listed.insert(listed.begin(), "out");
  EXPECT_EQ(listing(), listed) << "four shards and the index, no temporary file";

  std::ifstream index_file(want_paths.back());
  const auto index = nlohmann::json::parse(index_file);
  EXPECT_EQ(index["metadata"]["total_size"], 32 + 16 + 320 + 6 + 0 + 64);
  EXPECT_EQ(index["weight_map"]["a"], names[0]);
  EXPECT_EQ(index["weight_map"]["b"], names[0]);
  EXPECT_EQ(index["weight_map"]["big"], names[1]);
  EXPECT_EQ(index["weight_map"]["z"], names[2]);
  EXPECT_EQ(index["weight_map"]["d"], names[3]);

  for (const std::string& path : {folder, want_paths.back()}) {  // the folder, or the index itself
    const SafetensorsSet set = SafetensorsSet::open(path);
    EXPECT_EQ(set.files().size(), 4u);
    EXPECT_EQ(set.names(), (std::vector<std::string>{"a", "b", "big", "c", "d", "z"}));
    EXPECT_EQ(set.total_bytes(), on_disk - static_cast<int64_t>(fs::file_size(want_paths.back())));
    for (const auto& [name, value] : tensors) EXPECT_TRUE(same_bits(set.tensor(name), value)) << name;
    EXPECT_EQ(set.file_of("big")->path(), want_paths[1]);
    EXPECT_EQ(set.find("nope"), nullptr);
    EXPECT_THAT(error_of<ConfigError>([&] { set.tensor("nope"); }), HasSubstr("holds tensor 'nope'"));
  }
  // Each shard alone is a valid file, its data 8-byte aligned.
  for (size_t i = 0; i < 4; ++i) {
    auto shard = SafetensorsFile::open(want_paths[i]);
    EXPECT_EQ(shard->metadata().at("format"), "pt");
    std::ifstream in(want_paths[i], std::ios::binary);
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    EXPECT_EQ(n % 8, 0u) << names[i];
  }
}

TEST_F(SafetensorsTest, AFolderIsReadThroughItsIndexOrItsOneFile) {
  const std::vector<std::pair<std::string, at::Tensor>> one = {{"w", at::arange(3, at::kFloat)}};
  auto write = [&](const std::string& path) {
    SafetensorsWriter out(path, plan_of(one));
    out.write("w", one[0].second);
    out.finish();
  };
  fs::create_directories(at("single"));
  write(at("single/weights.safetensors"));
  EXPECT_TRUE(same_bits(SafetensorsSet::open(at("single")).tensor("w"), one[0].second));
  EXPECT_TRUE(same_bits(SafetensorsSet::open(at("single/weights.safetensors")).tensor("w"), one[0].second));
  write(at("single/other.safetensors"));
  EXPECT_THAT(error_of<ConfigError>([&] { SafetensorsSet::open(at("single")); }),
              HasSubstr("holds 2 .safetensors files (other.safetensors, weights.safetensors) and no "
                        "model.safetensors.index.json saying which tensor is where"));
  fs::create_directories(at("none"));
  EXPECT_THAT(error_of<ConfigError>([&] { SafetensorsSet::open(at("none")); }),
              HasSubstr("holds neither model.safetensors.index.json nor a .safetensors file"));
}

// An index that does not match its files, or is not an index, is refused.
TEST_F(SafetensorsTest, AnIndexThatDoesNotMatchItsFilesIsRefused) {
  // a and b in the first shard, c in the second.
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"a", at::arange(4, at::kFloat)}, {"b", at::arange(4, at::kFloat)}, {"c", at::arange(4, at::kFloat)}};
  {
    SafetensorsWriter out(at("s"), plan_of(tensors), {32});
    for (const auto& [name, value] : tensors) out.write(name, value);
    out.finish();
  }
  const std::string index = at("s/model.safetensors.index.json");
  const std::string f1 = "model-00001-of-00002.safetensors", f2 = "model-00002-of-00002.safetensors";
  auto refusal = [&](const std::string& text) {
    put(index, text);
    return error_of<ConfigError>([&] { SafetensorsSet::open(at("s")); });
  };
  auto map = [](const std::vector<std::pair<std::string, std::string>>& entries) {
    std::string text;
    for (const auto& [name, file] : entries) text += (text.empty() ? "" : ", ") + ("\"" + name + "\": \"" + file + "\"");
    return "{\"weight_map\": {" + text + "}}";
  };
  EXPECT_EQ(SafetensorsSet::open(at("s")).names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_THAT(refusal(map({{"a", f1}, {"b", f1}, {"c", f1}})), HasSubstr("puts tensor 'c' in '" + f1 + "', which does not hold it"));
  EXPECT_THAT(refusal(map({{"a", f1}, {"b", f1}, {"a", f2}})), HasSubstr("it has the key 'a' twice in one object"));
  EXPECT_THAT(refusal(map({{"a", f1}, {"c", f2}})),
              HasSubstr("'" + f1 + "' holds tensor 'b', which the index does not list: the index and its files do not match"));
  EXPECT_THAT(refusal(R"({"weight_map": {"a": "missing.safetensors"}})"),
              HasSubstr("cannot open it (No such file or directory): check the path (named by the index '"));
  EXPECT_THAT(refusal(R"({"weight_map": {"a": "../x.safetensors"}})"), HasSubstr("not a file of the index's folder"));
  EXPECT_THAT(refusal(R"({"weight_map": {"a": "/etc/passwd"}})"), HasSubstr("not a file of the index's folder"));
  EXPECT_THAT(refusal(R"({"weight_map": {"a": 3}})"), HasSubstr("the weight_map's 'a' is not a file name"));
  EXPECT_THAT(refusal(R"({"metadata": {}})"), HasSubstr("it has no weight_map object"));
  EXPECT_THAT(refusal(R"({"weight_map": )"), HasSubstr("it does not parse as JSON"));
}

std::string writer_error(const std::function<void()>& fn) { return error_of<Error>(fn); }

// A writer destroyed before finish() leaves nothing; every misuse is an Error
// naming the tensor.
TEST_F(SafetensorsTest, TheWritersMisuseIsRefusedAndLeavesNoFile) {
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {{"a", at::arange(4, at::kFloat)},
                                                                   {"b", at::ones({2, 2}, at::kBFloat16)}};
  for (int64_t shard : {int64_t(0), int64_t(8)}) {
    const std::string path = at(shard ? "folder" : "m.safetensors");
    {
      SafetensorsWriter out(path, plan_of(tensors), {shard});
      out.write("a", tensors[0].second);
      EXPECT_THAT(writer_error([&] { out.write("a", tensors[0].second); }), HasSubstr("tensor 'a' is written twice"));
      EXPECT_THAT(writer_error([&] { out.write("c", tensors[0].second); }),
                  HasSubstr("tensor 'c' is not in the plan"));
      EXPECT_THAT(writer_error([&] { out.write("b", at::ones({2, 2})); }),
                  HasSubstr("tensor 'b' is Float but planned as BFloat16 (BF16): convert it before writing"));
      EXPECT_THAT(writer_error([&] { out.write("b", at::ones({4}, at::kBFloat16)); }),
                  HasSubstr("tensor 'b' has the shape [4] but is planned as [2, 2]"));
      EXPECT_THAT(writer_error([&] { out.finish(); }),
                  HasSubstr("1 of 2 planned tensors were not written ('b'): write every planned tensor before finish()"));
      EXPECT_FALSE(listing().empty()) << "the temporary files, while the writer lives";
    }
    std::vector<std::string> left = listing();
    if (shard) EXPECT_EQ(left, std::vector<std::string>{"folder"}) << "the folder it created, empty";
    else EXPECT_TRUE(left.empty()) << left[0];
    fs::remove_all(at("folder"));
  }
  auto plan_error = [&](std::vector<SafetensorsPlanned> plan) {
    return writer_error([&] { SafetensorsWriter(at("p.safetensors"), std::move(plan)); });
  };
  EXPECT_THAT(plan_error({{"", at::kFloat, {1}}}), HasSubstr("planned tensor 0 has an empty name"));
  EXPECT_THAT(plan_error({{"ok", at::kFloat, {1}}, {"bad\xff", at::kFloat, {1}}}),
              HasSubstr("the name is not valid UTF-8"));
  EXPECT_THAT(plan_error({{"\xed\xa0\x80", at::kFloat, {1}}}), HasSubstr("not valid UTF-8")) << "a surrogate";
  EXPECT_THAT(plan_error({{"a", at::kFloat, {1}}, {"a", at::kFloat, {2}}}), HasSubstr("'a' is planned twice"));
  EXPECT_THAT(plan_error({{"__metadata__", at::kFloat, {1}}}), HasSubstr("the format's own key"));
  EXPECT_THAT(plan_error({{"c", at::kComplexFloat, {1}}}), HasSubstr("has no safetensors name"));
  EXPECT_THAT(plan_error({{"n", at::kFloat, {-1}}}), HasSubstr("has the shape [-1]"));
  EXPECT_THAT(writer_error([&] { SafetensorsWriter(dir_.string(), {}); }), HasSubstr("it is a directory"));
  EXPECT_THAT(writer_error([&] { SafetensorsWriter(at("no/such/folder"), {}, {8}); }),
              HasSubstr("cannot create the folder"));
  EXPECT_TRUE(listing().empty());
  // Names in any script are written as they are.
  const std::vector<std::pair<std::string, at::Tensor>> utf8 = {{"caf\xc3\xa9.\xe6\x9d\x83\xe9\x87\x8d", at::ones({1})}};
  SafetensorsWriter out(at("u.safetensors"), plan_of(utf8));
  out.write(utf8[0].first, utf8[0].second);
  out.finish();
  EXPECT_NE(SafetensorsFile::open(at("u.safetensors"))->find(utf8[0].first), nullptr);
}

// A disk that cannot take the file (here: a file size limit) is found at
// construction, before any tensor is gathered, and leaves nothing behind.
TEST_F(SafetensorsTest, ADiskWithoutRoomIsAnErrorAndLeavesNothing) {
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  struct rlimit small = old;
  small.rlim_cur = 4096;
  auto* previous = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string message = writer_error([&] {
    SafetensorsWriter(at("big.safetensors"), {{"w", at::kFloat, {1 << 20}}});
  });
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  EXPECT_THAT(message, HasSubstr("cannot reserve its"));
  EXPECT_THAT(message, HasSubstr("free space there, or write elsewhere"));
  EXPECT_TRUE(listing().empty());
}

// An environment variable set for the scope.
struct ScopedEnv {
  ScopedEnv(const char* name, const std::string& value) : name_(name) { ::setenv(name, value.c_str(), 1); }
  ~ScopedEnv() { ::unsetenv(name_); }
  const char* name_;
};

// Six tensors of 32 bytes, each `v` everywhere: six shards at 32 bytes a shard.
std::vector<std::pair<std::string, at::Tensor>> six_of(float v) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (int i = 0; i < 6; ++i) tensors.emplace_back(str("t", i), at::full({8}, v));
  return tensors;
}

void write_set(const std::string& folder, float v) {
  const auto tensors = six_of(v);
  SafetensorsWriter out(folder, plan_of(tensors), {32});
  for (const auto& [name, value] : tensors) out.write(name, value);
  out.finish();
}

// A sharded set written over an earlier one and stopped half-way (the third
// rename fails; or the process is killed before its fourth) leaves a folder
// with no index, which is refused, never read as the mix of both sets its
// shards are; the next write over it is whole again.
TEST_F(SafetensorsTest, AReplacementStoppedHalfWayIsRefusedNeverReadAsAMix) {
  const std::string folder = at("set");
  write_set(folder, 1.0f);
  const auto refused = [&] { return error_of<ConfigError>([&] { SafetensorsSet::open(folder); }); };
  {
    ScopedEnv fault(knobs::kFaultExportRenameFail, "3");
    EXPECT_THAT(writer_error([&] { write_set(folder, 2.0f); }),
                HasSubstr("cannot put the file in place (Input/output error); its temporary file is removed; the "
                          "folder has no index now, so readers refuse it: export again"));
  }
  EXPECT_FALSE(fs::exists(folder + "/model.safetensors.index.json"));
  EXPECT_EQ(SafetensorsFile::open(folder + "/model-00001-of-00006.safetensors")->tensor("t0")[0].item<float>(), 2.0f);
  EXPECT_EQ(SafetensorsFile::open(folder + "/model-00006-of-00006.safetensors")->tensor("t5")[0].item<float>(), 1.0f);
  EXPECT_THAT(refused(), HasSubstr("holds 6 shards (model-0000i-of-0000K.safetensors) and no "
                                   "model.safetensors.index.json: an export into it was interrupted or failed"));
  EXPECT_THAT(refused(), HasSubstr("export again"));
  EXPECT_EQ(listing().size(), 7u) << "the folder and its 6 shards: no temporary file";

  // Killed (SIGKILL) just before the fourth rename, in a child process.
  const auto tensors = six_of(3.0f);
  const pid_t child = ::fork();
  if (child == 0) {
    ::setenv(knobs::kFaultExportRenameKill, "4", 1);
    SafetensorsWriter out(folder, plan_of(tensors), {32});
    for (const auto& [name, value] : tensors) out.write(name, value);
    out.finish();
    ::_exit(0);  // not reached: the seam kills it
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  EXPECT_THAT(refused(), HasSubstr("an export into it was interrupted or failed before writing its index"));
  EXPECT_EQ(SafetensorsFile::open(folder + "/model-00003-of-00006.safetensors")->tensor("t2")[0].item<float>(), 3.0f);
  EXPECT_EQ(SafetensorsFile::open(folder + "/model-00004-of-00006.safetensors")->tensor("t3")[0].item<float>(), 1.0f);

  write_set(folder, 4.0f);  // the killed writer's temporaries are removed, the set whole
  const SafetensorsSet set = SafetensorsSet::open(folder);
  for (const auto& name : set.names()) EXPECT_EQ(set.tensor(name)[0].item<float>(), 4.0f) << name;
  EXPECT_EQ(listing().size(), 8u) << "the folder, 6 shards and the index";
}

// Each set has its own id, in every shard and its index: a shard of another
// set is refused, naming both.
TEST_F(SafetensorsTest, AShardOfAnotherSetIsRefusedByItsExportId) {
  write_set(at("a"), 1.0f);
  write_set(at("b"), 2.0f);
  const auto id_of = [&](const std::string& folder) {
    return SafetensorsFile::open(at(folder + "/model-00002-of-00006.safetensors"))->metadata().at(kSafetensorsExportIdKey);
  };
  const std::string a = id_of("a"), b = id_of("b");
  std::ifstream index(at("a/model.safetensors.index.json"));
  EXPECT_EQ(nlohmann::json::parse(index)["metadata"][kSafetensorsExportIdKey], a);
  EXPECT_EQ(SafetensorsFile::open(at("a/model-00005-of-00006.safetensors"))->metadata().at(kSafetensorsExportIdKey), a);
  EXPECT_EQ(a.size(), 32u);
  EXPECT_NE(a, b);
  fs::copy_file(at("b/model-00002-of-00006.safetensors"), at("a/model-00002-of-00006.safetensors"),
                fs::copy_options::overwrite_existing);
  EXPECT_THAT(error_of<ConfigError>([&] { SafetensorsSet::open(at("a")); }),
              HasSubstr("model.safetensors.index.json' is of the export " + a +
                        " but its file 'model-00002-of-00006.safetensors' is of the export " + b +
                        ": the folder mixes two exports (one stopped half-way); export again"));
}

// A folder holding model.safetensors and an index is read as from_pretrained
// reads it: model.safetensors, the index ignored.
TEST_F(SafetensorsTest, AFolderWithAFileAndAnIndexIsReadThroughTheFile) {
  write_set(at("both"), 1.0f);
  {
    SafetensorsWriter out(at("both/model.safetensors"), {{"t0", at::kFloat, {8}}});
    out.write("t0", at::full({8}, 7.0f));
    out.finish();
  }
  const SafetensorsSet set = SafetensorsSet::open(at("both"));
  EXPECT_EQ(set.names(), std::vector<std::string>{"t0"});
  EXPECT_EQ(set.tensor("t0")[0].item<float>(), 7.0f);
  EXPECT_EQ(SafetensorsSet::open(at("both/model.safetensors.index.json")).names().size(), 6u) << "the index by name";
}

TEST_F(SafetensorsTest, AFileIsReplacedWhole) {
  for (float v : {1.0f, 2.0f}) {
    SafetensorsWriter out(at("m.safetensors"), {{"w", at::kFloat, {2}}});
    out.write("w", at::full({2}, v));
    out.finish();
    EXPECT_THAT(writer_error([&] { out.finish(); }), HasSubstr("finish() called twice"));
  }
  EXPECT_EQ(SafetensorsFile::open(at("m.safetensors"))->tensor("w")[1].item<float>(), 2.0f);
  EXPECT_EQ(listing(), std::vector<std::string>{"m.safetensors"});
}


// ---- The reader fuzzed: seeded mutations of valid files and indexes. ----

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Mutates a safetensors file's bytes: edits aimed at its header (bytes,
// tokens, numbers), its length field, its size.
class Mutator {
 public:
  explicit Mutator(uint32_t seed) : rng_(seed) {}
  uint32_t next(uint32_t n) { return n == 0 ? 0 : rng_() % n; }

  std::string text_edit(std::string text) {
    static const std::vector<std::string> tokens = {
        "{", "}", "[", "]", ",", ":", "\"", " ", "-1", "0", "1", "7", "1e30", "0.5", "18446744073709551615",
        "9223372036854775807", "4294967296", "\"F32\"", "\"BOOL\"", "\"BF16\"", "\"I64\"", "\"U16\"", "\"dtype\"",
        "\"shape\"", "\"data_offsets\"", "\"__metadata__\"", "[0,0]", "[]", "{}", "null", "\xff", "\xc3", "\xed\xa0\x80",
        "\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"};
    const size_t at = next(text.size() + 1);
    switch (next(5)) {
      case 0:
        if (!text.empty()) text[at % text.size()] = static_cast<char>(next(256));
        break;
      case 1: text.insert(at, tokens[next(tokens.size())]); break;
      case 2:
        if (at < text.size()) text.erase(at, 1 + next(12));
        break;
      default: {  // a number of the text replaced: offsets and sizes off by a little or a lot
        std::vector<std::pair<size_t, size_t>> numbers;
        for (size_t i = 0; i < text.size();) {
          size_t j = i;
          while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
          if (j > i) numbers.emplace_back(i, j - i);
          i = j + 1;
        }
        if (numbers.empty()) break;
        const auto [begin, length] = numbers[next(numbers.size())];
        const uint64_t old = std::strtoull(text.substr(begin, length).c_str(), nullptr, 10);  // wraps: fine
        const std::vector<std::string> values = {std::to_string(old + 1), std::to_string(old - 1),
                                                 std::to_string(old * 2), "0", std::to_string(next(100)),
                                                 "9223372036854775807", "99999999999999999999"};
        text.replace(begin, length, values[next(values.size())]);
      }
    }
    return text;
  }

  std::string file_edit(const std::string& bytes) {
    uint64_t n = 0;
    for (int i = 7; i >= 0 && bytes.size() >= 8; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
    const bool framed = bytes.size() >= 8 && n <= bytes.size() - 8;
    switch (next(6)) {
      case 0:
      case 1:
      case 2:
        if (framed) {  // the header edited; its length kept right, or not
          const std::string header = text_edit(bytes.substr(8, n));
          return le64(next(4) ? header.size() : n) + header + bytes.substr(8 + n);
        }
        return text_edit(bytes);
      case 3: return bytes.substr(0, next(bytes.size() + 1));  // truncated
      case 4: {                                                // the length spliced
        const std::vector<uint64_t> lengths = {0, 1, n - 1, n + 1, n + 8, bytes.size() - 8, bytes.size() - 7,
                                               uint64_t(kMaxSafetensorsHeaderBytes), uint64_t(kMaxSafetensorsHeaderBytes) + 1,
                                               uint64_t(1) << 63, ~uint64_t(0), next(1 << 20)};
        return le64(lengths[next(lengths.size())]) + (bytes.size() > 8 ? bytes.substr(8) : std::string());
      }
      default: {  // bytes of the data flipped or added
        std::string out = bytes;
        if (next(2) && !out.empty()) out[next(out.size())] ^= static_cast<char>(1 + next(255));
        else out.append(1 + next(9), static_cast<char>(next(256)));
        return out;
      }
    }
  }

 private:
  std::mt19937 rng_;
};

// A file open() accepted: every entry within the data, its size its shape's,
// and every tensor readable to its last byte (a bad BOOL a ConfigError).
void check_accepted(const SafetensorsFile& file, int64_t* sum) {
  for (const auto& e : file.entries()) {
    ASSERT_LE(0, e.begin);
    ASSERT_LE(e.begin, e.end);
    ASSERT_LE(e.end, file.file_bytes() - 8);
    try {
      const at::Tensor t = file.tensor(e.name);
      ASSERT_EQ(t.numel() * t.element_size(), e.end - e.begin) << e.name;
      const auto* p = static_cast<const unsigned char*>(t.data_ptr());
      for (int64_t i = 0; i < e.end - e.begin; ++i) *sum += p[i];
    } catch (const ConfigError&) {
    }
  }
}

// Mutated files and indexes through SafetensorsFile::open and
// SafetensorsSet::open: each ends in a ConfigError or in a file whose every
// tensor lies within it, never a crash, an out-of-bounds read (ASan:
// tools/sanitize.sh --quick runs this) or another exception. A fixed seed, so
// a failure names a case that reproduces; bounded by count and by time.
TEST_F(SafetensorsTest, FuzzEveryMutationEndsInAFileOrAConfigError) {
  auto tensors = every_dtype();
  {
    SafetensorsWriter out(at("seed.safetensors"), plan_of(tensors));
    for (const auto& [name, value] : tensors) out.write(name, value);
    out.finish();
  }
  const std::vector<std::string> seeds = {
      read_bytes(at("seed.safetensors")), raw_file("{}"),
      raw_file(R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"m":{"dtype":"F32","shape":[2],"data_offsets":[1,9]},)"
               R"("t":{"dtype":"BOOL","shape":[2],"data_offsets":[9,11]}})",
               std::string("\x07\0\0\x80?\0\0\0@\1\0", 11))};
  Mutator mutate(20261129);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  int accepted = 0, refused = 0, n = 0;
  int64_t sum = 0;
  const std::string path = at("case.safetensors");
  for (; n < 20000 && std::chrono::steady_clock::now() < deadline; ++n) {
    std::string bytes = seeds[mutate.next(seeds.size())];
    for (uint32_t e = 1 + mutate.next(3); e > 0; --e) bytes = mutate.file_edit(bytes);
    put(path, bytes);
    try {
      auto file = SafetensorsFile::open(path);
      check_accepted(*file, &sum);
      ++accepted;
    } catch (const ConfigError&) {
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "case " << n << " threw " << typeid(e).name() << ": " << e.what();
      break;
    }
    if (::testing::Test::HasFatalFailure()) {
      ADD_FAILURE() << "case " << n << ": " << nlohmann::json(bytes.substr(0, 400)).dump(-1, ' ', true);
      break;
    }
  }
  std::printf("safetensors fuzz: %d files, %d accepted, %d ConfigError (checksum %lld)\n", n, accepted, refused,
              static_cast<long long>(sum));
  EXPECT_GE(n, 1000) << "too few cases ran in the time allowed";
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
}

TEST_F(SafetensorsTest, FuzzShardedSetsEndInASetOrAConfigError) {
  auto tensors = every_dtype();
  {
    SafetensorsWriter out(at("set"), plan_of(tensors), {64});
    for (const auto& [name, value] : tensors) out.write(name, value);
    out.finish();
  }
  std::vector<std::pair<std::string, std::string>> files;  // name, bytes
  for (const auto& e : fs::directory_iterator(at("set"))) files.emplace_back(e.path().filename(), read_bytes(e.path()));
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 4u);
  const size_t index = files.size() - 1;  // model.safetensors.index.json sorts last
  Mutator mutate(52);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(6);
  int accepted = 0, refused = 0, n = 0;
  int64_t sum = 0;
  for (; n < 4000 && std::chrono::steady_clock::now() < deadline; ++n) {
    auto mutated = files;
    const size_t which = mutate.next(3) ? index : mutate.next(files.size());
    for (uint32_t e = 1 + mutate.next(3); e > 0; --e) {
      std::string& bytes = mutated[which].second;
      bytes = which == index ? mutate.text_edit(bytes) : mutate.file_edit(bytes);
    }
    for (const auto& [name, bytes] : mutated) put(at("set/" + name), bytes);
    try {
      const SafetensorsSet set = SafetensorsSet::open(at("set"));
      for (const auto& file : set.files()) check_accepted(*file, &sum);
      for (const auto& name : set.names()) ASSERT_NE(set.find(name), nullptr);
      ++accepted;
    } catch (const ConfigError&) {
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "case " << n << " threw " << typeid(e).name() << ": " << e.what() << "\n"
                    << mutated[which].first << ": " << nlohmann::json(mutated[which].second.substr(0, 400)).dump(-1, ' ', true);
      break;
    }
    if (::testing::Test::HasFatalFailure()) break;
  }
  std::printf("safetensors set fuzz: %d sets, %d accepted, %d ConfigError (checksum %lld)\n", n, accepted, refused,
              static_cast<long long>(sum));
  EXPECT_GE(n, 300) << "too few cases ran in the time allowed";
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace remat
