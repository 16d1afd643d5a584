// The depth check is a SAX pass over the text (nlohmann's parser keeps its own stack, so nothing
// here recurses); it stops at the first container past the limit, before any value is built.
#include "common/bounded_json.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tandem {
namespace {

using nlohmann::json;

// Components of a path that an error prints: enough to name the field, short for hostile keys.
constexpr size_t kPathComponents = 6;
constexpr size_t kKeyChars = 64;

// Follows the containers open at the current point of the text and the key or index of each.
class DepthScan : public nlohmann::json_sax<json> {
 public:
  explicit DepthScan(int max_depth) : max_depth_(max_depth) {}

  // The path of the container that went past the limit, or "" when none did.
  const std::string& too_deep_path() const { return too_deep_path_; }

  bool null() override { return Value(); }
  bool boolean(bool) override { return Value(); }
  bool number_integer(number_integer_t) override { return Value(); }
  bool number_unsigned(number_unsigned_t) override { return Value(); }
  bool number_float(number_float_t, const string_t&) override { return Value(); }
  bool string(string_t&) override { return Value(); }
  bool binary(binary_t&) override { return Value(); }
  bool start_object(std::size_t) override { return Open(/*is_array=*/false); }
  bool key(string_t& key) override {
    open_.back().key = key.size() > kKeyChars ? key.substr(0, kKeyChars) + "..." : key;
    return true;
  }
  bool end_object() override { return Close(); }
  bool start_array(std::size_t) override { return Open(/*is_array=*/true); }
  bool end_array() override { return Close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  struct Container {
    bool is_array;
    size_t index;     // arrays: the index of the element being read
    std::string key;  // objects: the key of the value being read
  };

  // A value starts: inside an array it takes the next index.
  bool Value() {
    if (!open_.empty() && open_.back().is_array) ++open_.back().index;
    return true;
  }
  bool Open(bool is_array) {
    Value();
    if (static_cast<int>(open_.size()) >= max_depth_) {
      too_deep_path_ = Path();
      return false;
    }
    // An array's first element takes index 0 after Value() increments it.
    open_.push_back({is_array, static_cast<size_t>(-1), ""});
    return true;
  }
  bool Close() {
    open_.pop_back();
    return true;
  }
  std::string Path() const {
    std::string path;
    for (size_t i = 0; i < open_.size() && i < kPathComponents; ++i) {
      if (open_[i].is_array) {
        absl::StrAppend(&path, "[", open_[i].index, "]");
      } else {
        absl::StrAppend(&path, path.empty() ? "" : ".", open_[i].key);
      }
    }
    if (open_.size() > kPathComponents) path += "...";
    return path.empty() ? "the top level" : path;
  }

  const int max_depth_;
  std::vector<Container> open_;
  std::string too_deep_path_;
};

template <typename Json>
absl::StatusOr<Json> Parse(std::string_view text, std::string_view what, int max_depth) {
  if (absl::Status depth = CheckJsonDepth(text, what, max_depth); !depth.ok()) return depth;
  try {
    return Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), ": not valid JSON: ", e.what()));
  }
}

}  // namespace

std::string FirstTooDeepPath(std::string_view text, int max_depth) {
  DepthScan scan(max_depth);
  json::sax_parse(text, &scan, json::input_format_t::json, /*strict=*/true);
  return scan.too_deep_path();
}

absl::Status CheckJsonDepth(std::string_view text, std::string_view what, int max_depth) {
  const std::string path = FirstTooDeepPath(text, max_depth);
  if (path.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(what), ": ", path, " nests deeper than ", max_depth,
                   " levels of arrays and objects, the most tandem accepts"));
}

absl::StatusOr<nlohmann::json> ParseBoundedJson(std::string_view text, std::string_view what,
                                                int max_depth) {
  return Parse<nlohmann::json>(text, what, max_depth);
}

absl::StatusOr<nlohmann::ordered_json> ParseBoundedOrderedJson(std::string_view text,
                                                               std::string_view what,
                                                               int max_depth) {
  return Parse<nlohmann::ordered_json>(text, what, max_depth);
}

}  // namespace tandem
