// StageLink frames: activations to and from ActivationsMessage.
#include "worker/transport/activation_frame.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_format.h"
#include "common/dtype.h"

namespace tandem {

v1::ActivationsMessage EncodeActivations(uint64_t assignment, uint64_t step, const Activations& a) {
  v1::ActivationsMessage msg;
  msg.set_assignment_id(assignment);
  msg.set_step_id(step);
  msg.set_rows(a.rows);
  msg.set_cols(a.cols);
  msg.set_data(static_cast<const char*>(a.data.get()), a.nbytes());
  if (a.dtype != DType::kF32) msg.set_dtype(std::string(DTypeName(a.dtype)));
  return msg;
}

absl::StatusOr<Activations> DecodeActivations(const v1::ActivationsMessage& msg) {
  DType dtype = DType::kF32;
  if (!msg.dtype().empty()) {
    absl::StatusOr<DType> parsed = ParseDType(msg.dtype());
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("step %d: activations dtype '%s': %s",
                                                        msg.step_id(), msg.dtype(),
                                                        std::string(parsed.status().message())));
    }
    dtype = *parsed;
  }
  const int64_t rows = msg.rows(), cols = msg.cols();
  // rows x cols x the dtype's size, without wrapping: a product that wraps to the data's size would
  // pass for a frame it is not.
  int64_t elements = 0, bytes = 0;
  const bool fits =
      rows >= 0 && cols > 0 && !__builtin_mul_overflow(rows, cols, &elements) &&
      !__builtin_mul_overflow(elements, static_cast<int64_t>(DTypeSize(dtype)), &bytes);
  if (!fits || static_cast<uint64_t>(bytes) != msg.data().size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("step %d: %d bytes for [%d, %d] %s activations", msg.step_id(),
                        msg.data().size(), rows, cols, std::string(DTypeName(dtype))));
  }
  Activations a;
  a.rows = rows;
  a.cols = cols;
  a.dtype = dtype;
  a.where = Where::kHost;
  // float elements keep the buffer aligned for every dtype.
  const size_t floats =
      std::max<size_t>((msg.data().size() + sizeof(float) - 1) / sizeof(float), 1);
  auto buf = std::shared_ptr<float[]>(new float[floats]);
  std::memcpy(buf.get(), msg.data().data(), msg.data().size());
  a.data = std::shared_ptr<void>(buf, buf.get());
  return a;
}

}  // namespace tandem
