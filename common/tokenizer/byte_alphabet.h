// GPT-2's byte-to-unicode alphabet, which byte-level BPE vocabularies are spelled in.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace tandem::tokenizer {

// bytes_to_unicode(): the printable bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for
// themselves; the other 68 bytes, in increasing order, become U+0100, U+0101, ... U+0143.
struct ByteAlphabet {
  std::array<char32_t, 256> byte_to_cp{};
  std::array<std::string, 256> byte_to_utf8{};  // byte_to_cp as UTF-8
  std::array<int16_t, 0x144> cp_to_byte{};      // -1 where the code point spells no byte
};

const ByteAlphabet& GetByteAlphabet();

}  // namespace tandem::tokenizer
