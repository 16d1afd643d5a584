// ValidateRequest on any GenerateRequest (the input in protobuf's text format, or else its binary
// wire format), with the generated checkpoints' tokenizer: a request is refused with
// INVALID_ARGUMENT, or accepted with the promises ValidatedRequest makes (a prompt of 1 .. context
// tokens inside the vocabulary, 1 .. context new tokens, n and logprobs in range).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "coordinator/request_validation.h"
#include "fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::v1::GenerateRequest request;
  if (!tandem::fuzz::ParseTextOrBinary(std::string_view(reinterpret_cast<const char*>(data), size),
                                       request)) {
    return 0;
  }
  const tandem::Tokenizer& tokenizer = tandem::fuzz::GeneratedTokenizer();
  const tandem::ModelLimits limits{.vocab_size = tokenizer.vocab_size(),
                                   .context_length = 64,
                                   .eos_token_id = tokenizer.vocab_size() - 1,
                                   .eos_token_ids = {tokenizer.vocab_size() - 1}};
  auto validated = tandem::ValidateRequest(request, limits, &tokenizer);
  if (!validated.ok()) {
    if (validated.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    if (validated.status().message().empty()) std::abort();
    return 0;
  }
  const tandem::ValidatedRequest& v = *validated;
  const int prompt = static_cast<int>(v.prompt.size());
  if (prompt < 1 || prompt > limits.context_length) std::abort();
  for (int32_t id : v.prompt) {
    if (id < 0 || id >= limits.vocab_size) std::abort();
  }
  if (v.max_new_tokens < 1 || v.max_new_tokens > limits.context_length) std::abort();
  if (v.n < 1 || v.n > tandem::kMaxChoices) std::abort();
  if (v.logprobs > tandem::kMaxTopLogprobs || v.prompt_logprobs > tandem::kMaxTopLogprobs) {
    std::abort();
  }
  return 0;
}
