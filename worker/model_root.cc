// Resolving a requested checkpoint folder against the worker's model root.
#include "worker/model_root.h"

#include <system_error>

#include "absl/strings/str_cat.h"

namespace tandem {
namespace {

// Whether canonical path `path` is `root` or lies below it (compared by components, so that
// "/models-old" is not under "/models").
bool Within(const std::filesystem::path& root, const std::filesystem::path& path) {
  auto r = root.begin(), p = path.begin();
  for (; r != root.end(); ++r, ++p) {
    if (r->empty()) continue;  // the trailing "" of "/models/"
    if (p == path.end() || *p != *r) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::filesystem::path> ResolveModelDir(const std::filesystem::path& root,
                                                      const std::string& model_dir) {
  if (root.empty()) return std::filesystem::path(model_dir);
  const absl::Status refused = absl::NotFoundError(absl::StrCat(
      "model_dir '", model_dir, "': no checkpoint folder of that name under this worker's "
      "--model_root"));
  if (model_dir.empty()) return refused;
  std::error_code ec;
  const std::filesystem::path canonical_root = std::filesystem::canonical(root, ec);
  if (ec) return refused;
  const std::filesystem::path resolved = std::filesystem::canonical(model_dir, ec);
  if (ec || !Within(canonical_root, resolved)) return refused;
  if (!std::filesystem::is_directory(resolved, ec) || ec) return refused;
  return resolved;
}

}  // namespace tandem
