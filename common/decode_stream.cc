// DecodeStream: the window of ids since the last whole character, after its context.
#include "common/decode_stream.h"

#include "common/status_macros.h"
#include "common/utf8.h"

namespace tandem {
namespace {

// Whether `text` ends in a whole character: not inside one, and not in U+FFFD (what a decoder
// that replaces ill-formed bytes shows for those of a character a later id may complete).
bool EndsWhole(std::string_view text) {
  return CompleteUtf8Prefix(text) == text.size() && !text.ends_with("\xEF\xBF\xBD");
}

}  // namespace

absl::StatusOr<std::string_view> DecodeStream::Text(std::span<const int32_t> ids) {
  if (ids.size() < read_) Reset();
  if (read_ > 0) {
    ASSIGN_OR_RETURN(std::string window, decode_(ids.subspan(context_)));
    if (window.starts_with(context_text_)) {
      const std::string_view fresh = std::string_view(window).substr(context_text_.size());
      text_.resize(stable_);
      text_.append(fresh);
      if (ids.size() > read_ && EndsWhole(fresh)) {
        // The ids just read become the context of the next window, unless they decode to
        // nothing alone (a skipped special token, a stripped space): then the window keeps its
        // start, so that its context always has text of its own.
        ASSIGN_OR_RETURN(std::string next, decode_(ids.subspan(read_)));
        if (next.empty()) {
          context_text_ = std::move(window);
        } else {
          context_ = read_;
          context_text_ = std::move(next);
        }
        read_ = ids.size();
        stable_ = text_.size();
      }
      return text_;
    }
  }
  // The first ids, or a window whose text does not begin with its context's: all of them.
  ASSIGN_OR_RETURN(text_, decode_(ids));
  ++full_decodes_;
  context_ = read_ = stable_ = 0;
  context_text_.clear();
  if (!ids.empty() && EndsWhole(text_)) {
    read_ = ids.size();
    context_text_ = text_;
    stable_ = text_.size();
  }
  return text_;
}

void DecodeStream::Reset() {
  context_ = read_ = stable_ = 0;
  context_text_.clear();
  text_.clear();
}

}  // namespace tandem
