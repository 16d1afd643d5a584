// What every front end (gRPC, OpenAI HTTP) does with a generation after it passed validation:
// submit it, follow it until it ends (watching the client and the deadline, cancelling the request
// and so freeing its KV slot when either gives up), and turn its tokens into text a client may see
// while generation goes on (whole UTF-8 characters only, never a prefix of a stop string).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/decode_stream.h"
#include "common/tokenizer.h"
#include "coordinator/coordinator.h"

namespace tandem {

// How the front end's client is doing, asked every few milliseconds while a request waits.
using ClientGone = std::function<bool()>;
// Called whenever a request has new tokens or has ended; false: the client stopped reading.
using OnProgress = std::function<bool(const RequestState::Snapshot&)>;

// Follows a submitted request until it ends. Returns its final snapshot, or the error it ended
// with, or CANCELLED (the client went away or stopped reading) or DEADLINE_EXCEEDED (`deadline`,
// or the request's own timeout, passed); in those two cases the request is cancelled first.
absl::StatusOr<RequestState::Snapshot> FollowRequest(Coordinator& c,
                                                     const std::shared_ptr<RequestState>& r,
                                                     absl::Time deadline,
                                                     const ClientGone& client_gone,
                                                     const OnProgress& on_progress);

// Counts a request refused before it was submitted (invalid, queue full, no pipeline).
void RecordRejected(Coordinator& c, const absl::Status& why);
// Records a submitted request's outcome and duration.
void RecordEnd(Coordinator& c, const RequestState& r, const absl::Status& outcome);

// Bytes of `text` that can be shown while generation goes on: whole characters, minus a tail that
// could be the start of one of `stops` and a trailing U+FFFD (a character still incomplete).
size_t ShowablePrefix(std::string_view text, const std::vector<std::string>& stops);

// The generated tokens whose text a client sees: all of them, less the EOS id that ended the
// generation (`done` with finish reason EOS), whose text ("<|im_end|>", "</s>") is no part of the
// answer (vLLM's text leaves it out too; it stays in token ids, logprobs and usage). A constrained
// output always ends this way, and its text must be exactly what the grammar accepted.
std::span<const int32_t> TextTokens(std::span<const int32_t> tokens, bool done,
                                    v1::FinishReason finish);

// The text of one generation, handed out in pieces as its tokens arrive (decoding a few of them
// each time: DecodeStream).
class TextStream {
 public:
  // `tokenizer` may be null: no text at all.
  TextStream(const Tokenizer* tokenizer, std::vector<std::string> stops)
      : tokenizer_(tokenizer),
        stops_(std::move(stops)),
        text_([tokenizer](std::span<const int32_t> ids) { return tokenizer->Decode(ids); }) {}
  // The text of `tokens` (those of the call before and the new ones) not handed out before that
  // may be shown now; with `done`, all of it up to `text_limit` bytes (-1: no limit; a stop
  // string ended the generation there).
  std::string Next(std::span<const int32_t> tokens, bool done, int text_limit);
  // Everything handed out so far.
  const std::string& shown() const { return shown_; }

 private:
  const Tokenizer* tokenizer_;
  const std::vector<std::string> stops_;
  DecodeStream text_;
  size_t sent_ = 0;  // bytes of the decoded text handed out
  std::string shown_;
};

}  // namespace tandem
