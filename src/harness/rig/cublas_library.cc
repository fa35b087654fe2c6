#include "harness/rig/cublas_library.h"

#include <dlfcn.h>

#include <string>

#include "ess/core/error.h"

namespace ess::rig {
namespace {

template <typename F>
void bind(void* lib, const char* name, F& out, const std::string& file) {
  void* f = ::dlsym(lib, name);
  ESS_CHECK(f != nullptr, "stand-in GEMMs: {} has no {} (another cuBLAS than {}.x?)", file, name, CUBLAS_VER_MAJOR);
  out = reinterpret_cast<F>(f);
}

CublasLibrary load() {
  const std::string file = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  // Never closed: the handles it hands out live as long as the program may use them.
  void* lib = ::dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  ESS_CHECK(lib != nullptr, "stand-in GEMMs need cuBLAS: {} cannot be loaded ({}); install the CUDA toolkit's cuBLAS or "
                            "put its folder on LD_LIBRARY_PATH", file, ::dlerror());
  CublasLibrary c{};
  bind(lib, "cublasCreate_v2", c.create, file);
  bind(lib, "cublasDestroy_v2", c.destroy, file);
  bind(lib, "cublasSetStream_v2", c.set_stream, file);
  bind(lib, "cublasSetWorkspace_v2", c.set_workspace, file);
  bind(lib, "cublasGemmEx", c.gemm_ex, file);
  bind(lib, "cublasGemmStridedBatchedEx", c.gemm_strided_batched_ex, file);
  return c;
}

}  // namespace

const CublasLibrary& cublas_library() {
  static const CublasLibrary library = load();
  return library;
}

}  // namespace ess::rig
