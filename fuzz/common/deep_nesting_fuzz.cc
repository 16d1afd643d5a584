// Deep structure in every parser of outside input: the input chooses a parser, a nesting unit and
// a depth (up to 131,070), and its rest is the core the nesting wraps. The JSON parsers (chat and
// completion bodies, tokenizer.json, config.json) and the chat-template parser and renderer must
// refuse what is too deep with INVALID_ARGUMENT, never overflow the stack (ASan reports that).
//
// Input: byte 0 picks the parser, byte 1 the unit, bytes 2-3 the depth (little endian, x2), the
// rest is the core.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "common/chat_template.h"
#include "common/model_config.h"
#include "common/tokenizer.h"
#include "coordinator/openai/request_parsing.h"
#include "fuzz/fuzz_support.h"

namespace {

struct Unit {
  std::string_view open, close;
};

// JSON nesting units; the core sits innermost.
constexpr Unit kJsonUnits[] = {
    {"[", "]"}, {"{\"k\":", "}"}, {"[1,", "]"}, {"{\"a\":1,\"k\":[", "]}"}};
// Jinja nesting units: parser recursion (parentheses, brackets, blocks, `not`, unary minus) and
// chains that deepen the tree without recursion (`+ 1`, filters, attributes).
constexpr Unit kTemplateUnits[] = {{"(", ")"},  {"[", "]"},          {"{'k': ", "}"}, {"not ", ""},
                                   {"-", ""},   {"", " + 1"},        {"", "|string"}, {"", ".a"},
                                   {"", "[0]"}, {"x if ", " else y"}};
constexpr Unit kBlockUnits[] = {{"{% if x %}", "{% endif %}"},
                                {"{% for i in x %}", "{% endfor %}"},
                                {"{% macro m() %}", "{% endmacro %}"}};

std::string Wrap(const Unit& unit, int depth, std::string_view core) {
  std::string out;
  out.reserve(depth * (unit.open.size() + unit.close.size()) + core.size());
  for (int i = 0; i < depth; ++i) out += unit.open;
  out += core;
  for (int i = 0; i < depth; ++i) out += unit.close;
  return out;
}

// A refusal is fine; any other outcome than OK or INVALID_ARGUMENT is a bug.
void CheckRefusal(const absl::Status& status) {
  if (!status.ok() && status.code() != absl::StatusCode::kInvalidArgument) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const int parser = data[0] % 6;
  const int unit = data[1];
  const int depth = 2 * (data[2] | (data[3] << 8));
  const std::string_view core(reinterpret_cast<const char*>(data) + 4, size - 4);
  const Unit& json_unit = kJsonUnits[unit % std::size(kJsonUnits)];
  switch (parser) {
    case 0: {  // a chat body, the nesting in a message's extra field, tools or the kwargs
      const std::string deep = Wrap(json_unit, depth, core.empty() ? "1" : core);
      const std::string message = R"({"role": "user", "content": "hi")";
      const std::string bodies[] = {
          R"({"messages": [)" + message + R"(, "extra": )" + deep + "}]}",
          R"({"messages": [)" + message + R"(}], "tools": )" + deep + "}",
          R"({"messages": [)" + message + R"(}], "chat_template_kwargs": {"x": )" + deep + "}}"};
      CheckRefusal(tandem::openai::ParseChatRequest(bodies[unit % 3]).status());
      break;
    }
    case 1: {  // a completion body: the prompt itself nested
      const std::string body = R"({"prompt": )" + Wrap(json_unit, depth, core) + "}";
      CheckRefusal(tandem::openai::ParseCompletionRequest(body).status());
      break;
    }
    case 2: {  // tokenizer.json with a normalizer Sequence nested `depth` deep
      const Unit sequence = {R"({"type": "Sequence", "normalizers": [)", "]}"};
      std::string json = tandem::fuzz::GeneratedTokenizerJson();
      json.insert(1, "\"normalizer\": " + Wrap(sequence, depth / 2, R"({"type": "NFC"})") + ", ");
      tandem::fuzz::MemoryFile file(json);
      auto tokenizer = tandem::Tokenizer::FromTokenizerJson(file.path());
      CheckRefusal(tokenizer.status());
      if (tokenizer.ok()) {
        auto ids = (*tokenizer)->Encode(core);
        CheckRefusal(ids.status());
      }
      break;
    }
    case 3: {  // config.json with a nested field
      std::string config =
          R"({"model_type": "llama", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16,
              "rms_norm_eps": 1e-6})";
      config.insert(
          1, "\"architectures\": " + Wrap(json_unit, depth, core.empty() ? "1" : core) + ", ");
      CheckRefusal(tandem::ParseModelConfig(config, "config.json").status());
      break;
    }
    case 4:
    case 5: {  // a chat template: an expression or blocks nested, rendered when it parses
      const std::string inner = core.empty() ? "x" : std::string(core);
      const std::string source =
          parser == 4
              ? "{{ " + Wrap(kTemplateUnits[unit % std::size(kTemplateUnits)], depth, inner) + " }}"
              : Wrap(kBlockUnits[unit % std::size(kBlockUnits)], depth, "{{ " + inner + " }}");
      absl::StatusOr<tandem::ChatTemplate> parsed = tandem::ChatTemplate::Parse(source);
      CheckRefusal(parsed.status());
      if (parsed.ok()) {
        const nlohmann::ordered_json context = {{"x", {1, 2}}, {"y", "y"}};
        CheckRefusal(parsed->Render(context).status());
      }
      break;
    }
  }
  return 0;
}
