// The text of a growing list of token ids (a generation, token by token), without decoding every
// id again for each new one: the decoder sees only the ids since the last place where the text
// ended in a whole character, plus the ids of the stretch before as context, and the new text is
// what the window decodes to beyond the context's own text (Hugging Face's DecodeStream does the
// same). The context absorbs what a decoder does only at the start of a text (SentencePiece's
// and Metaspace's leading space, Strip); bytes of a character that later ids complete stay in the
// window until they do. Should a window's text not begin with its context's text, the whole list
// is decoded instead, so the text is always that of decoding every id at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tandem {

class DecodeStream {
 public:
  using Decode = std::function<absl::StatusOr<std::string>(std::span<const int32_t>)>;
  explicit DecodeStream(Decode decode) : decode_(std::move(decode)) {}

  // The text of `ids`, which start with the ids of the previous call (a new list: Reset first).
  // Valid until the next call.
  absl::StatusOr<std::string_view> Text(std::span<const int32_t> ids);
  // Bytes at the start of the last call's text that no later id changes.
  size_t stable() const { return stable_; }
  // Full decodes so far (the first ids, and windows whose text did not begin with their context's).
  int full_decodes() const { return full_decodes_; }
  void Reset();

 private:
  Decode decode_;
  size_t context_ = 0;   // the window's first id: the context starts here
  size_t read_ = 0;      // the window's new ids start here
  std::string context_text_;  // the text of ids [context_, read_) decoded alone
  std::string text_;          // the last call's text; its first stable_ bytes: that of [0, read_)
  size_t stable_ = 0;
  int full_decodes_ = 0;
};

}  // namespace tandem
