// Streaming safetensors writer; see safetensors_writer.h.
#include "tools/safetensors_writer.h"

#include <cerrno>
#include <cstring>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace tandem {

int64_t SafetensorsEntry::nbytes() const {
  int64_t n = static_cast<int64_t>(DTypeSize(dtype));
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::unique_ptr<SafetensorsStreamWriter>> SafetensorsStreamWriter::Create(
    const std::filesystem::path& path, const std::vector<SafetensorsEntry>& entries,
    const std::map<std::string, std::string>& metadata) {
  // ordered_json keeps "__metadata__" first and tensors in data order, as a reader expects to
  // find them when it looks at the file.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = meta;
  }
  int64_t offset = 0;
  for (const SafetensorsEntry& e : entries) {
    if (e.name.empty() || e.name == "__metadata__" || header.contains(e.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path.string(), ": bad or duplicate tensor name '", e.name, "'"));
    }
    for (int64_t d : e.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(path.string(), ": tensor ", e.name, " has a negative dimension"));
      }
    }
    const int64_t n = e.nbytes();
    header[e.name] = {{"dtype", std::string(DTypeName(e.dtype))},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  auto w = std::unique_ptr<SafetensorsStreamWriter>(new SafetensorsStreamWriter());
  w->path_ = path;
  w->tmp_path_ = path;
  w->tmp_path_ += ".partial";
  w->data_total_ = offset;
  w->file_ = std::fopen(w->tmp_path_.c_str(), "wb");
  if (w->file_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot create ", w->tmp_path_.string(), ": ", std::strerror(errno)));
  }
  uint8_t len[8];
  const uint64_t header_len = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(header_len >> (8 * i));
  if (std::fwrite(len, 1, 8, w->file_) != 8 ||
      std::fwrite(text.data(), 1, text.size(), w->file_) != text.size()) {
    return absl::UnavailableError(
        absl::StrCat("cannot write ", w->tmp_path_.string(), ": ", std::strerror(errno)));
  }
  return w;
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() {
  if (file_ != nullptr) {
    std::fclose(file_);
    std::error_code ec;
    std::filesystem::remove(tmp_path_, ec);
  }
}

absl::Status SafetensorsStreamWriter::Append(std::span<const std::byte> bytes) {
  if (file_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(path_.string(), ": already finished"));
  }
  if (data_written_ + static_cast<int64_t>(bytes.size()) > data_total_) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_.string(), ": more tensor data than the header announces (", data_total_, " bytes)"));
  }
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size()) {
    return absl::UnavailableError(
        absl::StrCat("cannot write ", tmp_path_.string(), ": ", std::strerror(errno)));
  }
  data_written_ += static_cast<int64_t>(bytes.size());
  return absl::OkStatus();
}

absl::Status SafetensorsStreamWriter::Finish() {
  if (file_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(path_.string(), ": already finished"));
  }
  if (data_written_ != data_total_) {
    return absl::FailedPreconditionError(absl::StrCat(path_.string(), ": ", data_written_,
                                                      " bytes of tensor data written, header ",
                                                      "announces ", data_total_));
  }
  const bool flushed = std::fflush(file_) == 0;
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  if (!flushed || !closed) {
    std::error_code ec;
    std::filesystem::remove(tmp_path_, ec);
    return absl::UnavailableError(
        absl::StrCat("cannot write ", tmp_path_.string(), ": ", std::strerror(errno)));
  }
  std::error_code ec;
  std::filesystem::rename(tmp_path_, path_, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp_path_, ignored);
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp_path_.string(), " to ",
                                               path_.string(), ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace tandem
