// Renders chat templates for tests/common/chat_template_test.sh: reads {"templates": {id: source},
// "cases": [{"template": id, "context": {...}}]} and writes one result per case, in order:
// {"ok": true, "text": ...} or {"ok": false, "error": ...}. strftime_now sees 26 Jul 2024 12:00,
// the date the reference renderer fixes too.
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "common/chat_template.h"
#include "nlohmann/json.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: chat_template_compare <cases.json> <results.json>\n";
    return 2;
  }
  std::ifstream in(argv[1]);
  std::stringstream buffer;
  buffer << in.rdbuf();
  nlohmann::ordered_json input;
  try {
    input = nlohmann::ordered_json::parse(buffer.str());
  } catch (const std::exception& e) {
    std::cerr << argv[1] << ": " << e.what() << "\n";
    return 2;
  }
  std::map<std::string, absl::StatusOr<tandem::ChatTemplate>> templates;
  for (const auto& [id, source] : input["templates"].items()) {
    absl::StatusOr<tandem::ChatTemplate> parsed =
        tandem::ChatTemplate::Parse(source.get<std::string>());
    if (parsed.ok()) {
      parsed->SetClock([] {
        std::tm t{};
        t.tm_year = 2024 - 1900;
        t.tm_mon = 6;
        t.tm_mday = 26;
        t.tm_hour = 12;
        t.tm_wday = 5;
        t.tm_yday = 207;
        return t;
      });
    }
    templates.emplace(id, std::move(parsed));
  }
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (const auto& c : input["cases"]) {
    const auto& parsed = templates.at(c["template"].get<std::string>());
    absl::StatusOr<std::string> text =
        parsed.ok() ? parsed->Render(c["context"]) : absl::StatusOr<std::string>(parsed.status());
    if (text.ok()) {
      results.push_back({{"ok", true}, {"text", *text}});
    } else {
      results.push_back({{"ok", false}, {"error", std::string(text.status().message())}});
    }
  }
  std::ofstream(argv[2]) << results.dump(-1, ' ', false,
                                         nlohmann::ordered_json::error_handler_t::replace);
  return 0;
}
