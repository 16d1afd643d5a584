// --help for every tandem program. Abseil's --help lists only the flags defined in a file named
// after the program (main.cc is not), so it printed "No flags matched"; here it lists the flags
// of tandem's own sources, and --helpfull adds the libraries' (Abseil's --flagfile and others).
#pragma once

#include "absl/strings/string_view.h"

namespace tandem {

// Whether a flag defined in source file `file` is one of tandem's, not a library's.
bool IsTandemFlagFile(absl::string_view file);

// The program's one-line usage, and --help / --helpshort listing tandem's flags. Call before
// absl::ParseCommandLine.
void SetProgramUsage(absl::string_view usage);

}  // namespace tandem
