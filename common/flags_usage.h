// Command-line parsing and --help for every tandem program. Abseil's --help lists only the flags
// defined in a file named after the program (main.cc is not), exits 1, and prints "default: ;"
// for a flag whose default is unset; here --help lists the flags of tandem's own sources with
// their defaults and exits 0, and --helpfull adds the libraries' (Abseil's --flagfile and others).
#pragma once

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/string_view.h"
#include "common/settings.h"

namespace tandem {

// Whether a flag defined in source file `file` is one of tandem's, not a library's.
bool IsTandemFlagFile(absl::string_view file);

// The program's one-line usage. Call before ParseFlags.
void SetProgramUsage(absl::string_view usage);

// The whole --help text: the usage, then each flag (tandem's, or with `all` every one) with its
// help and its default ("unset" for an optional flag without one), sorted by name.
std::string HelpText(bool all);

// Parses the command line as absl::ParseCommandLine does and returns the positional arguments
// (argv[0] first). --help, -h and --helpshort print HelpText(false), --helpfull HelpText(true),
// to stdout, and exit 0; a bad flag or value exits 1 with Abseil's message naming it.
std::vector<char*> ParseFlags(int argc, char** argv);

// Whether flag `name` was given on the command line (or in a --flagfile), even with its default
// value: settings given there override those of a config file.
bool FlagGiven(absl::string_view name);

}  // namespace tandem

#define TANDEM_SETTING_ABSL_FLAG_(type, name, default_value, least, help) \
  ABSL_FLAG(::tandem::SettingFlagType<type>, name,                        \
            ::tandem::SettingFlag<type>::To(type{default_value}), help);
#define TANDEM_SETTING_FROM_FLAG_(type, name, default_value, least, help)         \
  if (::tandem::FlagGiven(#name)) {                                               \
    config.name = ::tandem::SettingFlag<type>::From(absl::GetFlag(FLAGS_##name)); \
  }

// At global scope of a program's main.cc: a flag for each setting of LIST, with the setting's
// default and help, and `void apply(Config& config)`, which copies into `config` the settings
// given on the command line (even at their default value: they override a config file).
#define TANDEM_DEFINE_SETTING_FLAGS(LIST, Config, apply) \
  LIST(TANDEM_SETTING_ABSL_FLAG_)                        \
  [[maybe_unused]] static void apply(Config& config) { LIST(TANDEM_SETTING_FROM_FLAG_) }
