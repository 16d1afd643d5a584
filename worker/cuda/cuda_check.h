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

class Stream {
 public:
  Stream() = default;
  ~Stream() { if (s_ != nullptr) cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  absl::Status Create() {
    CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
    return absl::OkStatus();
  }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  Event() = default;
  ~Event() { if (e_ != nullptr) cudaEventDestroy(e_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  absl::Status Create() {
    CUDA_CHECK(cudaEventCreate(&e_));
    return absl::OkStatus();
  }
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

class CublasHandle {
 public:
  CublasHandle() = default;
  ~CublasHandle() { if (h_ != nullptr) cublasDestroy(h_); }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  absl::Status Create() {
    CUBLAS_CHECK(cublasCreate(&h_));
    return absl::OkStatus();
  }
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

// An instantiated CUDA graph (the captured graph itself is dropped once instantiated).
class GraphExec {
 public:
  GraphExec() = default;
  ~GraphExec() { if (g_ != nullptr) cudaGraphExecDestroy(g_); }
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  absl::Status Instantiate(cudaGraph_t graph) {
    CUDA_CHECK(cudaGraphInstantiate(&g_, graph, 0));
    return absl::OkStatus();
  }
  cudaGraphExec_t get() const { return g_; }

 private:
  cudaGraphExec_t g_ = nullptr;
};

class Graph {
 public:
  explicit Graph(cudaGraph_t g = nullptr) : g_(g) {}
  ~Graph() { if (g_ != nullptr) cudaGraphDestroy(g_); }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  cudaGraph_t get() const { return g_; }

 private:
  cudaGraph_t g_ = nullptr;
};

}  // namespace tandem::cuda
