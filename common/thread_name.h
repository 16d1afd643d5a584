// Names the calling thread, so that debuggers, top -H, perf and /proc/<pid>/task show what each
// thread of a process is for (every program lists its threads where it starts them).
#pragma once

#include <string_view>

namespace tandem {

// Linux keeps the first 15 bytes of `name`.
void SetThreadName(std::string_view name);

}  // namespace tandem
