// NVML through dlopen: the few entry points tandem reads, resolved by name at run time.
#include "common/nvml.h"

#include <dlfcn.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/thread_name.h"

namespace tandem {
namespace {

constexpr unsigned int kUuidBytes = 96;  // NVML_DEVICE_UUID_V2_BUFFER_SIZE

template <typename F>
bool Resolve(void* handle, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  if (*out == nullptr && missing->empty()) *missing = name;
  return *out != nullptr;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Nvml>> Nvml::Load(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::UnavailableError(absl::StrCat("NVML not available: cannot load ", library, ": ",
                                               why != nullptr ? why : "unknown error"));
  }
  NvmlFunctions f;
  std::string missing;
  Resolve(handle, "nvmlInit_v2", &f.init, &missing);
  Resolve(handle, "nvmlShutdown", &f.shutdown, &missing);
  Resolve(handle, "nvmlErrorString", &f.error_string, &missing);
  Resolve(handle, "nvmlDeviceGetCount_v2", &f.device_count, &missing);
  Resolve(handle, "nvmlDeviceGetHandleByIndex_v2", &f.device_by_index, &missing);
  Resolve(handle, "nvmlDeviceGetUUID", &f.device_uuid, &missing);
  Resolve(handle, "nvmlDeviceGetPowerUsage", &f.power_usage, &missing);
  Resolve(handle, "nvmlDeviceGetTotalEnergyConsumption", &f.total_energy, &missing);
  Resolve(handle, "nvmlDeviceGetUtilizationRates", &f.utilization, &missing);
  Resolve(handle, "nvmlDeviceGetMemoryInfo", &f.memory_info, &missing);
  if (!missing.empty()) {
    dlclose(handle);
    return absl::FailedPreconditionError(
        absl::StrCat("NVML not usable: ", library, " has no symbol ", missing));
  }
  const int rc = f.init();
  if (rc != 0) {
    const std::string why = f.error_string(rc);
    dlclose(handle);
    return absl::UnavailableError(absl::StrCat("NVML not available: nvmlInit: ", why));
  }
  return std::unique_ptr<Nvml>(new Nvml(f, handle));
}

absl::StatusOr<std::unique_ptr<Nvml>> Nvml::FromFunctions(const NvmlFunctions& f) {
  if (!f.init || !f.shutdown || !f.device_count || !f.device_by_index || !f.device_uuid ||
      !f.power_usage || !f.total_energy || !f.utilization || !f.memory_info) {
    return absl::InvalidArgumentError("NVML functions: an entry point is missing");
  }
  if (const int rc = f.init(); rc != 0) {
    return absl::UnavailableError(absl::StrCat("NVML not available: nvmlInit returned ", rc));
  }
  return std::unique_ptr<Nvml>(new Nvml(f, nullptr));
}

Nvml::~Nvml() {
  fns_.shutdown();
  if (handle_ != nullptr) dlclose(handle_);
}

absl::Status Nvml::Check(int rc, const char* what, int index) const {
  if (rc == 0) return absl::OkStatus();
  const std::string why = fns_.error_string != nullptr ? fns_.error_string(rc) : absl::StrCat(rc);
  return absl::InternalError(absl::StrCat("NVML ", what, " (GPU ", index, "): ", why));
}

absl::StatusOr<int> Nvml::DeviceCount() {
  unsigned int n = 0;
  if (absl::Status s = Check(fns_.device_count(&n), "nvmlDeviceGetCount", -1); !s.ok()) return s;
  return static_cast<int>(n);
}

absl::StatusOr<int> Nvml::IndexOfUuid(const std::string& uuid) {
  absl::StatusOr<int> count = DeviceCount();
  if (!count.ok()) return count.status();
  for (int i = 0; i < *count; ++i) {
    NvmlFunctions::Device dev = nullptr;
    char found[kUuidBytes] = {};
    if (fns_.device_by_index(i, &dev) == 0 && fns_.device_uuid(dev, found, kUuidBytes) == 0 &&
        uuid == found) {
      return i;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("no GPU with UUID ", uuid, " among the ", *count, " NVML reports"));
}

absl::StatusOr<GpuReading> Nvml::Read(int index) {
  NvmlFunctions::Device dev = nullptr;
  if (absl::Status s = Check(fns_.device_by_index(index, &dev), "nvmlDeviceGetHandleByIndex",
                             index);
      !s.ok()) {
    return s;
  }
  GpuReading r;
  r.index = index;
  char uuid[kUuidBytes] = {};
  if (absl::Status s = Check(fns_.device_uuid(dev, uuid, kUuidBytes), "nvmlDeviceGetUUID", index);
      !s.ok()) {
    return s;
  }
  r.uuid = uuid;
  unsigned int milliwatts = 0;
  if (absl::Status s = Check(fns_.power_usage(dev, &milliwatts), "nvmlDeviceGetPowerUsage", index);
      !s.ok()) {
    return s;
  }
  r.power_watts = milliwatts / 1000.0;
  unsigned long long millijoules = 0;
  if (absl::Status s = Check(fns_.total_energy(dev, &millijoules),
                             "nvmlDeviceGetTotalEnergyConsumption", index);
      !s.ok()) {
    return s;
  }
  r.energy_joules = static_cast<double>(millijoules) / 1000.0;
  NvmlFunctions::Utilization util = {};
  if (absl::Status s = Check(fns_.utilization(dev, &util), "nvmlDeviceGetUtilizationRates", index);
      !s.ok()) {
    return s;
  }
  r.utilization_ratio = util.gpu / 100.0;
  NvmlFunctions::Memory mem = {};
  if (absl::Status s = Check(fns_.memory_info(dev, &mem), "nvmlDeviceGetMemoryInfo", index);
      !s.ok()) {
    return s;
  }
  r.memory_used_bytes = mem.used;
  r.memory_total_bytes = mem.total;
  return r;
}

std::vector<int> VisibleGpuIndices(const char* cuda_visible_devices, int device_count) {
  std::vector<int> out;
  if (cuda_visible_devices != nullptr && *cuda_visible_devices != '\0') {
    bool all_numeric = true;
    for (absl::string_view part : absl::StrSplit(cuda_visible_devices, ',', absl::SkipEmpty())) {
      int i = -1;
      if (!absl::SimpleAtoi(part, &i) || i < 0) {
        all_numeric = false;
        break;
      }
      if (i < device_count) out.push_back(i);
    }
    if (all_numeric) return out;
    out.clear();  // UUIDs or MIG names: report every device
  }
  for (int i = 0; i < device_count; ++i) out.push_back(i);
  return out;
}

GpuSampler::GpuSampler(std::unique_ptr<Nvml> nvml, std::vector<int> devices, GpuMetrics& metrics,
                       absl::Duration period)
    : nvml_(std::move(nvml)),
      devices_(std::move(devices)),
      metrics_(metrics),
      period_(period),
      last_energy_(devices_.size(), -1.0) {
  if (period_ <= absl::ZeroDuration()) return;
  thread_ = std::thread([this] {
    SetThreadName("gpu-sampler");
    while (!stop_.load()) {
      SampleOnce();
      const absl::Time until = absl::Now() + period_;
      while (!stop_.load() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
    }
  });
}

GpuSampler::~GpuSampler() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

void GpuSampler::SampleOnce() {
  for (size_t k = 0; k < devices_.size(); ++k) {
    absl::StatusOr<GpuReading> r = nvml_->Read(devices_[k]);
    if (!r.ok()) continue;  // a transient NVML error skips one sample
    GpuMetrics::Reading m;
    m.index = r->index;
    m.uuid = r->uuid;
    m.power_watts = r->power_watts;
    // The first reading only sets the baseline; a driver counter that went back restarts it.
    if (last_energy_[k] >= 0 && r->energy_joules >= last_energy_[k]) {
      m.energy_joules_delta = r->energy_joules - last_energy_[k];
    }
    last_energy_[k] = r->energy_joules;
    m.utilization_ratio = r->utilization_ratio;
    m.memory_used_bytes = static_cast<double>(r->memory_used_bytes);
    m.memory_total_bytes = static_cast<double>(r->memory_total_bytes);
    metrics_.Record(m);
  }
}

}  // namespace tandem
