// vLLM's --reasoning_parser: a reasoning model writes its thought between <think> and </think>
// before the answer; the thought goes to a chat choice's `reasoning_content` (streamed:
// `delta.reasoning_content`), the rest to `content`.
//
// The rule, the same whole or streamed (however the text is cut into pieces):
//   1. Where the output starts depends on the prompt (PromptThoughtOf): inside a thought when the
//      prompt opened one (DeepSeek-R1's template, Qwen3's thinking-only models: "<think>\n" at
//      its end) and always with deepseek_r1 (vLLM assumes R1 starts thinking); outside, for
//      content only, when the prompt holds this turn's thought already closed (Qwen3's template
//      with chat_template_kwargs {"enable_thinking": false} writes an empty one); otherwise the
//      output may open one itself.
//   2. An output that may open a thought does so when it begins with "<think>" (the tag is
//      dropped); else it is all content.
//   3. Inside a thought, everything up to the first "</think>" is reasoning (a thought cut short
//      by max_tokens stays reasoning, as in vLLM's streaming); the tag is dropped and what follows
//      is content, tags included.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::openai {

enum class ReasoningParser {
  kNone,        // no split: everything is content
  kQwen3,       // "qwen3": Qwen3 and QwQ
  kDeepSeekR1,  // "deepseek_r1": starts inside a thought even without "<think>"
};

// "" (none), "qwen3" or "deepseek_r1"; INVALID_ARGUMENT naming --reasoning_parser otherwise.
absl::StatusOr<ReasoningParser> ParseReasoningParserName(std::string_view name);

// Where a prompt leaves the thought of the turn it asks for (rule 1).
enum class PromptThought {
  kMayOpen,  // no thought of this turn yet: the output may open one
  kOpen,     // the prompt ends inside a thought: the output starts as reasoning
  kClosed,   // the prompt ends after this turn's (empty) thought: the output is content
};
PromptThought PromptThoughtOf(std::string_view prompt);

struct ReasoningSplit {
  std::string reasoning;
  std::string content;
};

// Splits one choice's text as it arrives. Bytes that may begin a tag are held back until the
// next piece tells (at most 8), so a stream cut anywhere splits as the whole text does.
class ReasoningSplitter {
 public:
  ReasoningSplitter(ReasoningParser parser, PromptThought prompt);
  // The next piece of text; `last`: nothing follows, so held bytes go out.
  ReasoningSplit Next(std::string_view piece, bool last);

 private:
  enum class State { kStart, kThought, kContent };
  State state_;
  bool start_in_thought_ = false;  // kStart: the output is reasoning whether or not "<think>"
  std::string held_;
};

// The whole text at once: ReasoningSplitter's one piece.
ReasoningSplit SplitReasoning(ReasoningParser parser, PromptThought prompt, std::string_view text);

// A streamed chat chunk's delta for one piece: reasoning_content and content where each has
// text; {"content": ""} when neither has (a token whose bytes are held back).
nlohmann::json ReasoningDelta(const ReasoningSplit& split);

}  // namespace tandem::openai
