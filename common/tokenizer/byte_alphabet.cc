// GPT-2's byte-to-unicode table, built once.
#include "common/tokenizer/byte_alphabet.h"

#include "common/utf8.h"

namespace tandem::tokenizer {

const ByteAlphabet& GetByteAlphabet() {
  static const ByteAlphabet alphabet = [] {
    ByteAlphabet a;
    a.cp_to_byte.fill(-1);
    char32_t next_extra = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      a.byte_to_cp[b] = printable ? static_cast<char32_t>(b) : next_extra++;
      a.cp_to_byte[a.byte_to_cp[b]] = static_cast<int16_t>(b);
      AppendUtf8(a.byte_to_cp[b], a.byte_to_utf8[b]);
    }
    return a;
  }();
  return alphabet;
}

}  // namespace tandem::tokenizer
