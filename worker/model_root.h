// Where a worker may load checkpoints from: only folders under its --model_root, so that a
// caller cannot make it read (or probe for) any other path it could read.
#pragma once

#include <filesystem>
#include <string>

#include "absl/status/statusor.h"

namespace tandem {

// `model_dir` with symlinks and ".." resolved, when it is an existing folder inside `root` (the
// root itself included). An empty `root` allows any path and returns `model_dir` as given.
// Anything else, a missing folder inside the root as much as any path outside it, gets the same
// NOT_FOUND message, which names only `model_dir` as given: the answer does not tell whether a
// path outside the root exists.
absl::StatusOr<std::filesystem::path> ResolveModelDir(const std::filesystem::path& root,
                                                      const std::string& model_dir);

}  // namespace tandem
