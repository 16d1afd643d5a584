// JSON from outside the process (request bodies, tokenizer.json, tokenizer_config.json,
// config.json) parsed with a bound on how deeply it nests. nlohmann's parser itself does not
// recurse, but what comes after it does: copying a value, dump(), the Jinja values a chat template
// sees, the tokenizer's component builders. A value nested 30,000 deep overflows a thread's stack
// in those walks, so every parse of outside JSON goes through here and stops at kMaxJsonDepth.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem {

// The deepest nesting (arrays and objects inside each other) accepted from outside. Python's json
// module, and so vLLM, gives up near 1,000 levels (its recursion limit); real tool schemas, chat
// messages and model files nest fewer than 20. 128 leaves every recursive walk of ours (Jinja's
// value conversion and tojson, nlohmann's copy and dump, the tokenizer's builders) far inside the
// smallest thread stack it runs on, sanitizers included.
inline constexpr int kMaxJsonDepth = 128;

// OK when `text` nests at most `max_depth` levels. Otherwise INVALID_ARGUMENT naming the place
// where it goes deeper, as a path from the top ("tools[0].function.parameters"), and the limit.
// Does not recurse. Malformed JSON is left to the parser (OK here unless too deep before the
// error). `what` names the text for the message ("the request body", a file's path).
absl::Status CheckJsonDepth(std::string_view text, std::string_view what,
                            int max_depth = kMaxJsonDepth);

// The path (as CheckJsonDepth writes it) of the first value nested deeper than `max_depth`, or ""
// when none is; for callers that word the error themselves (the OpenAI API names the field).
std::string FirstTooDeepPath(std::string_view text, int max_depth = kMaxJsonDepth);

// json::parse after CheckJsonDepth; INVALID_ARGUMENT naming `what` ("<what>: not valid JSON: ...")
// when the text is not JSON.
absl::StatusOr<nlohmann::json> ParseBoundedJson(std::string_view text, std::string_view what,
                                                int max_depth = kMaxJsonDepth);
absl::StatusOr<nlohmann::ordered_json> ParseBoundedOrderedJson(std::string_view text,
                                                               std::string_view what,
                                                               int max_depth = kMaxJsonDepth);

}  // namespace tandem
