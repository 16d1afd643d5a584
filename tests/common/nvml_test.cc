// NVML at run time: a clean "not available" where the library is absent (every CI machine), and
// unit conversion and energy accounting through stand-in entry points.
#include "common/nvml.h"

#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

TEST(NvmlTest, AbsentLibraryIsUnavailableWithTheReason) {
  absl::StatusOr<std::unique_ptr<Nvml>> nvml = Nvml::Load("libnvidia-ml-absent.so.1");
  ASSERT_EQ(nvml.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(nvml.status().message()), HasSubstr("NVML not available"));
  EXPECT_THAT(std::string(nvml.status().message()), HasSubstr("libnvidia-ml-absent.so.1"));
}

TEST(NvmlTest, DefaultLoadIsCleanWithOrWithoutAGpu) {
  absl::StatusOr<std::unique_ptr<Nvml>> nvml = Nvml::Load();
  if (nvml.ok()) {
    absl::StatusOr<int> n = (*nvml)->DeviceCount();
    EXPECT_TRUE(n.ok()) << n.status();
  } else {
    EXPECT_EQ(nvml.status().code(), absl::StatusCode::kUnavailable) << nvml.status();
  }
}

TEST(NvmlTest, LibraryWithoutNvmlSymbolsNamesTheMissingOne) {
  absl::StatusOr<std::unique_ptr<Nvml>> nvml = Nvml::Load("libm.so.6");
  ASSERT_EQ(nvml.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(nvml.status().message()), HasSubstr("nvmlInit_v2"));
}

// A two-GPU stand-in: device i draws (100 + i) W and has used energy_mj[i] millijoules.
unsigned long long energy_mj[2] = {5000, 7000};
int fail_init = 0;
int FakeInit() { return fail_init; }
int FakeShutdown() { return 0; }
const char* FakeError(int) { return "fake error"; }
int FakeCount(unsigned int* n) {
  *n = 2;
  return 0;
}
int FakeByIndex(unsigned int i, NvmlFunctions::Device* d) {
  if (i >= 2) return 2;  // NVML_ERROR_INVALID_ARGUMENT
  *d = &energy_mj[i];
  return 0;
}
int Index(NvmlFunctions::Device d) { return static_cast<int>(static_cast<unsigned long long*>(d) - energy_mj); }
int FakeUuid(NvmlFunctions::Device d, char* buf, unsigned int n) {
  std::snprintf(buf, n, "GPU-fake-%d", Index(d));
  return 0;
}
int FakePower(NvmlFunctions::Device d, unsigned int* mw) {
  *mw = 1000 * (100 + Index(d));
  return 0;
}
int FakeEnergy(NvmlFunctions::Device d, unsigned long long* mj) {
  *mj = *static_cast<unsigned long long*>(d);
  return 0;
}
int FakeUtil(NvmlFunctions::Device, NvmlFunctions::Utilization* u) {
  u->gpu = 40;
  u->memory = 10;
  return 0;
}
int FakeMemory(NvmlFunctions::Device, NvmlFunctions::Memory* m) {
  m->total = 80ull << 30;
  m->used = 3ull << 30;
  m->free = m->total - m->used;
  return 0;
}

NvmlFunctions Fake() {
  NvmlFunctions f;
  f.init = FakeInit;
  f.shutdown = FakeShutdown;
  f.error_string = FakeError;
  f.device_count = FakeCount;
  f.device_by_index = FakeByIndex;
  f.device_uuid = FakeUuid;
  f.power_usage = FakePower;
  f.total_energy = FakeEnergy;
  f.utilization = FakeUtil;
  f.memory_info = FakeMemory;
  return f;
}

TEST(NvmlTest, ReadingsAreInBaseUnits) {
  absl::StatusOr<std::unique_ptr<Nvml>> nvml = Nvml::FromFunctions(Fake());
  ASSERT_TRUE(nvml.ok()) << nvml.status();
  ASSERT_EQ(*(*nvml)->DeviceCount(), 2);
  absl::StatusOr<GpuReading> r = (*nvml)->Read(1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->uuid, "GPU-fake-1");
  EXPECT_DOUBLE_EQ(r->power_watts, 101.0);
  EXPECT_DOUBLE_EQ(r->energy_joules, 7.0);
  EXPECT_DOUBLE_EQ(r->utilization_ratio, 0.4);
  EXPECT_EQ(r->memory_used_bytes, 3ull << 30);
  EXPECT_EQ(r->memory_total_bytes, 80ull << 30);
}

TEST(NvmlTest, IndexOfUuidFindsTheDeviceOrNamesTheMissingOne) {
  absl::StatusOr<std::unique_ptr<Nvml>> nvml = Nvml::FromFunctions(Fake());
  ASSERT_TRUE(nvml.ok());
  absl::StatusOr<int> i = (*nvml)->IndexOfUuid("GPU-fake-1");
  ASSERT_TRUE(i.ok()) << i.status();
  EXPECT_EQ(*i, 1);
  EXPECT_EQ(*(*nvml)->IndexOfUuid("GPU-fake-0"), 0);
  absl::StatusOr<int> none = (*nvml)->IndexOfUuid("GPU-fake-7");
  ASSERT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("GPU-fake-7"));
}

TEST(NvmlTest, BadDeviceIndexNamesTheGpu) {
  absl::StatusOr<std::unique_ptr<Nvml>> nvml = Nvml::FromFunctions(Fake());
  ASSERT_TRUE(nvml.ok());
  absl::StatusOr<GpuReading> r = (*nvml)->Read(5);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("GPU 5"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("fake error"));
}

TEST(NvmlTest, FailedInitIsUnavailable) {
  fail_init = 9;  // NVML_ERROR_DRIVER_NOT_LOADED
  absl::StatusOr<std::unique_ptr<Nvml>> nvml = Nvml::FromFunctions(Fake());
  fail_init = 0;
  EXPECT_EQ(nvml.status().code(), absl::StatusCode::kUnavailable);
}

TEST(NvmlTest, MissingEntryPointIsInvalidArgument) {
  NvmlFunctions f = Fake();
  f.total_energy = nullptr;
  EXPECT_EQ(Nvml::FromFunctions(f).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GpuSamplerTest, EnergyCounterGrowsByTheEnergyUsedSinceTheFirstReading) {
  prometheus::Registry registry;
  GpuMetrics metrics(registry);
  energy_mj[0] = 5000;
  energy_mj[1] = 7000;
  {
    GpuSampler sampler(*Nvml::FromFunctions(Fake()), {0, 1}, metrics, absl::ZeroDuration());
    sampler.SampleOnce();  // baseline
    energy_mj[0] += 1500;  // 1.5 J
    energy_mj[1] += 250;   // 0.25 J
    sampler.SampleOnce();
    energy_mj[0] += 500;
    sampler.SampleOnce();
  }
  absl::StatusOr<std::vector<MetricSample>> s =
      ParseMetricsText(prometheus::TextSerializer().Serialize(registry.Collect()));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(SumSamples(*s, "tandem_gpu_energy_joules_total", {{"gpu", "0"}}), 2.0);
  EXPECT_DOUBLE_EQ(SumSamples(*s, "tandem_gpu_energy_joules_total", {{"uuid", "GPU-fake-1"}}),
                   0.25);
  EXPECT_DOUBLE_EQ(SumSamples(*s, "tandem_gpu_power_watts", {{"gpu", "1"}}), 101);
  EXPECT_DOUBLE_EQ(SumSamples(*s, "tandem_gpu_memory_used_bytes", {{"gpu", "0"}}),
                   static_cast<double>(3ull << 30));
}

TEST(VisibleGpuIndicesTest, FollowsCudaVisibleDevices) {
  EXPECT_EQ(VisibleGpuIndices(nullptr, 3), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(VisibleGpuIndices("", 2), (std::vector<int>{0, 1}));
  EXPECT_EQ(VisibleGpuIndices("1", 4), (std::vector<int>{1}));
  EXPECT_EQ(VisibleGpuIndices("2,0", 4), (std::vector<int>{2, 0}));
  EXPECT_EQ(VisibleGpuIndices("5", 2), (std::vector<int>{}));
  EXPECT_EQ(VisibleGpuIndices("GPU-abc", 2), (std::vector<int>{0, 1}));
}

}  // namespace
}  // namespace tandem
