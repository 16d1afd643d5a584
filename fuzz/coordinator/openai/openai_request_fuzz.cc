// The OpenAI-compatible API's request bodies on any bytes, as /v1/completions, as
// /v1/chat/completions and as /v1/responses: a body is refused with INVALID_ARGUMENT, or each of its prompts (token ids,
// or text through the generated checkpoints' tokenizer) becomes a GenerateRequest that
// ValidateRequest accepts or refuses with INVALID_ARGUMENT.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "coordinator/openai/request_parsing.h"
#include "coordinator/openai/responses_api.h"
#include "coordinator/request_validation.h"
#include "fuzz/fuzz_support.h"

namespace {

void CheckRefusal(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument || status.message().empty()) {
    std::abort();
  }
}

void Validate(const tandem::openai::ApiRequest& request) {
  const tandem::Tokenizer& tokenizer = tandem::fuzz::GeneratedTokenizer();
  const tandem::ModelLimits limits{.vocab_size = tokenizer.vocab_size(),
                                   .context_length = 64,
                                   .eos_token_id = tokenizer.vocab_size() - 1,
                                   .eos_token_ids = {tokenizer.vocab_size() - 1}};
  for (const tandem::openai::PromptInput& prompt : request.prompts) {
    absl::StatusOr<std::vector<int32_t>> ids = prompt.token_ids;
    if (!prompt.is_tokens) ids = tokenizer.Encode(prompt.text);
    if (!ids.ok()) {
      CheckRefusal(ids.status());
      continue;
    }
    auto validated =
        tandem::ValidateRequest(tandem::openai::PromptRequest(request, *ids), limits, &tokenizer);
    if (!validated.ok()) CheckRefusal(validated.status());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view body(reinterpret_cast<const char*>(data), size);
  for (auto parse : {tandem::openai::ParseCompletionRequest, tandem::openai::ParseChatRequest}) {
    auto request = parse(body);
    if (request.ok()) {
      Validate(*request);
    } else {
      CheckRefusal(request.status());
    }
  }
  if (auto tokenize = tandem::openai::ParseTokenizeRequest(body); !tokenize.ok()) {
    CheckRefusal(tokenize.status());
  }
  const std::string_view text(body.data(), body.size());
  if (auto responses = tandem::openai::ParseResponsesRequest(text); !responses.ok()) {
    CheckRefusal(responses.status());
  }
  return 0;
}
