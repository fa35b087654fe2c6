// cuBLAS as the stand-in GEMMs use it, loaded when they are first made: a program that links
// the rig (`ess`, the executor's tests) starts, and runs everything but the GEMMs, on a machine
// without cuBLAS, and does not pay for loading its libraries at every start.
#pragma once

#include <cublas_api.h>

namespace ess::rig {

struct CublasLibrary {
  cublasStatus_t (*create)(cublasHandle_t* handle);
  cublasStatus_t (*destroy)(cublasHandle_t handle);
  cublasStatus_t (*set_stream)(cublasHandle_t handle, cudaStream_t stream);
  cublasStatus_t (*set_workspace)(cublasHandle_t handle, void* workspace, std::size_t bytes);
  cublasStatus_t (*gemm_ex)(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo);
  cublasStatus_t (*gemm_strided_batched_ex)(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                            int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                            int lda, long long strideA, const void* B, cudaDataType Btype, int ldb,
                                            long long strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                            long long strideC, int batch, cublasComputeType_t compute,
                                            cublasGemmAlgo_t algo);
};

// libcublas.so of the cuBLAS major version this was built with, from the loader's search path
// (LD_LIBRARY_PATH, then the program's RUNPATH, which holds the CUDA toolkit's library folder),
// loaded once. Throws ess::Error naming the library and the loader's message when it is missing.
const CublasLibrary& cublas_library();

}  // namespace ess::rig
