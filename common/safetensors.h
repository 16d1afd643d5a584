// Reads Hugging Face checkpoints: safetensors files, memory-mapped, single or sharded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/model_config.h"

namespace tandem {

// One tensor inside a mapped file; `data` stays valid while its file is open.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;  // nbytes == product(shape) * DTypeSize(dtype)
  int64_t numel() const;
};

// One memory-mapped .safetensors file. The header is validated when opened: offsets inside the
// data section, sizes matching dtype and shape, no overlaps; errors name the file and tensor.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return tensors_.count(name) > 0; }
  // NOT_FOUND naming the file and tensor when absent.
  absl::StatusOr<TensorView> tensor(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint folder: config.json + model.safetensors, or shards listed in
// model.safetensors.index.json. Shards are opened on first use, so a worker that asks only for
// its layers' tensors maps only the shards that hold them.
class Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::filesystem::path& dir);

  const ModelConfig& config() const { return config_; }
  const std::filesystem::path& dir() const { return dir_; }
  bool contains(const std::string& name) const { return shard_of_.count(name) > 0; }
  // Every tensor of the checkpoint, sorted.
  std::vector<std::string> names() const;
  absl::StatusOr<TensorView> tensor(const std::string& name);
  // The tensor as floats, after checking that its shape is `shape` exactly (error names both).
  absl::StatusOr<std::vector<float>> ReadFloat(const std::string& name,
                                               const std::vector<int64_t>& shape);

 private:
  std::filesystem::path dir_;
  ModelConfig config_;
  std::map<std::string, std::string> shard_of_;  // tensor name -> file name in dir_
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open_;  // file name -> mapped file
};

// A tensor to write: raw little-endian bytes of `dtype`.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};
// Writes a safetensors file (header padded to 8 bytes, tensors in the order given).
absl::Status WriteSafetensors(const std::filesystem::path& path,
                              const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace tandem
