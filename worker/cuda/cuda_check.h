// Device errors as absl::Status, and RAII owners for device memory, streams, events, cuBLAS
// handles and CUDA graphs. Every CUDA and cuBLAS call of the backend goes through these macros.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tandem::cuda {

inline absl::Status CudaError(cudaError_t e, const char* expr, const char* file, int line) {
  return absl::InternalError(absl::StrCat("CUDA error ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ") in ", expr, " at ", file, ":",
                                          line));
}

inline absl::Status CublasError(cublasStatus_t s, const char* expr, const char* file, int line) {
  return absl::InternalError(absl::StrCat("cuBLAS error ", cublasGetStatusName(s), " (",
                                          cublasGetStatusString(s), ") in ", expr, " at ", file,
                                          ":", line));
}

}  // namespace tandem::cuda

// Returns an INTERNAL status naming the call when it fails.
#define CUDA_CHECK(expr)                                                         \
  do {                                                                           \
    cudaError_t _tandem_cuda_err = (expr);                                       \
    if (_tandem_cuda_err != cudaSuccess)                                         \
      return ::tandem::cuda::CudaError(_tandem_cuda_err, #expr, __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_CHECK(expr)                                                          \
  do {                                                                              \
    cublasStatus_t _tandem_cublas_st = (expr);                                      \
    if (_tandem_cublas_st != CUBLAS_STATUS_SUCCESS)                                 \
      return ::tandem::cuda::CublasError(_tandem_cublas_st, #expr, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace tandem::cuda {

// Device memory from cudaMalloc, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)),
                                            size_(std::exchange(o.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  absl::Status Allocate(size_t bytes) {
    Reset();
    if (bytes == 0) return absl::OkStatus();
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free allocation error
      return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes,
                                                       " bytes failed: ", cudaGetErrorString(e)));
    }
    ptr_ = p;
    size_ = bytes;
    return absl::OkStatus();
  }
  void Reset() {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    size_ = 0;
  }
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

// Page-locked host memory, so that copies to and from the device are asynchronous.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { Reset(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  absl::Status Allocate(size_t bytes) {
    Reset();
    void* p = nullptr;
    CUDA_CHECK(cudaMallocHost(&p, bytes));
    ptr_ = p;
    size_ = bytes;
    return absl::OkStatus();
  }
  void Reset() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    size_ = 0;
  }
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

// Owns one handle of a CUDA library (a stream, an event, a cuBLAS handle, a graph) and releases
// it with `Destroy` when it goes or takes another; null: none. Creating it is the owner's business
// (put() hands the create call the place to write to).
template <typename T, auto Destroy>
class CudaHandle {
 public:
  CudaHandle() = default;
  explicit CudaHandle(T handle) : h_(handle) {}
  ~CudaHandle() { Reset(); }
  CudaHandle(const CudaHandle&) = delete;
  CudaHandle& operator=(const CudaHandle&) = delete;
  CudaHandle(CudaHandle&& other) noexcept : h_(std::exchange(other.h_, nullptr)) {}
  CudaHandle& operator=(CudaHandle&& other) noexcept {
    if (this != &other) {
      Reset();
      h_ = std::exchange(other.h_, nullptr);
    }
    return *this;
  }
  T get() const { return h_; }
  // Releases the handle held, if any, and returns where a create call writes the new one.
  T* put() {
    Reset();
    return &h_;
  }
  void Reset() {
    if (h_ != nullptr) (void)Destroy(h_);
    h_ = nullptr;
  }

 private:
  T h_ = nullptr;
};

class Stream : public CudaHandle<cudaStream_t, cudaStreamDestroy> {
 public:
  absl::Status Create() {
    CUDA_CHECK(cudaStreamCreateWithFlags(put(), cudaStreamNonBlocking));
    return absl::OkStatus();
  }
};

class Event : public CudaHandle<cudaEvent_t, cudaEventDestroy> {
 public:
  absl::Status Create() {
    CUDA_CHECK(cudaEventCreate(put()));
    return absl::OkStatus();
  }
};

class CublasHandle : public CudaHandle<cublasHandle_t, cublasDestroy> {
 public:
  absl::Status Create() {
    CUBLAS_CHECK(cublasCreate(put()));
    return absl::OkStatus();
  }
};

// An instantiated CUDA graph (the captured graph itself is dropped once instantiated).
class GraphExec : public CudaHandle<cudaGraphExec_t, cudaGraphExecDestroy> {
 public:
  absl::Status Instantiate(cudaGraph_t graph) {
    CUDA_CHECK(cudaGraphInstantiate(put(), graph, 0));
    return absl::OkStatus();
  }
};

using Graph = CudaHandle<cudaGraph_t, cudaGraphDestroy>;

}  // namespace tandem::cuda
