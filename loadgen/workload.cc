#include "loadgen/workload.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace tandem::loadgen {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64: the same numbers on every machine
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1), never 0 (its log is taken).
double Uniform(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; }

// The index of the shared system prompt, apart from every pool index.
constexpr int kSharedPrefixIndex = 1 << 30;
// The context assumed for mixed lengths when the server does not tell it.
constexpr int kUnknownContext = 32768;

}  // namespace

absl::Status ValidateWorkload(const WorkloadSpec& w) {
  if (w.kind != "fixed" && w.kind != "mixed" && w.kind != "shared_prefix") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--workload: \"%s\" is not fixed, mixed or shared_prefix", w.kind));
  }
  if (w.kind == "mixed" && !(w.length_sigma >= 0 && w.length_sigma <= 4)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--length_sigma: %g is not in [0, 4]", w.length_sigma));
  }
  if (w.kind == "shared_prefix" && w.shared_prefix_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--shared_prefix_len: %d; --workload shared_prefix needs a system prompt "
                        "of at least 1 token",
                        w.shared_prefix_len));
  }
  return absl::OkStatus();
}

std::vector<int32_t> MakePrompt(uint64_t seed, int index, int len, int vocab) {
  std::vector<int32_t> ids(len);
  for (int t = 0; t < len; ++t) {
    ids[t] = static_cast<int32_t>(Mix(seed * 1000003 + index * 7919ull + t) % vocab);
  }
  return ids;
}

std::vector<int> LognormalLengths(uint64_t seed, int count, double median, double sigma,
                                  int max_len) {
  std::vector<int> lengths(count);
  for (int i = 0; i < count; ++i) {
    // Box-Muller from two uniforms of this draw.
    const double u1 = Uniform(Mix(seed * 0x100000001B3ull + 2ull * i));
    const double u2 = Uniform(Mix(seed * 0x100000001B3ull + 2ull * i + 1));
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
    const double len = std::round(median * std::exp(sigma * z));
    lengths[i] = static_cast<int>(std::clamp(len, 1.0, static_cast<double>(max_len)));
  }
  return lengths;
}

std::vector<WorkloadItem> MakeWorkloadPool(const WorkloadSpec& w, uint64_t seed, int prompt_len,
                                           int output_len, int pool, int vocab, int context) {
  std::vector<WorkloadItem> items(pool);
  if (w.kind == "mixed") {
    const int ctx = context > 1 ? context : kUnknownContext;
    const std::vector<int> prompts =
        LognormalLengths(Mix(seed ^ 0x70726f6d7074ull), pool, prompt_len, w.length_sigma, ctx - 1);
    const std::vector<int> outputs =
        LognormalLengths(Mix(seed ^ 0x6f7574707574ull), pool, output_len, w.length_sigma, ctx - 1);
    for (int i = 0; i < pool; ++i) {
      items[i].prompt = MakePrompt(seed, i, prompts[i], vocab);
      items[i].output_len = std::min(outputs[i], ctx - prompts[i]);
    }
  } else if (w.kind == "shared_prefix") {
    const std::vector<int32_t> system =
        MakePrompt(seed, kSharedPrefixIndex, w.shared_prefix_len, vocab);
    for (int i = 0; i < pool; ++i) {
      items[i].prompt = system;
      const std::vector<int32_t> suffix = MakePrompt(seed, i, prompt_len, vocab);
      items[i].prompt.insert(items[i].prompt.end(), suffix.begin(), suffix.end());
      items[i].output_len = output_len;
    }
  } else {
    for (int i = 0; i < pool; ++i) {
      items[i].prompt = MakePrompt(seed, i, prompt_len, vocab);
      items[i].output_len = output_len;
    }
  }
  return items;
}

std::string DescribeWorkload(const WorkloadSpec& w) {
  if (w.kind == "mixed") {
    return absl::StrFormat(
        "mixed lengths (lognormal, sigma %g, medians = prompt/output lengths, clipped to the "
        "context)",
        w.length_sigma);
  }
  if (w.kind == "shared_prefix") {
    return absl::StrFormat(
        "shared prefix (a %d-token system prompt, then a suffix of the prompt length)",
        w.shared_prefix_len);
  }
  return "fixed";
}

}  // namespace tandem::loadgen
