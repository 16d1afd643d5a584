// The <think> split of reasoning_parser.h: a three-state scan that holds back a possible tag.
#include "coordinator/openai/reasoning_parser.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tandem::openai {
namespace {

constexpr std::string_view kOpenTag = "<think>";
constexpr std::string_view kCloseTag = "</think>";

// The length of the longest proper prefix of `tag` that `text` ends with.
size_t PartialTagSuffix(std::string_view text, std::string_view tag) {
  for (size_t k = std::min(text.size(), tag.size() - 1); k > 0; --k) {
    if (text.ends_with(tag.substr(0, k))) return k;
  }
  return 0;
}

}  // namespace

absl::StatusOr<ReasoningParser> ParseReasoningParserName(std::string_view name) {
  if (name.empty()) return ReasoningParser::kNone;
  if (name == "qwen3") return ReasoningParser::kQwen3;
  if (name == "deepseek_r1") return ReasoningParser::kDeepSeekR1;
  return absl::InvalidArgumentError(
      absl::StrCat("--reasoning_parser '", std::string(name),
                   "' is not known; give qwen3 (Qwen3, QwQ), deepseek_r1, or nothing for none"));
}

PromptThought PromptThoughtOf(std::string_view prompt) {
  const size_t open = prompt.rfind(kOpenTag);
  const size_t close = prompt.rfind(kCloseTag);
  if (open != std::string_view::npos && (close == std::string_view::npos || open > close)) {
    return PromptThought::kOpen;
  }
  if (close != std::string_view::npos &&
      prompt.find_first_not_of(" \t\r\n", close + kCloseTag.size()) == std::string_view::npos) {
    return PromptThought::kClosed;
  }
  return PromptThought::kMayOpen;
}

ReasoningSplitter::ReasoningSplitter(ReasoningParser parser, PromptThought prompt) {
  if (parser == ReasoningParser::kNone || prompt == PromptThought::kClosed) {
    state_ = State::kContent;
  } else {
    state_ = State::kStart;
    start_in_thought_ = parser == ReasoningParser::kDeepSeekR1 || prompt == PromptThought::kOpen;
  }
}

ReasoningSplit ReasoningSplitter::Next(std::string_view piece, bool last) {
  ReasoningSplit out;
  held_.append(piece);
  if (state_ == State::kStart) {
    if (held_.starts_with(kOpenTag)) {
      held_.erase(0, kOpenTag.size());
      state_ = State::kThought;
    } else if (!last && kOpenTag.starts_with(held_)) {
      return out;  // may still become the tag
    } else {
      state_ = start_in_thought_ ? State::kThought : State::kContent;
    }
  }
  if (state_ == State::kThought) {
    const size_t end = held_.find(kCloseTag);
    if (end != std::string::npos) {
      out.reasoning = held_.substr(0, end);
      out.content = held_.substr(end + kCloseTag.size());
      held_.clear();
      state_ = State::kContent;
      return out;
    }
    const size_t keep = last ? 0 : PartialTagSuffix(held_, kCloseTag);
    out.reasoning = held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return out;
  }
  out.content = std::move(held_);
  held_.clear();
  return out;
}

ReasoningSplit SplitReasoning(ReasoningParser parser, PromptThought prompt, std::string_view text) {
  return ReasoningSplitter(parser, prompt).Next(text, /*last=*/true);
}

nlohmann::json ReasoningDelta(const ReasoningSplit& split) {
  nlohmann::json delta = nlohmann::json::object();
  if (!split.reasoning.empty()) delta["reasoning_content"] = split.reasoning;
  if (!split.content.empty() || split.reasoning.empty()) delta["content"] = split.content;
  return delta;
}

}  // namespace tandem::openai
