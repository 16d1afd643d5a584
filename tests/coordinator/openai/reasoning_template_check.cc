// For tests/coordinator/openai/reasoning_template_test.sh: renders each case's chat request
// through the coordinator's chat renderer (MakeChatRenderer) with the model folder's real
// template, requires the prompt Jinja2 rendered, then the prompt's thought state and the split of
// the case's output by --reasoning_parser qwen3, streamed byte by byte as well as whole.
// usage: reasoning_template_check <folder with tokenizer_config.json> <cases.json>
#include <fstream>
#include <iostream>
#include <sstream>

#include "common/model_config.h"
#include "common/text_config.h"
#include "coordinator/openai/chat_prompt.h"
#include "coordinator/openai/reasoning_parser.h"
#include "coordinator/openai/request_parsing.h"

namespace {

using tandem::openai::PromptThought;

const char* ThoughtName(PromptThought t) {
  return t == PromptThought::kOpen     ? "open"
         : t == PromptThought::kClosed ? "closed"
                                       : "may_open";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tandem::openai;
  if (argc != 3) {
    std::cerr << "usage: reasoning_template_check <model folder> <cases.json>\n";
    return 2;
  }
  absl::StatusOr<tandem::TextConfig> text =
      tandem::LoadTextConfig(argv[1], tandem::ModelConfig{}, nullptr);
  if (!text.ok()) {
    std::cerr << text.status() << "\n";
    return 2;
  }
  absl::Status load;
  const ChatRenderer render = MakeChatRenderer(*text, &load);
  if (!load.ok()) {
    std::cerr << load << "\n";
    return 2;
  }
  std::ifstream in(argv[2]);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const nlohmann::json input = nlohmann::json::parse(buffer.str());
  int failures = 0;
  int index = 0;
  for (const nlohmann::json& c : input["cases"]) {
    const std::string where = "case " + std::to_string(index++) + " " + c["body"].dump();
    absl::StatusOr<ApiRequest> request = ParseChatRequest(c["body"].dump());
    absl::StatusOr<std::string> prompt =
        request.ok() ? render(*request) : absl::StatusOr<std::string>(request.status());
    if (!prompt.ok() || *prompt != c["jinja2"].get<std::string>()) {
      std::cerr << where << ": prompt differs from Jinja2's\n  ours: "
                << (prompt.ok() ? nlohmann::json(*prompt).dump() : prompt.status().ToString())
                << "\n  jinja2: " << c["jinja2"].dump() << "\n";
      ++failures;
      continue;
    }
    const PromptThought thought = PromptThoughtOf(*prompt);
    if (ThoughtName(thought) != c["thought"].get<std::string>()) {
      std::cerr << where << ": prompt thought " << ThoughtName(thought) << ", want "
                << c["thought"] << "\n";
      ++failures;
    }
    const std::string output = c["output"];
    const ReasoningSplit whole = SplitReasoning(ReasoningParser::kQwen3, thought, output);
    ReasoningSplitter splitter(ReasoningParser::kQwen3, thought);
    ReasoningSplit streamed;
    for (size_t i = 0; i <= output.size(); ++i) {
      const ReasoningSplit part =
          splitter.Next(output.substr(i, i < output.size() ? 1 : 0), i == output.size());
      streamed.reasoning += part.reasoning;
      streamed.content += part.content;
    }
    for (const ReasoningSplit& got : {whole, streamed}) {
      if (got.reasoning != c["reasoning"].get<std::string>() ||
          got.content != c["content"].get<std::string>()) {
        std::cerr << where << ": split reasoning " << nlohmann::json(got.reasoning) << " content "
                  << nlohmann::json(got.content) << ", want " << c["reasoning"] << " "
                  << c["content"] << "\n";
        ++failures;
      }
    }
  }
  std::cout << index << " cases, " << failures << " failures\n";
  return failures == 0 && index > 0 ? 0 : 1;
}
