#include "harness/rig/gemm.h"

#include <cublas_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ess/core/error.h"
#include "harness/rig/cublas_library.h"
#include "harness/rig/fills.h"
#include "runtime/cuda/check.h"

namespace ess::rig {
namespace {

// One GEMM (or a batch of equal GEMMs) in cuBLAS's column-major terms: C[m x n] = A[m x k]
// B[k x n], `count` times with the given strides (elements).
struct Shape {
  int m = 0, n = 0, k = 0, count = 1;
};

struct Dims {
  int hidden, q_lora, kv_lora, rope, nope, vdim, heads, ih, id, experts, inter, shared, topk_e, local;
  explicit Dims(const ModelSpec& m, int ep)
      : hidden(m.hidden_size), q_lora(m.q_lora_rank), kv_lora(m.kv_lora_rank), rope(m.qk_rope_head_dim),
        nope(m.qk_nope_head_dim), vdim(m.v_head_dim), heads(m.num_attention_heads), ih(m.index_n_heads),
        id(m.index_head_dim), experts(m.n_routed_experts), inter(m.moe_intermediate_size),
        shared(std::max(m.n_shared_experts, 1)), topk_e(m.num_experts_per_tok),
        local((m.n_routed_experts + ep - 1) / ep) {}
  int rows_per_expert(int n) const { return (n * topk_e + local - 1) / local; }
};

// The GEMMs of an op for n tokens, in order (weights of GEMM i follow those of GEMM i - 1).
std::vector<Shape> shapes(const Dims& d, GemmOp op, int n) {
  switch (op) {
    case GemmOp::kProj0: return {{d.q_lora + d.kv_lora + d.rope + d.id + d.ih, n, d.hidden, 1}};
    case GemmOp::kIndexerWqB: return {{d.ih * d.id, n, d.q_lora, 1}};
    case GemmOp::kQbProj: return {{d.heads * (d.nope + d.rope), n, d.q_lora, 1}};
    case GemmOp::kAbsorbBmm: return {{d.kv_lora, n, d.nope, d.heads}};
    case GemmOp::kOutBmm: return {{d.vdim, n, d.kv_lora, d.heads}};
    case GemmOp::kOProj: return {{d.hidden, n, d.heads * d.vdim, 1}};
    case GemmOp::kGate: return {{d.experts, n, d.hidden, 1}};
    case GemmOp::kSharedExpert: return {{2 * d.inter * d.shared, n, d.hidden, 1}, {d.hidden, n, d.inter * d.shared, 1}};
    case GemmOp::kRoutedExperts: {
      const int r = d.rows_per_expert(n);
      return {{2 * d.inter, r, d.hidden, d.local}, {d.hidden, r, d.inter, d.local}};
    }
  }
  return {};
}

std::size_t weight_elems(const Shape& s) { return static_cast<std::size_t>(s.m) * s.k * s.count; }
std::size_t in_elems(const Shape& s) { return static_cast<std::size_t>(s.k) * s.n * s.count; }
std::size_t out_elems(const Shape& s) { return static_cast<std::size_t>(s.m) * s.n * s.count; }

const char* cublas_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "invalid value";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "execution failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "not supported";
    default: return "error";
  }
}

#define ESS_CUBLAS_CHECK(call, ...)                                                                     \
  do {                                                                                                  \
    const cublasStatus_t ess_st_ = (call);                                                              \
    ESS_CHECK(ess_st_ == CUBLAS_STATUS_SUCCESS, "{}: cuBLAS {} ({})", ::fmt::format(__VA_ARGS__),       \
              static_cast<int>(ess_st_), cublas_name(ess_st_));                                         \
  } while (0)

}  // namespace

double gemm_flops(const ModelSpec& m, int expert_parallel, GemmOp op, int n) {
  double f = 0;
  for (const Shape& s : shapes(Dims(m, expert_parallel), op, n)) f += 2.0 * s.m * s.n * s.k * s.count;
  return f;
}

struct StandInGemms::Impl {
  Dims dims;
  int max_tokens;
  cublasHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 64u << 20;
  std::uint16_t* weights = nullptr;
  std::size_t weight_total = 0;
  std::vector<std::size_t> weight_offset;  // per op, elements
  std::uint16_t* in = nullptr;
  std::uint16_t* out = nullptr;
  bool bound = false;              // the handle runs on `stream`, with our workspace
  cudaStream_t stream = nullptr;

  Impl(const ModelSpec& m, int max_n, int ep) : dims(m, ep), max_tokens(max_n) {}
  ~Impl() {
    if (handle != nullptr) cublas_library().destroy(handle);
    cudaFree(workspace);
    cudaFree(weights);
    cudaFree(in);
    cudaFree(out);
  }
};

StandInGemms::StandInGemms(const ModelSpec& model, int max_tokens, int expert_parallel)
    : impl_(std::make_unique<Impl>(model, max_tokens, expert_parallel)) {
  ESS_CHECK(max_tokens >= 1, "stand-in GEMMs: max_tokens = {} must be >= 1", max_tokens);
  Impl& s = *impl_;
  std::size_t in_max = 0, out_max = 0;
  for (const GemmOp op : kAllGemmOps) {
    s.weight_offset.push_back(s.weight_total);
    for (const Shape& sh : shapes(s.dims, op, max_tokens)) {
      s.weight_total += weight_elems(sh);
      in_max = std::max(in_max, in_elems(sh));
      out_max = std::max(out_max, out_elems(sh));
    }
  }
  ESS_CUBLAS_CHECK(cublas_library().create(&s.handle), "stand-in GEMMs: creating the cuBLAS handle");
  ESS_CUDA_CHECK(cudaMalloc(&s.workspace, s.workspace_bytes), "stand-in GEMMs: cuBLAS workspace");
  ESS_CUDA_CHECK(cudaMalloc(&s.weights, s.weight_total * 2), "stand-in GEMMs: {:.2f} GB of BF16 weights", static_cast<double>(s.weight_total) * 2e-9);
  ESS_CUDA_CHECK(cudaMalloc(&s.in, in_max * 2), "stand-in GEMMs: input activations");
  ESS_CUDA_CHECK(cudaMalloc(&s.out, out_max * 2), "stand-in GEMMs: output activations");
  ESS_CUDA_CHECK(static_cast<cudaError_t>(fill_bf16(s.weights, s.weight_total, 0.05f, 11, nullptr)), "stand-in weights");
  ESS_CUDA_CHECK(static_cast<cudaError_t>(fill_bf16(s.in, in_max, 1.0f, 12, nullptr)), "stand-in activations");
  ESS_CUDA_CHECK(cudaDeviceSynchronize(), "stand-in GEMMs: initialisation");
}

StandInGemms::~StandInGemms() = default;

std::uint64_t StandInGemms::weight_bytes() const { return impl_->weight_total * 2; }

void StandInGemms::run(GemmOp op, int n, cuda::Stream stream) {
  Impl& s = *impl_;
  const CublasLibrary& blas = cublas_library();
  ESS_CHECK(n >= 1 && n <= s.max_tokens, "stand-in GEMM {}: {} tokens outside [1, {}]", op_name(op), n, s.max_tokens);
  // cublasSetStream resets the handle to cuBLAS's default workspace pool, which allocates
  // per stream, also inside a graph capture; so every change of stream sets ours again.
  if (!s.bound || s.stream != static_cast<cudaStream_t>(stream)) {
    ESS_CUBLAS_CHECK(blas.set_stream(s.handle, static_cast<cudaStream_t>(stream)), "stand-in GEMMs: setting the stream");
    ESS_CUBLAS_CHECK(blas.set_workspace(s.handle, s.workspace, s.workspace_bytes), "stand-in GEMMs: setting the workspace");
    s.stream = static_cast<cudaStream_t>(stream);
    s.bound = true;
  }
  const float alpha = 1.0f, beta = 0.0f;
  const std::uint16_t* w = s.weights + s.weight_offset[static_cast<std::size_t>(op)];
  for (const Shape& sh : shapes(s.dims, op, n)) {
    if (sh.count == 1) {
      ESS_CUBLAS_CHECK(blas.gemm_ex(s.handle, CUBLAS_OP_N, CUBLAS_OP_N, sh.m, sh.n, sh.k, &alpha, w, CUDA_R_16BF, sh.m,
                                    s.in, CUDA_R_16BF, sh.k, &beta, s.out, CUDA_R_16BF, sh.m, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT),
                       "stand-in GEMM {} ({} x {} x {})", op_name(op), sh.m, sh.n, sh.k);
    } else {
      ESS_CUBLAS_CHECK(blas.gemm_strided_batched_ex(
                           s.handle, CUBLAS_OP_N, CUBLAS_OP_N, sh.m, sh.n, sh.k, &alpha, w, CUDA_R_16BF, sh.m,
                           static_cast<long long>(sh.m) * sh.k, s.in, CUDA_R_16BF, sh.k,
                           static_cast<long long>(sh.k) * sh.n, &beta, s.out, CUDA_R_16BF, sh.m,
                           static_cast<long long>(sh.m) * sh.n, sh.count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                       "stand-in batched GEMM {} ({} x {} x {} x {})", op_name(op), sh.count, sh.m, sh.n, sh.k);
    }
    w += weight_elems(sh);
  }
}

}  // namespace ess::rig
