// DecodeActivations on any StageLink frame (the input in protobuf's text format, or else
// ActivationsMessage's wire format): a frame is refused, or its activations hold exactly the
// frame's bytes as rows x cols of its dtype, and encoding them again gives the same frame.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "fuzz/fuzz_support.h"
#include "worker/transport/activation_frame.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::v1::ActivationsMessage msg;
  if (!tandem::fuzz::ParseTextOrBinary(std::string_view(reinterpret_cast<const char*>(data), size),
                                       msg)) {
    return 0;
  }
  auto decoded = tandem::DecodeActivations(msg);
  if (!decoded.ok()) {
    if (decoded.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  if (decoded->nbytes() != msg.data().size()) std::abort();
  if (std::memcmp(decoded->data.get(), msg.data().data(), msg.data().size()) != 0) std::abort();
  const tandem::v1::ActivationsMessage again =
      tandem::EncodeActivations(msg.assignment_id(), msg.step_id(), *decoded);
  if (again.rows() != msg.rows() || again.cols() != msg.cols() || again.data() != msg.data()) {
    std::abort();
  }
  return 0;
}
