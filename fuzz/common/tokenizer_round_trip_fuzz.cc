// Encode and Decode of a byte-level BPE (the generated checkpoints' tokenizer) on any text: valid
// UTF-8 comes back byte for byte, every id is inside the vocabulary, and any bytes at all encode
// without crashing.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/utf8.h"
#include "fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const tandem::Tokenizer& tokenizer = tandem::fuzz::GeneratedTokenizer();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  // The generated tokenizer's pattern (GPT-2's) never runs past its budget.
  const absl::StatusOr<std::vector<int32_t>> encoded =
      tokenizer.Encode(text, /*add_special_tokens=*/false);
  if (!encoded.ok()) std::abort();
  const std::vector<int32_t>& ids = *encoded;
  for (int32_t id : ids) {
    if (id < 0 || id >= tokenizer.vocab_size()) std::abort();
  }
  auto decoded = tokenizer.Decode(ids);
  if (!decoded.ok()) std::abort();
  if (tandem::IsValidUtf8(text) && *decoded != text) std::abort();
  return 0;
}
