// The requests a sweep sends: which prompt and how many tokens to generate for each request of a
// configuration. Three workloads, all drawn from the sweep's seed so that every machine sends the
// same requests:
//  - fixed: every prompt of the configuration's prompt length, every output of its output length;
//  - mixed: prompt and output lengths drawn from lognormals whose medians are the configuration's
//    lengths (a long tail into the thousands at sigma 1), clipped to the model's context;
//  - shared_prefix: one system prompt of `shared_prefix_len` tokens, the same for every request,
//    followed by a suffix of the configuration's prompt length of each request's own.
// Request i of a configuration sends entry i mod pool of its pool.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tandem::loadgen {

struct WorkloadSpec {
  std::string kind = "fixed";  // "fixed", "mixed" or "shared_prefix"
  double length_sigma = 1.0;   // mixed: sigma of the lognormals (of ln tokens)
  int shared_prefix_len = 0;   // shared_prefix: tokens of the system prompt
};

// One distinct request: its prompt (token ids) and the tokens it asks to generate.
struct WorkloadItem {
  std::vector<int32_t> prompt;
  int output_len = 0;
};

// Errors name the flag and the accepted values.
absl::Status ValidateWorkload(const WorkloadSpec& w);

// A prompt of `len` ids below `vocab`, the same on every machine for (seed, index).
std::vector<int32_t> MakePrompt(uint64_t seed, int index, int len, int vocab);

// `count` lengths from a lognormal of median `median` and `sigma`, clipped to [1, max_len], drawn
// from `seed` (the same on every machine: no standard-library distribution).
std::vector<int> LognormalLengths(uint64_t seed, int count, double median, double sigma,
                                  int max_len);

// The `pool` distinct requests of a configuration of `prompt_len` and `output_len` (the medians
// for mixed, the suffix for shared_prefix). `context`: the model's context (0: unknown, then
// mixed lengths are clipped to 32768 in all).
std::vector<WorkloadItem> MakeWorkloadPool(const WorkloadSpec& w, uint64_t seed, int prompt_len,
                                           int output_len, int pool, int vocab, int context);

// "fixed", or a short description for the report ("mixed lengths (lognormal, sigma 1)", ...).
std::string DescribeWorkload(const WorkloadSpec& w);

}  // namespace tandem::loadgen
