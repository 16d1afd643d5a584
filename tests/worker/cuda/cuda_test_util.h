// What the CUDA tests share: skipping without a GPU, their folder for checkpoints (the build
// folder, or TANDEM_TEST_TMPDIR where the binary runs elsewhere: the GPU machine), random
// checkpoints written once, and the relative error of logits.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "gtest/gtest.h"
#include "tools/model_generator.h"
#include "worker/cuda/cuda_stage.h"

#define SKIP_WITHOUT_GPU()                                                               \
  do {                                                                                   \
    if (!::tandem::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device available"; \
  } while (0)

namespace tandem::cuda_test {

inline std::filesystem::path TmpDir() {
  const char* env = std::getenv("TANDEM_TEST_TMPDIR");
  return env != nullptr ? std::filesystem::path(env) : std::filesystem::path(TANDEM_TEST_TMPDIR);
}

// A random checkpoint of preset `preset` at TmpDir()/`name`, written once: aside, then renamed
// into place, as tests running at once (ctest -j) may ask for the same one and a reader must never
// see one half written.
inline std::filesystem::path PresetCheckpoint(const std::string& name, const std::string& preset,
                                              uint64_t seed) {
  const std::filesystem::path dir = TmpDir() / name;
  if (!std::filesystem::exists(dir / "config.json")) {
    auto c = PresetConfig(preset);
    EXPECT_TRUE(c.ok()) << c.status();
    GeneratorOptions o;
    o.seed = seed;
    const std::filesystem::path tmp = TmpDir() / (name + ".tmp" + std::to_string(getpid()));
    std::filesystem::remove_all(tmp);
    EXPECT_TRUE(WriteRandomCheckpoint(*c, o, tmp).ok());
    std::error_code ec;
    std::filesystem::rename(tmp, dir, ec);  // fails where another test got there first
    if (ec) std::filesystem::remove_all(tmp);
  }
  return dir;
}

// ||got - want|| / ||want||.
inline double RelError(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace tandem::cuda_test
