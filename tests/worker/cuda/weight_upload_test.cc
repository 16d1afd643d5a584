// UploadStageWeights and the conversion kernels: for checkpoints stored in F32, F16 and BF16 and
// served in F16 and BF16, every device tensor equals bit for bit the host's conversion of what
// LoadStageWeights reads (fp32, engine layout), with chunks small enough to cut every tensor and
// with the default ones; the kernels alone against common/dtype.h on values that round, overflow
// and go subnormal. Skipped where no GPU is present.
#include "worker/cuda/weight_upload.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/cuda/cuda_test_util.h"
#include "tools/model_generator.h"
#include "worker/cuda/cuda_stage.h"
#include "worker/cuda/weight_convert.h"

namespace tandem {
namespace {


std::filesystem::path WriteCheckpoint(const std::string& preset, const std::string& dtype) {
  auto base = PresetConfig(preset);
  EXPECT_TRUE(base.ok()) << base.status();
  ModelOverrides o;
  o.dtype = dtype;
  auto c = ApplyOverrides(*base, o);
  EXPECT_TRUE(c.ok()) << c.status();
  const std::filesystem::path dir = std::filesystem::path(TANDEM_TEST_TMPDIR) /
                                    ("weight_upload_" + preset + "_" + dtype + "_" +
                                     std::to_string(getpid()));
  GeneratorOptions g;
  g.seed = 11;
  EXPECT_TRUE(WriteRandomCheckpoint(*c, g, dir).ok());
  return dir;
}

// The device bytes of `n` elements at `ptr`.
std::vector<uint16_t> DeviceHalves(const void* ptr, size_t n) {
  std::vector<uint16_t> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), ptr, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

std::vector<uint16_t> HostHalves(DType dtype, const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  FromFloat(dtype, v.data(), v.size(), out.data());
  return out;
}

// Uploads layers [first, last) of the checkpoint and compares every tensor with the host path.
void ExpectUploadMatchesHost(const std::filesystem::path& dir, DType served, int first, int last,
                             const cuda::UploadOptions& options) {
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto host = LoadStageWeights(**ckpt, first, last);
  ASSERT_TRUE(host.ok()) << host.status();
  auto sources = FindStageWeights(**ckpt, first, last);
  ASSERT_TRUE(sources.ok()) << sources.status();
  const bool share = sources->has_head && sources->has_embedding &&
                     (*ckpt)->config().tie_word_embeddings;
  auto device = cuda::UploadStageWeights(*sources, served, share, options);
  ASSERT_TRUE(device.ok()) << device.status();
  int index = 0, compared = 0;
  StageWeightsOf<int> unused;
  ForEachTensor(*host, unused, [&](const std::vector<float>& want, int&) {
    ++index;
    // The pointer of the same field: walk the device struct in the same order.
    int j = 0;
    const void* ptr = nullptr;
    StageWeightsOf<int> unused2;
    ForEachTensor(device->tensors, unused2, [&](const void* p, int&) {
      if (++j == index) ptr = p;
    });
    if (want.empty()) {
      EXPECT_EQ(ptr, nullptr) << "tensor #" << index;
      return;
    }
    ASSERT_NE(ptr, nullptr) << "tensor #" << index;
    const std::vector<uint16_t> got = DeviceHalves(ptr, want.size());
    const std::vector<uint16_t> expect = HostHalves(served, want);
    size_t bad = 0;
    while (bad < got.size() && got[bad] == expect[bad]) ++bad;
    EXPECT_EQ(bad, got.size()) << "tensor #" << index << " of " << dir << ": element " << bad
                               << " is 0x" << std::hex << got[bad] << ", host gives 0x"
                               << expect[bad];
    ++compared;
  });
  EXPECT_GT(compared, 0);
}

class WeightUploadTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(WeightUploadTest, DeviceWeightsEqualHostConversionBitForBit) {
  SKIP_WITHOUT_GPU();
  const auto& [preset, stored] = GetParam();
  const std::filesystem::path dir = WriteCheckpoint(preset, stored);
  auto c = PresetConfig(preset);
  ASSERT_TRUE(c.ok());
  const int layers = c->num_layers;
  // 1000-byte chunks cut every matrix (also inside rows and across q/k/v parts); 3 threads of
  // 2 slots reuse each slot many times.
  const cuda::UploadOptions small{.threads = 3, .slots_per_thread = 2, .slot_bytes = 1000};
  for (DType served : {DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(std::string(DTypeName(served)));
    ExpectUploadMatchesHost(dir, served, 0, layers, small);
    ExpectUploadMatchesHost(dir, served, 1, layers, small);  // a later stage: head, no embedding
    ExpectUploadMatchesHost(dir, served, 0, layers, cuda::UploadOptions{});
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(StoredDtypes, WeightUploadTest,
                         ::testing::Combine(::testing::Values("tiny-llama", "tiny-gpt2",
                                                              "tiny-qwen2"),
                                            ::testing::Values("f32", "f16", "bf16")));

TEST(WeightUploadErrorsTest, Fp32ServedIsRefused) {
  SKIP_WITHOUT_GPU();
  StageSources empty;
  auto device = cuda::UploadStageWeights(empty, DType::kF32, false);
  EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(device.status().message(), ::testing::HasSubstr("F32"));
}

TEST(WeightUploadErrorsTest, TruncatedCheckpointFailsTheLoadNamingTheTensor) {
  SKIP_WITHOUT_GPU();
  const std::filesystem::path dir = WriteCheckpoint("tiny-llama", "f16");
  const std::filesystem::path file = dir / "model.safetensors";
  std::filesystem::resize_file(file, std::filesystem::file_size(file) - 64);
  StageSpec spec;
  spec.model_dir = dir;
  spec.max_slots = 2;
  auto stage = MakeCudaStage(spec, CudaOptions{});
  EXPECT_EQ(stage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stage.status().message(),
              ::testing::AllOf(::testing::HasSubstr("tensor '"),
                               ::testing::HasSubstr("truncated or corrupt")));
  std::filesystem::remove_all(dir);
}

// Values that round to even, overflow fp16, or become fp16 subnormals, in every stored dtype.
std::vector<float> SpecialValues() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 65519.0f, 65520.0f, 1e6f, -1e6f,
                          6.1e-5f, 5.96e-8f, 2.98e-8f, 2.99e-8f, 1e-10f, 3.14159265f,
                          1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, 1.0f + 1.0f / 256,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), 1e38f, 3.0e38f};
  for (int i = 0; i < 1000; ++i) v.push_back(std::ldexp(1.0f + i / 1000.0f, (i % 60) - 30));
  return v;
}

TEST(WeightConvertTest, KernelsMatchHostConversionBitForBit) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> values = SpecialValues();
  const size_t n = values.size();
  for (DType from : {DType::kF32, DType::kF16, DType::kBF16}) {
    // The stored bytes: `values` rounded to `from`.
    std::vector<std::byte> stored(n * DTypeSize(from));
    FromFloat(from, values.data(), n, stored.data());
    std::vector<float> stored_f(n);
    ToFloat(from, stored.data(), n, stored_f.data());
    for (DType to : {DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(std::string(DTypeName(from)) + " to " + std::string(DTypeName(to)));
      cuda::DeviceBuffer src, dst;
      ASSERT_TRUE(src.Allocate(stored.size()).ok());
      ASSERT_TRUE(dst.Allocate(n * 2).ok());
      ASSERT_EQ(cudaMemcpy(src.get(), stored.data(), stored.size(), cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_TRUE(cuda::LaunchConvert(from, to, src.get(), dst.get(), n, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<uint16_t> got = DeviceHalves(dst.get(), n);
      const std::vector<uint16_t> want = HostHalves(to, stored_f);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[i], want[i]) << "value " << values[i] << " (index " << i << ")";
      }
    }
  }
}

TEST(WeightConvertTest, TransposedRowsLandAsColumns) {
  SKIP_WITHOUT_GPU();
  // Stored (in = 5, out = 3) as fp32; rows [2, 4) converted into the (3, 5) fp16 matrix.
  const int64_t in = 5, out = 3;
  std::vector<float> stored(in * out);
  for (size_t i = 0; i < stored.size(); ++i) stored[i] = static_cast<float>(i) + 0.25f;
  cuda::DeviceBuffer src, dst;
  ASSERT_TRUE(src.Allocate(2 * out * 4).ok());
  ASSERT_TRUE(dst.Allocate(in * out * 2).ok());
  ASSERT_EQ(cudaMemset(dst.get(), 0, in * out * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(src.get(), stored.data() + 2 * out, 2 * out * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_TRUE(cuda::LaunchConvertTransposed(DType::kF32, DType::kF16, src.get(), dst.get(), 2, 2,
                                            in, out, nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> got = DeviceHalves(dst.get(), in * out);
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      const uint16_t want = (i == 2 || i == 3) ? FloatToHalf(stored[i * out + o]) : 0;
      EXPECT_EQ(got[o * in + i], want) << "out " << o << " in " << i;
    }
  }
}

}  // namespace
}  // namespace tandem
