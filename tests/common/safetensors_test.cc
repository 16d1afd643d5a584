// Tests for common/safetensors: round trips, sharded checkpoints, and every kind of bad file.
#include "common/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// A fresh, empty folder per test.
fs::path TestDir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::path(TANDEM_TEST_TMPDIR) / "safetensors_test_files" /
                 (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A file laid out by hand: [u64 header length][header][data_bytes zero bytes]. `declared_len`
// replaces the true header length, to make the file lie about it.
void WriteRaw(const fs::path& path, const std::string& header, size_t data_bytes,
              std::optional<uint64_t> declared_len = std::nullopt) {
  uint64_t n = declared_len.value_or(header.size());
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  bytes += header;
  bytes.append(data_bytes, '\0');
  WriteText(path, bytes);
}

std::vector<std::byte> FloatBytes(DType t, const std::vector<float>& values) {
  std::vector<std::byte> out(values.size() * DTypeSize(t));
  if (!values.empty()) FromFloat(t, values.data(), values.size(), out.data());
  return out;
}

TensorToWrite MakeTensor(const std::string& name, DType t, std::vector<int64_t> shape,
                         const std::vector<float>& values) {
  return TensorToWrite{name, t, std::move(shape), FloatBytes(t, values)};
}

// A small valid Llama config.json, written the way Hugging Face names the fields.
void WriteLlamaConfig(const fs::path& dir) {
  WriteText(dir / "config.json", R"({
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 32,
  "hidden_size": 8,
  "intermediate_size": 16,
  "num_hidden_layers": 2,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "max_position_embeddings": 64,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "torch_dtype": "float32"
})");
}

// Values exactly representable in F32, F16 and BF16, so every round trip is exact.
const std::vector<float> kSix = {1.0f, -2.0f, 0.5f, 0.0f, 3.25f, -0.125f};

// ---------------------------------------------------------------------------------------------
// Round trips

class RoundTripTest : public ::testing::TestWithParam<DType> {};

TEST_P(RoundTripTest, WrittenTensorsReadBackWithSameDtypeShapeBytesAndMetadata) {
  const DType t = GetParam();
  fs::path dir = TestDir();
  std::vector<TensorToWrite> tensors = {
      MakeTensor("b.weight", t, {2, 3}, kSix),
      MakeTensor("a.bias", t, {3}, {4.0f, -8.0f, 0.25f}),
      MakeTensor("scalar", t, {}, {7.0f}),
      MakeTensor("empty", t, {0, 4}, {}),
  };
  ASSERT_TRUE(WriteSafetensors(dir / "x.safetensors", tensors, {{"format", "pt"}}).ok());

  auto file = SafetensorsFile::Open(dir / "x.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_THAT((*file)->names(), ElementsAre("a.bias", "b.weight", "empty", "scalar"));
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  for (const TensorToWrite& w : tensors) {
    auto view = (*file)->tensor(w.name);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->name, w.name);
    EXPECT_EQ(view->dtype, t);
    EXPECT_EQ(view->shape, w.shape);
    ASSERT_EQ(view->data.size(), w.bytes.size()) << w.name;
    EXPECT_TRUE(std::equal(w.bytes.begin(), w.bytes.end(), view->data.begin())) << w.name;
  }
  EXPECT_EQ((*file)->tensor("scalar")->numel(), 1);
  EXPECT_EQ((*file)->tensor("empty")->numel(), 0);
}

TEST_P(RoundTripTest, CheckpointReadFloatConvertsToFloat) {
  const DType t = GetParam();
  fs::path dir = TestDir();
  WriteLlamaConfig(dir);
  ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", {MakeTensor("w", t, {3, 2}, kSix)}).ok());
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->config().hidden_size, 8);
  EXPECT_TRUE((*ckpt)->contains("w"));
  auto values = (*ckpt)->ReadFloat("w", {3, 2});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, kSix);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, RoundTripTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(WriteSafetensorsTest, HeaderIsPaddedTo8BytesAndOffsetsFollowTheGivenOrder) {
  fs::path dir = TestDir();
  // Name lengths chosen so the compact header is not already a multiple of 8.
  ASSERT_TRUE(WriteSafetensors(dir / "x.safetensors",
                               {MakeTensor("zz", DType::kF32, {2}, {1, 2}),
                                MakeTensor("a", DType::kF16, {3}, {1, 2, 3}),
                                MakeTensor("m", DType::kBF16, {1}, {1})},
                               {{"k", "v"}})
                  .ok());
  std::string bytes = ReadAll(dir / "x.safetensors");
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 8 + 6 + 2);
  std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.back(), ' ');  // padding is spaces
  auto j = nlohmann::json::parse(header);
  EXPECT_EQ(j["zz"]["data_offsets"], nlohmann::json::array({0, 8}));
  EXPECT_EQ(j["a"]["data_offsets"], nlohmann::json::array({8, 14}));
  EXPECT_EQ(j["m"]["data_offsets"], nlohmann::json::array({14, 16}));
  EXPECT_EQ(j["a"]["dtype"], "F16");
  EXPECT_EQ(j["m"]["dtype"], "BF16");
  EXPECT_EQ(j["__metadata__"]["k"], "v");
}

TEST(WriteSafetensorsTest, SameInputGivesIdenticalBytes) {
  fs::path dir = TestDir();
  std::vector<TensorToWrite> tensors = {MakeTensor("b", DType::kBF16, {2, 3}, kSix),
                                        MakeTensor("a", DType::kF32, {2}, {1, 2})};
  ASSERT_TRUE(WriteSafetensors(dir / "1.safetensors", tensors, {{"format", "pt"}}).ok());
  ASSERT_TRUE(WriteSafetensors(dir / "2.safetensors", tensors, {{"format", "pt"}}).ok());
  EXPECT_EQ(ReadAll(dir / "1.safetensors"), ReadAll(dir / "2.safetensors"));
}

TEST(WriteSafetensorsTest, BytesNotMatchingShapeAreRejectedNamingTheTensor) {
  fs::path dir = TestDir();
  TensorToWrite t = MakeTensor("layer.w", DType::kF16, {2, 3}, kSix);
  t.bytes.pop_back();
  absl::Status s = WriteSafetensors(dir / "x.safetensors", {t});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("x.safetensors"), HasSubstr("layer.w")));
  EXPECT_FALSE(fs::exists(dir / "x.safetensors"));
}

TEST(WriteSafetensorsTest, DuplicateNameIsRejected) {
  fs::path dir = TestDir();
  absl::Status s = WriteSafetensors(
      dir / "x.safetensors",
      {MakeTensor("w", DType::kF32, {1}, {1}), MakeTensor("w", DType::kF32, {1}, {2})});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'w'"));
}

// ---------------------------------------------------------------------------------------------
// Sharded checkpoints

// Two shards: layer 0 in shard 1, layer 1 and the head in shard 2.
fs::path WriteShardedCheckpoint() {
  fs::path dir = TestDir();
  WriteLlamaConfig(dir);
  EXPECT_TRUE(WriteSafetensors(dir / "model-00001-of-00002.safetensors",
                               {MakeTensor("layers.0.w", DType::kBF16, {2, 3}, kSix)})
                  .ok());
  EXPECT_TRUE(WriteSafetensors(dir / "model-00002-of-00002.safetensors",
                               {MakeTensor("layers.1.w", DType::kF16, {3}, {1, 2, 3}),
                                MakeTensor("lm_head.weight", DType::kF32, {2}, {5, 6})})
                  .ok());
  WriteText(dir / "model.safetensors.index.json", R"({
  "metadata": {"total_size": 24},
  "weight_map": {
    "layers.0.w": "model-00001-of-00002.safetensors",
    "layers.1.w": "model-00002-of-00002.safetensors",
    "lm_head.weight": "model-00002-of-00002.safetensors"
  }
})");
  return dir;
}

TEST(CheckpointTest, ShardedCheckpointReadsTensorsFromEveryShard) {
  fs::path dir = WriteShardedCheckpoint();
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE((*ckpt)->contains("layers.0.w"));
  EXPECT_TRUE((*ckpt)->contains("lm_head.weight"));
  EXPECT_FALSE((*ckpt)->contains("layers.2.w"));
  EXPECT_EQ(*(*ckpt)->ReadFloat("layers.0.w", {2, 3}), kSix);
  EXPECT_EQ(*(*ckpt)->ReadFloat("layers.1.w", {3}), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(*(*ckpt)->ReadFloat("lm_head.weight", {2}), (std::vector<float>{5, 6}));
  auto view = (*ckpt)->tensor("layers.1.w");
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->dtype, DType::kF16);
}

TEST(CheckpointTest, ShardsAreOpenedOnlyWhenOneOfTheirTensorsIsRead) {
  fs::path dir = WriteShardedCheckpoint();
  // Shard 2 is garbage: opening the checkpoint and reading from shard 1 must not touch it.
  WriteText(dir / "model-00002-of-00002.safetensors", "this is not a safetensors file at all");
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto good = (*ckpt)->ReadFloat("layers.0.w", {2, 3});
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(*good, kSix);

  auto bad = (*ckpt)->tensor("layers.1.w");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("model-00002-of-00002.safetensors"));
  // The failure is not cached as success, and shard 1 still serves reads.
  EXPECT_FALSE((*ckpt)->tensor("lm_head.weight").ok());
  EXPECT_TRUE((*ckpt)->tensor("layers.0.w").ok());
}

TEST(CheckpointTest, IndexNamingAMissingShardFailsAtOpenNamingTheShard) {
  fs::path dir = WriteShardedCheckpoint();
  fs::remove(dir / "model-00002-of-00002.safetensors");
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(ckpt.status().message(), AllOf(HasSubstr("model-00002-of-00002.safetensors"),
                                             HasSubstr("model.safetensors.index.json")));
}

TEST(CheckpointTest, IndexWhoseShardLacksTheTensorIsNotFoundNamingBoth) {
  fs::path dir = WriteShardedCheckpoint();
  WriteText(dir / "model.safetensors.index.json", R"({"weight_map": {
    "layers.1.w": "model-00001-of-00002.safetensors"}})");
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto t = (*ckpt)->tensor("layers.1.w");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(),
              AllOf(HasSubstr("layers.1.w"), HasSubstr("model-00001-of-00002.safetensors")));
}

TEST(CheckpointTest, MalformedIndexIsRejectedNamingIt) {
  fs::path dir = WriteShardedCheckpoint();
  WriteText(dir / "model.safetensors.index.json", R"({"weight_map": {"a": )");
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ckpt.status().message(), HasSubstr("model.safetensors.index.json"));
}

TEST(CheckpointTest, IndexWithoutWeightMapIsRejected) {
  fs::path dir = WriteShardedCheckpoint();
  WriteText(dir / "model.safetensors.index.json", R"({"metadata": {}})");
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ckpt.status().message(),
              AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("weight_map")));
}

TEST(CheckpointTest, IndexPointingOutsideTheFolderIsRejectedNamingTheTensor) {
  fs::path dir = WriteShardedCheckpoint();
  WriteText(dir / "model.safetensors.index.json",
            R"({"weight_map": {"layers.0.w": "../elsewhere/model.safetensors"}})");
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ckpt.status().message(),
              AllOf(HasSubstr("layers.0.w"), HasSubstr("../elsewhere/model.safetensors")));
}

TEST(CheckpointTest, MissingTensorIsNotFoundNamingTensorAndFolder) {
  fs::path dir = WriteShardedCheckpoint();
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto t = (*ckpt)->tensor("layers.7.w");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(), AllOf(HasSubstr("layers.7.w"), HasSubstr(dir.string())));
  auto f = (*ckpt)->ReadFloat("layers.7.w", {1});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
}

TEST(CheckpointTest, ReadFloatWithWrongShapeNamesTensorAndBothShapes) {
  fs::path dir = WriteShardedCheckpoint();
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  // Same element count, different shape: still wrong.
  auto f = (*ckpt)->ReadFloat("layers.0.w", {3, 2});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(),
              AllOf(HasSubstr("layers.0.w"), HasSubstr("[3, 2]"), HasSubstr("[2, 3]")));
}

TEST(CheckpointTest, MissingConfigJsonIsNotFoundNamingIt) {
  fs::path dir = TestDir();
  ASSERT_TRUE(
      WriteSafetensors(dir / "model.safetensors", {MakeTensor("w", DType::kF32, {1}, {1})}).ok());
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(ckpt.status().message(), HasSubstr("config.json"));
}

TEST(CheckpointTest, FolderWithoutWeightsIsNotFoundNamingBothFileNames) {
  fs::path dir = TestDir();
  WriteLlamaConfig(dir);
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(ckpt.status().message(),
              AllOf(HasSubstr(dir.string()), HasSubstr("model.safetensors.index.json")));
}

TEST(CheckpointTest, FolderWithOnlyPytorchWeightsNamesThemAndHowToConvert) {
  fs::path dir = TestDir();
  WriteLlamaConfig(dir);
  WriteText(dir / "pytorch_model.bin", "PK\x03\x04 not read");
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(ckpt.status().message(),
              AllOf(HasSubstr("pytorch_model.bin"), HasSubstr("safe_serialization=True")));
  // Without it, no word of PyTorch.
  fs::remove(dir / "pytorch_model.bin");
  EXPECT_THAT(Checkpoint::Open(dir).status().message(), Not(HasSubstr("pytorch")));
}

TEST(CheckpointTest, CorruptSingleFileIsRejectedAtOpenNamingIt) {
  fs::path dir = TestDir();
  WriteLlamaConfig(dir);
  WriteRaw(dir / "model.safetensors", "{not json", 0);
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ckpt.status().message(), HasSubstr("model.safetensors"));
}

// ---------------------------------------------------------------------------------------------
// Bad safetensors files. Each error must carry the file's path, and the tensor's name where one
// tensor is at fault.

class BadFileTest : public ::testing::Test {
 protected:
  void SetUp() override { path_ = TestDir() / "bad.safetensors"; }
  absl::Status OpenStatus() { return SafetensorsFile::Open(path_).status(); }
  void ExpectError(absl::StatusCode code, const std::vector<std::string>& needles) {
    absl::Status s = OpenStatus();
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(path_.string()));
    for (const std::string& n : needles) EXPECT_THAT(std::string(s.message()), HasSubstr(n));
  }
  fs::path path_;
};

TEST_F(BadFileTest, MissingFileIsNotFound) { ExpectError(absl::StatusCode::kNotFound, {}); }

TEST_F(BadFileTest, FileShorterThanEightBytes) {
  WriteText(path_, "abc");
  ExpectError(absl::StatusCode::kInvalidArgument, {"too short"});
}

TEST_F(BadFileTest, EmptyFile) {
  WriteText(path_, "");
  ExpectError(absl::StatusCode::kInvalidArgument, {"too short"});
}

TEST_F(BadFileTest, TruncatedInsideTheHeader) {
  ASSERT_TRUE(WriteSafetensors(path_, {MakeTensor("w", DType::kF32, {4}, {1, 2, 3, 4})}).ok());
  fs::resize_file(path_, 20);
  ExpectError(absl::StatusCode::kInvalidArgument, {"header length"});
}

TEST_F(BadFileTest, TruncatedDataSectionNamesTheTensorThatNoLongerFits) {
  ASSERT_TRUE(WriteSafetensors(path_, {MakeTensor("first", DType::kF32, {2}, {1, 2}),
                                       MakeTensor("second", DType::kF32, {2}, {3, 4})})
                  .ok());
  fs::resize_file(path_, fs::file_size(path_) - 1);
  ExpectError(absl::StatusCode::kInvalidArgument, {"second", "data section"});
}

TEST_F(BadFileTest, HeaderLengthBeyondTheFile) {
  WriteRaw(path_, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4,
           /*declared_len=*/1000);
  ExpectError(absl::StatusCode::kInvalidArgument, {"header length 1000"});
}

TEST_F(BadFileTest, HeaderLengthOneBytePastTheEnd) {
  // One byte more than the file holds: accepted, the data section's size would wrap around and
  // no tensor's offsets would be bounded any more.
  const std::string header = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  WriteRaw(path_, header, 0, /*declared_len=*/header.size() + 1);
  ExpectError(absl::StatusCode::kInvalidArgument,
              {absl::StrCat("header length ", header.size() + 1), "runs past the end"});
}

TEST_F(BadFileTest, HeaderEndingExactlyAtTheEndOfTheFileIsAccepted) {
  WriteRaw(path_, R"({"__metadata__":{"format":"pt"}})", 0);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path_);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->names().empty());
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
}

TEST_F(BadFileTest, HeaderLengthAbsurdlyLarge) {
  WriteRaw(path_, "{}", 0, /*declared_len=*/~uint64_t{0});
  ExpectError(absl::StatusCode::kInvalidArgument, {"header length"});
}

TEST_F(BadFileTest, HeaderLengthOverTheFormatLimitEvenWhenTheFileIsThatLarge) {
  // A sparse file larger than the 100 MB header limit; its header "claims" 100 MB + 8.
  WriteRaw(path_, "{}", 0, /*declared_len=*/100'000'008);
  fs::resize_file(path_, 100'000'100);
  ExpectError(absl::StatusCode::kInvalidArgument, {"limit"});
}

TEST_F(BadFileTest, HeaderLengthShorterThanTheJson) {
  std::string header = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  WriteRaw(path_, header, 4, /*declared_len=*/header.size() - 5);
  ExpectError(absl::StatusCode::kInvalidArgument, {"JSON"});
}

TEST_F(BadFileTest, CorruptJsonHeader) {
  WriteRaw(path_, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})", 4);
  ExpectError(absl::StatusCode::kInvalidArgument, {"not valid JSON"});
}

TEST_F(BadFileTest, HeaderThatIsNotAnObject) {
  WriteRaw(path_, "[1, 2, 3]", 0);
  ExpectError(absl::StatusCode::kInvalidArgument, {"array"});
}

TEST_F(BadFileTest, TensorEntryThatIsNotAnObject) {
  WriteRaw(path_, R"({"w": 5})", 0);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'"});
}

TEST_F(BadFileTest, MissingDtype) {
  WriteRaw(path_, R"({"w":{"shape":[1],"data_offsets":[0,4]}})", 4);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'", "dtype"});
}

TEST_F(BadFileTest, MissingShape) {
  WriteRaw(path_, R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", 4);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'", "shape"});
}

TEST_F(BadFileTest, MissingDataOffsets) {
  WriteRaw(path_, R"({"w":{"dtype":"F32","shape":[1]}})", 4);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'", "data_offsets"});
}

TEST_F(BadFileTest, DataOffsetsWithThreeElements) {
  WriteRaw(path_, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", 8);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'", "data_offsets"});
}

TEST_F(BadFileTest, NegativeDimension) {
  WriteRaw(path_, R"({"w":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,16]}})", 16);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'", "shape[0]"});
}

TEST_F(BadFileTest, FractionalDimension) {
  WriteRaw(path_, R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,10]}})", 16);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'", "shape[0]"});
}

TEST_F(BadFileTest, NegativeOffset) {
  WriteRaw(path_, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 4);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'", "data_offsets"});
}

TEST_F(BadFileTest, OffsetsEndingBeforeTheyBegin) {
  WriteRaw(path_, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'", "end before"});
}

TEST_F(BadFileTest, OffsetsBeyondTheDataSection) {
  WriteRaw(path_,
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           8);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'b'", "data section"});
}

TEST_F(BadFileTest, SizeNotMatchingShapeAndDtype) {
  // BF16 [2, 3] needs 12 bytes; the offsets give 24 (as if it were F32).
  WriteRaw(path_, R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,24]}})", 24);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'", "24 bytes", "needs 12"});
}

TEST_F(BadFileTest, ShapeWhoseByteSizeOverflows) {
  WriteRaw(path_, R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})",
           0);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'"});
}

TEST_F(BadFileTest, OverlappingTensorsNamesBoth) {
  WriteRaw(path_,
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           12);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'a'", "'b'", "overlap"});
}

TEST_F(BadFileTest, TensorInsideAnEarlierLargerTensorIsAnOverlap) {
  // "big" covers [0, 32); "mid" sits after "small" but still inside "big".
  WriteRaw(path_,
           R"({"big":{"dtype":"F32","shape":[8],"data_offsets":[0,32]},)"
           R"("small":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
           R"("mid":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}})",
           32);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'big'", "overlap"});
}

TEST_F(BadFileTest, EmptyTensorsAtTheSameOffsetAreNotAnOverlap) {
  WriteRaw(path_,
           R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
           R"("c":{"dtype":"F16","shape":[0,3],"data_offsets":[4,4]}})",
           8);
  EXPECT_TRUE(OpenStatus().ok()) << OpenStatus();
}

TEST_F(BadFileTest, UnknownDtypeNamesTensorAndDtype) {
  WriteRaw(path_, R"({"w":{"dtype":"Q4_K","shape":[1],"data_offsets":[0,4]}})", 4);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'w'", "Q4_K"});
}

TEST_F(BadFileTest, UnsupportedDtypeIsUnimplementedNamingTensorAndDtype) {
  WriteRaw(path_, R"({"ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 8);
  ExpectError(absl::StatusCode::kUnimplemented, {"'ids'", "I64"});
}

TEST_F(BadFileTest, MetadataThatIsNotAnObject) {
  WriteRaw(path_, R"({"__metadata__": "pt"})", 0);
  ExpectError(absl::StatusCode::kInvalidArgument, {"__metadata__"});
}

TEST_F(BadFileTest, MetadataValueThatIsNotAString) {
  WriteRaw(path_, R"({"__metadata__": {"format": 1}})", 0);
  ExpectError(absl::StatusCode::kInvalidArgument, {"__metadata__", "format"});
}

TEST_F(BadFileTest, DirectoryInsteadOfAFile) {
  fs::create_directories(path_);
  ExpectError(absl::StatusCode::kInvalidArgument, {"not a regular file"});
}

TEST(SafetensorsFileTest, MissingTensorIsNotFoundNamingFileAndTensor) {
  fs::path path = TestDir() / "x.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, {MakeTensor("w", DType::kF32, {1}, {1})}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_FALSE((*file)->contains("v"));
  auto t = (*file)->tensor("v");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(), AllOf(HasSubstr(path.string()), HasSubstr("'v'")));
}

}  // namespace
}  // namespace tandem
