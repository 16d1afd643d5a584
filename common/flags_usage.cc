// Command-line parsing and --help for tandem's programs (common/flags_usage.h).
#include "common/flags_usage.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tandem {
namespace {

// The default as a reader would type it: strings quoted, an empty list "none", an optional
// without one "unset".
std::string DefaultText(const absl::CommandLineFlag& flag) {
  const std::string value = flag.DefaultValue();
  if (flag.IsOfType<std::string>()) return absl::StrCat("\"", value, "\"");
  if (flag.IsOfType<std::vector<std::string>>() && value.empty()) return "none";
  if (value.empty()) return "unset";
  return value;
}

enum class HelpRequest { kNone, kTandem, kAll };

HelpRequest HelpAsked(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;  // what follows is positional
    if (arg == "--helpfull" || arg == "-helpfull") return HelpRequest::kAll;
    if (arg == "--help" || arg == "-help" || arg == "-h" || arg == "--helpshort" ||
        arg == "-helpshort") {
      return HelpRequest::kTandem;
    }
  }
  return HelpRequest::kNone;
}

}  // namespace

bool IsTandemFlagFile(absl::string_view file) { return !absl::StrContains(file, "absl/"); }

void SetProgramUsage(absl::string_view usage) {
  absl::FlagsUsageConfig config;
  config.contains_help_flags = IsTandemFlagFile;
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(usage);
}

std::string HelpText(bool all) {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (all || IsTandemFlagFile(flag->Filename())) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::string out = absl::StrCat(absl::ProgramUsageMessage(), "\n\nFlags:\n");
  for (const absl::CommandLineFlag* flag : flags) {
    absl::StrAppend(&out, "  --", flag->Name(), " (default: ", DefaultText(*flag), ")\n      ",
                    flag->Help(), "\n");
  }
  if (!all) absl::StrAppend(&out, "\n--helpfull also lists the libraries' flags.\n");
  return out;
}

std::vector<char*> ParseFlags(int argc, char** argv) {
  if (const HelpRequest help = HelpAsked(argc, argv); help != HelpRequest::kNone) {
    std::fputs(HelpText(help == HelpRequest::kAll).c_str(), stdout);
    std::exit(0);  // help that was asked for is an answer, not a failure
  }
  return absl::ParseCommandLine(argc, argv);
}

bool FlagGiven(absl::string_view name) {
  return absl::flags_internal::WasPresentOnCommandLine(name);
}

}  // namespace tandem
