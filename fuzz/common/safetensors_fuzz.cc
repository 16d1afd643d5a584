// SafetensorsFile::Open on any bytes: a header that is accepted describes only tensors that lie
// inside the data section with exactly the bytes their dtype and shape need, and reading every
// tensor's bytes stays inside the file.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  tandem::fuzz::MemoryFile file(bytes);
  auto opened = tandem::SafetensorsFile::Open(file.path());
  if (!opened.ok()) return 0;
  uint64_t header_len = 0;
  std::memcpy(&header_len, data, sizeof(header_len));  // accepted files have the 8 bytes
  if (header_len > size - 8) std::abort();
  const uint64_t data_bytes = size - 8 - header_len;
  for (const std::string& name : (*opened)->names()) {
    auto tensor = (*opened)->tensor(name);
    if (!tensor.ok()) std::abort();
    const uint64_t want = static_cast<uint64_t>(tensor->numel()) * tandem::DTypeSize(tensor->dtype);
    if (tensor->data.size() != want || want > data_bytes) std::abort();
    // Every byte of the view is read: one outside the mapping faults.
    uint8_t sum = 0;
    for (std::byte b : tensor->data) sum += std::to_integer<uint8_t>(b);
    volatile uint8_t sink = sum;
    (void)sink;
  }
  return 0;
}
