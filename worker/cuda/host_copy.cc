// Device-to-host copy of activations with the CUDA runtime.
#include "worker/cuda/host_copy.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"

namespace tandem {
namespace {

absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

}  // namespace

absl::StatusOr<Activations> CopyActivationsToHost(const Activations& a, int device) {
  if (a.where == Where::kHost) return a;
  if (a.rows < 0 || a.cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("activations to copy to the host: shape [", a.rows, ", ", a.cols, "]"));
  }
  if (a.rows * a.cols > 0 && a.data == nullptr) {
    return absl::InvalidArgumentError("activations to copy to the host have no data");
  }
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return CudaError(e, absl::StrCat("cudaSetDevice(", device, ")").c_str());
  }
  Activations h = a;
  h.where = Where::kHost;
  // float elements keep the buffer aligned for every dtype.
  const size_t floats = std::max<size_t>((a.nbytes() + sizeof(float) - 1) / sizeof(float), 1);
  auto buf = std::shared_ptr<float[]>(new float[floats]);
  if (a.nbytes() > 0) {
    if (cudaError_t e = cudaMemcpy(buf.get(), a.data.get(), a.nbytes(), cudaMemcpyDeviceToHost);
        e != cudaSuccess) {
      return CudaError(e, absl::StrCat("copying ", a.nbytes(), " bytes of activations to the host")
                              .c_str());
    }
  }
  h.data = std::shared_ptr<void>(buf, buf.get());
  return h;
}

}  // namespace tandem
