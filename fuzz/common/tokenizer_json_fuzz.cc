// Tokenizer::FromTokenizerJson on any tokenizer.json: loading refuses with an error or gives a
// tokenizer that encodes and decodes text without crashing, and whose ids are inside its
// vocabulary.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/tokenizer.h"
#include "fuzz/fuzz_support.h"

namespace {

constexpr std::string_view kTexts[] = {"Hello world",
                                       " leading space and  double",
                                       "caf\xc3\xa9 na\xc3\xafve \xe2\x82\xac 123",
                                       "<|endoftext|>x<s></s>",
                                       "\xf0\x9f\x98\x80\n\t line",
                                       ""};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::MemoryFile file(std::string_view(reinterpret_cast<const char*>(data), size));
  auto tokenizer = tandem::Tokenizer::FromTokenizerJson(file.path());
  if (!tokenizer.ok()) return 0;
  const int vocab = (*tokenizer)->vocab_size();
  for (std::string_view text : kTexts) {
    for (bool special : {false, true}) {
      // A tokenizer's regex may refuse a text (past its budget): an error, not a crash.
      const absl::StatusOr<std::vector<int32_t>> encoded = (*tokenizer)->Encode(text, special);
      if (!encoded.ok()) continue;
      const std::vector<int32_t>& ids = *encoded;
      for (int32_t id : ids) {
        if (id < 0 || id >= vocab) std::abort();
        (void)(*tokenizer)->IdToToken(id);
      }
      (void)(*tokenizer)->Decode(ids, /*skip_special_tokens=*/special);
    }
  }
  return 0;
}
