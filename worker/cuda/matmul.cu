// Every projection and the LM head: cuBLAS GEMMs with fp16/bf16 inputs and fp32 accumulation.
// FixedAlgoGemm: the same through cuBLASLt with one algorithm per shape whatever the row count.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <array>

#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/kernels.h"

namespace tandem::cuda {

// Row-major y (rows, out) = x (rows, in) · wᵀ is column-major yᵀ (out, rows) = W · xᵀ where the
// row-major (out, in) weight read column-major is Wᵀ (in, out): op(A) = T with lda = in.
absl::Status Gemm(cublasHandle_t handle, DType dtype, const void* x, const void* w, void* y,
                  int rows, int out, int in, float beta, bool y_f32) {
  if (rows == 0) return absl::OkStatus();
  cudaDataType_t t;
  if (dtype == DType::kF16) {
    t = CUDA_R_16F;
  } else if (dtype == DType::kBF16) {
    t = CUDA_R_16BF;
  } else {
    return absl::InvalidArgumentError("GEMM takes fp16 or bf16 operands");
  }
  const float alpha = 1.0f;
  CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &alpha, w, t, in, x,
                            t, in, &beta, y, y_f32 ? CUDA_R_32F : t, out, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

namespace {

cudaDataType_t CudaType(DType dtype) { return dtype == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF; }

// Rows the algorithm is searched for (a prefill-sized product) and the row counts it is checked
// against before it is pinned.
constexpr int kSearchRows = 256;
constexpr std::array<int, 5> kCheckRows = {1, 7, 64, 256, 2048};
// Workspace an algorithm may use: a few bytes (a tile scheduler's counters at large row counts),
// never a split-K reduction buffer.
constexpr size_t kWorkspaceBytes = 1024;

}  // namespace

struct FixedAlgoGemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // b and c: cols set per call
  cublasLtMatmulAlgo_t algo;
  ~Plan() {
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

FixedAlgoGemm::~FixedAlgoGemm() {
  plans_.clear();
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

absl::StatusOr<std::unique_ptr<FixedAlgoGemm>> FixedAlgoGemm::Create(cudaStream_t stream) {
  std::unique_ptr<FixedAlgoGemm> g(new FixedAlgoGemm());
  CUBLAS_CHECK(cublasLtCreate(&g->handle_));
  CUDA_CHECK(cudaMalloc(&g->workspace_, kWorkspaceBytes));
  g->stream_ = stream;
  return g;
}

absl::Status FixedAlgoGemm::Prepare(DType dtype, int out, int in, bool y_f32) {
  if (dtype != DType::kF16 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError("GEMM takes fp16 or bf16 operands");
  }
  if (out < 1 || in < 1) {
    return absl::InvalidArgumentError(absl::StrCat("GEMM shape out ", out, ", in ", in));
  }
  const Key key{static_cast<int>(dtype), out, in, y_f32};
  if (plans_.count(key) != 0) return absl::OkStatus();
  auto p = std::make_unique<Plan>();
  const cudaDataType_t t = CudaType(dtype), yt = y_f32 ? CUDA_R_32F : t;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  // Column-major, as Gemm above: A = w read as (in, out) transposed, B = x as (in, rows), C = y
  // as (out, rows).
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, t, in, out, in));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, t, in, kSearchRows, in));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, yt, out, kSearchRows, out));
  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t no_workspace = 0;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_workspace, sizeof(no_workspace));
  std::array<cublasLtMatmulHeuristicResult_t, 32> found{};
  int count = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->c, p->c, pref,
                                        static_cast<int>(found.size()), found.data(), &count);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cublasLtMatmulAlgoGetHeuristic: ", cublasGetStatusString(st)));
  }
  // The first algorithm that, with its K dimension in one piece (no split-K, so each output is
  // summed by one thread block in one order), is valid at every checked row count without
  // workspace. Why each candidate was refused goes into the error.
  std::string refused;
  for (int i = 0; i < count; ++i) {
    cublasLtMatmulAlgo_t algo = found[i].algo;
    uint32_t splits = 0;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                         sizeof(splits), &written);
    if (splits != 1) {
      const uint32_t one = 1, none = CUBLASLT_REDUCTION_SCHEME_NONE;
      if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one,
                                               sizeof(one)) != CUBLAS_STATUS_SUCCESS ||
          cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none,
                                               sizeof(none)) != CUBLAS_STATUS_SUCCESS) {
        absl::StrAppend(&refused, " #", i, ": split-K ", splits, " cannot be turned off;");
        continue;
      }
    }
    std::string why;
    for (int r : kCheckRows) {
      const uint64_t rows = static_cast<uint64_t>(r);  // cuBLASLt's type for a layout's size
      cublasLtMatmulHeuristicResult_t check{};
      cublasStatus_t cs =
          cublasLtMatrixLayoutSetAttribute(p->b, CUBLASLT_MATRIX_LAYOUT_COLS, &rows, sizeof(rows));
      if (cs == CUBLAS_STATUS_SUCCESS) {
        cs = cublasLtMatrixLayoutSetAttribute(p->c, CUBLASLT_MATRIX_LAYOUT_COLS, &rows,
                                              sizeof(rows));
      }
      if (cs == CUBLAS_STATUS_SUCCESS) {
        cs = cublasLtMatmulAlgoCheck(handle_, p->desc, p->a, p->b, p->c, p->c, &algo, &check);
      }
      if (cs != CUBLAS_STATUS_SUCCESS) {
        why = absl::StrCat(" #", i, " (split-K ", splits, "): ", r,
                           " rows: ", cublasGetStatusString(cs), ";");
        break;
      }
      if (check.workspaceSize > kWorkspaceBytes) {
        why = absl::StrCat(" #", i, ": ", r, " rows need ", check.workspaceSize,
                           " bytes of workspace;");
        break;
      }
    }
    if (why.empty()) {
      p->algo = algo;
      plans_.emplace(key, std::move(p));
      return absl::OkStatus();
    }
    refused += why;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("cuBLASLt offers no algorithm without split-K and a workspace of at most 1 KiB "
                   "that is valid for every row "
                   "count, for a GEMM of out ",
                   out, ", in ", in, " (", count, " candidates:", refused, ")"));
}

absl::Status FixedAlgoGemm::Run(DType dtype, const void* x, const void* w, void* y, int rows,
                                int out, int in, float beta, bool y_f32) {
  if (rows == 0) return absl::OkStatus();
  auto it = plans_.find(Key{static_cast<int>(dtype), out, in, y_f32});
  if (it == plans_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("no prepared GEMM plan for out ", out,
                                                      ", in ", in, y_f32 ? " (fp32 out)" : ""));
  }
  Plan& p = *it->second;
  const uint64_t cols = static_cast<uint64_t>(rows);  // cuBLASLt's type for a layout's size
  CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(p.b, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof(cols)));
  CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(p.c, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof(cols)));
  const float alpha = 1.0f;
  CUBLAS_CHECK(cublasLtMatmul(handle_, p.desc, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c,
                              &p.algo, workspace_, kWorkspaceBytes, stream_));
  return absl::OkStatus();
}

}  // namespace tandem::cuda
