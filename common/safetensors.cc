// Safetensors reading (mmap + header validation), sharded checkpoint folders, and writing.
//
// File layout: [u64 little-endian N][N bytes of JSON header][data section]. The header maps each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end)} with offsets relative to the
// start of the data section, plus an optional "__metadata__" object of strings.
#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bounded_json.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace tandem {
namespace {

using json = nlohmann::json;

// The safetensors format caps the header at 100 MB; anything larger is a corrupt length field.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Types that the safetensors format defines but tandem does not compute in.
bool IsKnownUnsupportedDType(std::string_view name) {
  constexpr std::array<std::string_view, 15> kKnown = {
      "BOOL", "U8",  "I8",      "U16",     "I16",     "U32",     "I32",     "U64",
      "I64",  "F64", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"};
  return std::find(kKnown.begin(), kKnown.end(), name) != kKnown.end();
}

// A JSON integer >= 0 that fits int64, or nullopt (negative, fractional, huge, not a number).
std::optional<int64_t> NonNegativeInt(const json& v) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i < 0) return std::nullopt;
    return i;
  }
  return std::nullopt;
}

// product(shape) * elem_size, or nullopt on overflow.
std::optional<uint64_t> ByteSize(const std::vector<int64_t>& shape, size_t elem_size) {
  uint64_t n = elem_size;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return std::nullopt;
  }
  return n;
}

absl::StatusOr<std::string> ReadTextFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path.string()));
  return ss.str();
}

// Parses one tensor entry of the header into `view` (data span left empty) and its offsets.
absl::Status ParseTensorEntry(const std::string& file, const std::string& name, const json& entry,
                              TensorView* view, uint64_t* begin, uint64_t* end) {
  const std::string where = absl::StrCat(file, ": tensor '", name, "'");
  if (!entry.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": header entry is not an object"));
  }
  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": missing or non-string \"dtype\""));
  }
  const std::string dtype_name = dtype_it->get<std::string>();
  if (dtype_name == "F32") {
    view->dtype = DType::kF32;
  } else if (dtype_name == "F16") {
    view->dtype = DType::kF16;
  } else if (dtype_name == "BF16") {
    view->dtype = DType::kBF16;
  } else if (dtype_name == "F8_E4M3") {
    view->dtype = DType::kF8E4M3;
  } else if (IsKnownUnsupportedDType(dtype_name)) {
    return absl::UnimplementedError(
        absl::StrCat(where, ": dtype ", dtype_name, " is not supported (F32, F16, BF16, F8_E4M3 are)"));
  } else {
    return absl::InvalidArgumentError(absl::StrCat(where, ": unknown dtype \"", dtype_name, "\""));
  }

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": missing or non-array \"shape\""));
  }
  view->shape.clear();
  for (size_t i = 0; i < shape_it->size(); ++i) {
    std::optional<int64_t> d = NonNegativeInt((*shape_it)[i]);
    if (!d) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": shape[", i, "] = ", (*shape_it)[i].dump(), " is not a non-negative integer"));
    }
    view->shape.push_back(*d);
  }

  auto off_it = entry.find("data_offsets");
  if (off_it == entry.end() || !off_it->is_array() || off_it->size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"data_offsets\" must be an array [begin, end]"));
  }
  std::optional<int64_t> b = NonNegativeInt((*off_it)[0]);
  std::optional<int64_t> e = NonNegativeInt((*off_it)[1]);
  if (!b || !e) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": data_offsets ", off_it->dump(), " are not non-negative integers"));
  }
  if (*e < *b) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": data_offsets ", off_it->dump(), " end before they begin"));
  }
  *begin = static_cast<uint64_t>(*b);
  *end = static_cast<uint64_t>(*e);

  std::optional<uint64_t> want = ByteSize(view->shape, DTypeSize(view->dtype));
  if (!want || *want != *end - *begin) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": data_offsets ", off_it->dump(), " span ", *end - *begin,
                     " bytes but ", dtype_name, " ", ShapeString(view->shape), " needs ",
                     want ? absl::StrCat(*want) : std::string("more than 2^64")));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, map_size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::filesystem::path& path) {
  const std::string file = path.string();
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    std::string msg = absl::StrCat("cannot open ", file, ": ", std::strerror(err));
    if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(msg);
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
    return absl::InternalError(msg);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat("cannot stat ", file, ": ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(file, " is not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": ", size, " bytes is too short for a safetensors file (8-byte header length)"));
  }

  // The object owns the mapping from here on, so every early return below unmaps it.
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("cannot mmap ", file, ": ", std::strerror(map_err)));
  }
  f->map_ = map;
  f->map_size_ = size;
  const auto* bytes = static_cast<const std::byte*>(map);

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | std::to_integer<uint64_t>(bytes[i]);
  if (header_len > size - 8) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": header length ", header_len,
                                                   " runs past the end of the file (", size,
                                                   " bytes); truncated or corrupt"));
  }
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": header length ", header_len, " exceeds the ", kMaxHeaderBytes, "-byte limit"));
  }
  const char* header_begin = reinterpret_cast<const char*>(bytes + 8);
  if (absl::Status depth = CheckJsonDepth(std::string_view(header_begin, header_len),
                                          absl::StrCat(file, ": header"));
      !depth.ok()) {
    return depth;
  }
  json header;
  try {
    header = json::parse(header_begin, header_begin + header_len);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": header is JSON ", header.type_name(), ", expected an object"));
  }

  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = size - data_start;
  // [begin, end) of each tensor, to find overlaps after all are read.
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    if (name == kMetadataKey) {
      if (!it->is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": \"__metadata__\" is not an object"));
      }
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(file, ": \"__metadata__\" value of key '",
                                                         m.key(), "' is not a string"));
        }
        f->metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    TensorView view;
    view.name = name;
    uint64_t begin = 0, end = 0;
    RETURN_IF_ERROR(ParseTensorEntry(file, name, *it, &view, &begin, &end));
    if (end > data_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          file, ": tensor '", name, "': data_offsets [", begin, ", ", end,
          "] run past the data section (", data_size, " bytes); truncated or corrupt"));
    }
    view.data = std::span<const std::byte>(bytes + data_start + begin, end - begin);
    ranges.emplace_back(begin, end, name);
    f->tensors_.emplace(name, std::move(view));
  }

  // Sorted by begin, a tensor overlaps an earlier one exactly when it starts before the furthest
  // end seen so far. Empty tensors occupy no bytes and cannot overlap anything.
  std::sort(ranges.begin(), ranges.end());
  const std::tuple<uint64_t, uint64_t, std::string>* furthest = nullptr;
  for (const auto& r : ranges) {
    const auto& [b, e, name] = r;
    if (b == e) continue;
    if (furthest != nullptr && b < std::get<1>(*furthest)) {
      const auto& [pb, pe, pname] = *furthest;
      return absl::InvalidArgumentError(absl::StrCat(file, ": tensors '", pname, "' [", pb, ", ",
                                                     pe, ") and '", name, "' [", b, ", ", e,
                                                     ") overlap"));
    }
    if (furthest == nullptr || e > std::get<1>(*furthest)) furthest = &r;
  }
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, view] : tensors_) out.push_back(name);
  return out;
}

absl::StatusOr<TensorView> SafetensorsFile::tensor(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(path_.string(), ": no tensor '", name, "'"));
  }
  return it->second;
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

namespace {

// For a folder that holds PyTorch's pickled weights instead: what it has and how to convert it.
std::string PytorchWeightsHint(const std::filesystem::path& dir) {
  std::error_code ec;
  for (const char* name : {"pytorch_model.bin", "pytorch_model.bin.index.json"}) {
    if (std::filesystem::exists(dir / name, ec)) {
      return absl::StrCat(
          "; it has ", name, " (PyTorch's pickle format), which tandem does not read: convert "
          "the folder to safetensors first, e.g. with transformers: "
          "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, "
          "safe_serialization=True)");
    }
  }
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::filesystem::path& dir) {
  auto ckpt = std::make_unique<Checkpoint>();
  ckpt->dir_ = dir;
  ASSIGN_OR_RETURN(ckpt->config_, LoadModelConfig(dir));

  std::error_code ec;
  const std::filesystem::path index_path = dir / kIndexFile;
  const std::filesystem::path single_path = dir / kSingleFile;
  if (std::filesystem::exists(index_path, ec)) {
    const std::string index = index_path.string();
    ASSIGN_OR_RETURN(std::string text, ReadTextFile(index_path));
    if (absl::Status depth = CheckJsonDepth(text, index); !depth.ok()) return depth;
    json doc;
    try {
      doc = json::parse(text);
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(index, ": not valid JSON: ", e.what()));
    }
    if (!doc.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index, ": expected a JSON object"));
    }
    auto wm = doc.find("weight_map");
    if (wm == doc.end() || !wm->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index, ": missing or non-object \"weight_map\""));
    }
    std::set<std::string> shards;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it->is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index, ": weight_map entry of tensor '", it.key(), "' is not a string"));
      }
      std::string shard = it->get<std::string>();
      // Shards are plain file names inside the folder; a path could point anywhere.
      if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
        return absl::InvalidArgumentError(absl::StrCat(index, ": tensor '", it.key(), "' maps to '",
                                                       shard, "', which is not a file name in ",
                                                       dir.string()));
      }
      shards.insert(shard);
      ckpt->shard_of_[it.key()] = std::move(shard);
    }
    // Checking existence up front turns a broken folder into an error at load time, without
    // mapping shards that this process may never read.
    for (const std::string& shard : shards) {
      if (!std::filesystem::is_regular_file(dir / shard, ec)) {
        return absl::NotFoundError(absl::StrCat(index, " names shard ", shard, ", but ",
                                                (dir / shard).string(), " does not exist"));
      }
    }
    return ckpt;
  }
  if (std::filesystem::exists(single_path, ec)) {
    ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(single_path));
    for (const std::string& name : file->names()) ckpt->shard_of_[name] = kSingleFile;
    ckpt->open_[kSingleFile] = std::move(file);
    return ckpt;
  }
  return absl::NotFoundError(absl::StrCat(dir.string(), ": neither ", kSingleFile, " nor ",
                                          kIndexFile, " exists", PytorchWeightsHint(dir)));
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(shard_of_.size());
  for (const auto& [name, file] : shard_of_) out.push_back(name);
  return out;
}

absl::StatusOr<TensorView> Checkpoint::tensor(const std::string& name) {
  auto it = shard_of_.find(name);
  if (it == shard_of_.end()) {
    return absl::NotFoundError(
        absl::StrCat("tensor '", name, "' not found in checkpoint ", dir_.string()));
  }
  auto open = open_.find(it->second);
  if (open == open_.end()) {
    ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                     SafetensorsFile::Open(dir_ / it->second));
    open = open_.emplace(it->second, std::move(file)).first;
  }
  if (!open->second->contains(name)) {
    return absl::NotFoundError(absl::StrCat(kIndexFile, " in ", dir_.string(), " puts tensor '",
                                            name, "' in ", open->second->path().string(),
                                            ", which does not hold it"));
  }
  return open->second->tensor(name);
}

absl::StatusOr<std::vector<float>> Checkpoint::ReadFloat(const std::string& name,
                                                         const std::vector<int64_t>& shape) {
  ASSIGN_OR_RETURN(TensorView view, tensor(name));
  if (view.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", dir_.string(),
                                                   ": expected shape ", ShapeString(shape),
                                                   ", found ", ShapeString(view.shape)));
  }
  std::vector<float> out(static_cast<size_t>(view.numel()));
  if (!out.empty()) ToFloat(view.dtype, view.data.data(), out.size(), out.data());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Writing

absl::Status WriteSafetensors(const std::filesystem::path& path,
                              const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();
  json header = json::object();
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    const std::string where = absl::StrCat(file, ": tensor '", t.name, "'");
    if (t.name.empty() || t.name == kMetadataKey) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": reserved or empty name"));
    }
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": written twice"));
    }
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": negative dimension in shape ", ShapeString(t.shape)));
      }
    }
    std::optional<uint64_t> want = ByteSize(t.shape, DTypeSize(t.dtype));
    if (!want || *want != t.bytes.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", t.bytes.size(), " bytes given but ",
                       std::string(DTypeName(t.dtype)), " ", ShapeString(t.shape), " needs ",
                       want ? absl::StrCat(*want) : std::string("more than 2^64")));
    }
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  if (!metadata.empty()) {
    json meta = json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header[kMetadataKey] = std::move(meta);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": cannot encode header (names and metadata must be UTF-8): ", e.what()));
  }
  // Padding keeps the data section 8-byte aligned in the file, as the format recommends.
  text.append((8 - text.size() % 8) % 8, ' ');

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", file, ": ", std::strerror(errno)));
  }
  char len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out.write(len, 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const TensorToWrite& t : tensors) {
    out.write(reinterpret_cast<const char*>(t.bytes.data()),
              static_cast<std::streamsize>(t.bytes.size()));
  }
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("error writing ", file));
  return absl::OkStatus();
}

}  // namespace tandem
