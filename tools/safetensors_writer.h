// Streaming safetensors writer: the header (every tensor's dtype, shape and offsets) is written
// first, then tensor data is appended chunk by chunk, so a file of any size needs only one chunk
// of memory. The file appears under its final name only once complete.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace tandem {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  int64_t nbytes() const;
};

class SafetensorsStreamWriter {
 public:
  // Writes the header for `entries`, whose data must then be appended in the same order.
  // The header is {"__metadata__": metadata, name: {"dtype", "shape", "data_offsets"}, ...},
  // padded with spaces to a multiple of 8 bytes.
  static absl::StatusOr<std::unique_ptr<SafetensorsStreamWriter>> Create(
      const std::filesystem::path& path, const std::vector<SafetensorsEntry>& entries,
      const std::map<std::string, std::string>& metadata);
  ~SafetensorsStreamWriter();  // an unfinished file is removed
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;

  // Appends the next bytes of tensor data (any split across calls).
  absl::Status Append(std::span<const std::byte> bytes);
  // Checks that exactly the announced data was appended, flushes, and moves the file into place.
  absl::Status Finish();

 private:
  SafetensorsStreamWriter() = default;
  std::filesystem::path path_;
  std::filesystem::path tmp_path_;
  std::FILE* file_ = nullptr;
  int64_t data_written_ = 0;
  int64_t data_total_ = 0;
};

}  // namespace tandem
