// GPU readings through NVML, loaded at run time with dlopen("libnvidia-ml.so.1"): no link-time
// dependency, so the same binaries run on CPU-only hosts, where Load() answers UNAVAILABLE and no
// GPU metrics are exported. GpuSampler is the thread that copies readings into GpuMetrics.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/metrics.h"

namespace tandem {

// The NVML entry points tandem uses, with NVML's C signatures. Devices are opaque handles;
// every function returns an nvmlReturn_t (0: success).
struct NvmlFunctions {
  struct Utilization {
    unsigned int gpu;     // percent of time a kernel ran over the last sample period
    unsigned int memory;  // percent of time memory was read or written
  };
  struct Memory {
    unsigned long long total;  // bytes
    unsigned long long free;
    unsigned long long used;
  };
  using Device = void*;
  int (*init)() = nullptr;  // nvmlInit_v2
  int (*shutdown)() = nullptr;
  const char* (*error_string)(int) = nullptr;
  int (*device_count)(unsigned int*) = nullptr;                      // nvmlDeviceGetCount_v2
  int (*device_by_index)(unsigned int, Device*) = nullptr;           // ..._HandleByIndex_v2
  int (*device_uuid)(Device, char*, unsigned int) = nullptr;         // nvmlDeviceGetUUID
  int (*power_usage)(Device, unsigned int*) = nullptr;               // milliwatts
  int (*total_energy)(Device, unsigned long long*) = nullptr;        // millijoules since load
  int (*utilization)(Device, Utilization*) = nullptr;                // nvmlDeviceGetUtilizationRates
  int (*memory_info)(Device, Memory*) = nullptr;                     // nvmlDeviceGetMemoryInfo
};

// One device's reading in base units.
struct GpuReading {
  int index = 0;
  std::string uuid;
  double power_watts = 0;
  double energy_joules = 0;  // since the driver loaded (a counter)
  double utilization_ratio = 0;
  uint64_t memory_used_bytes = 0;
  uint64_t memory_total_bytes = 0;
};

class Nvml {
 public:
  // Opens `library` and initializes NVML. UNAVAILABLE (with the loader's reason) where the
  // library or a GPU driver is absent; FAILED_PRECONDITION when a needed symbol is missing.
  static absl::StatusOr<std::unique_ptr<Nvml>> Load(const std::string& library = "libnvidia-ml.so.1");
  // Uses the given entry points (a test's stand-ins); calls fns.init.
  static absl::StatusOr<std::unique_ptr<Nvml>> FromFunctions(const NvmlFunctions& fns);
  ~Nvml();  // nvmlShutdown, dlclose

  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  absl::StatusOr<int> DeviceCount();
  absl::StatusOr<GpuReading> Read(int index);
  // The index of the device whose UUID is `uuid` ("GPU-..."); NOT_FOUND naming it otherwise.
  absl::StatusOr<int> IndexOfUuid(const std::string& uuid);

 private:
  Nvml(const NvmlFunctions& fns, void* handle) : fns_(fns), handle_(handle) {}
  absl::Status Check(int rc, const char* what, int index) const;
  NvmlFunctions fns_;
  void* handle_;  // dlopen handle; null with FromFunctions
};

// The devices a worker reports: the indices in CUDA_VISIBLE_DEVICES when it names indices,
// otherwise every device.
std::vector<int> VisibleGpuIndices(const char* cuda_visible_devices, int device_count);

// Reads `devices` every `period` on a thread named "gpu-sampler" and records them in `metrics`;
// the energy counter grows by the energy used since the previous reading. A zero period starts
// no thread (the caller calls SampleOnce).
class GpuSampler {
 public:
  GpuSampler(std::unique_ptr<Nvml> nvml, std::vector<int> devices, GpuMetrics& metrics,
             absl::Duration period);
  ~GpuSampler();  // stops and joins

  // One round of readings (also what the thread runs); public so tests need no thread timing.
  void SampleOnce();

 private:
  std::unique_ptr<Nvml> nvml_;
  const std::vector<int> devices_;
  GpuMetrics& metrics_;
  const absl::Duration period_;
  std::vector<double> last_energy_;  // joules, per entry of devices_; < 0 before the first read
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tandem
