// The device workload of the sparse MLA benchmarks (sparse_mla_bench.cc, and the FlashTrans
// benchmark's concurrent sweep). CUDA target only.
#pragma once

#include <cstdint>
#include <vector>

#include "ess/ops/sparse_mla.h"
#include "runtime/cuda/device_buffer.h"
#include "runtime/ops/sparse_mla/sparse_mla_bench.h"

namespace ess::cuda {

// A decode batch for the sparse MLA on the device (the benchmark's, and the workload the
// transfer benchmark runs beside FlashTrans): random valid latent entries in `slots` slots
// per request, K distinct random slot ids per query token, q ~ N(0, 1) in bf16.
class SparseMlaWorkload {
 public:
  SparseMlaWorkload(const SparseMlaBenchConfig& config, int max_batch);
  // The decode of the first `batch` requests (<= max_batch), into the workload's outputs.
  SparseMlaArgs args(int batch) const;
  float softmax_scale() const { return scale_; }
  // Host copies, for checks against the CPU reference.
  const std::vector<std::int32_t>& ids() const { return ids_; }            // [max_batch][T][K]
  const std::vector<std::uint16_t>& queries() const { return q_; }         // [max_batch][T][H][576]
  const std::uint8_t* host_entry(int b, std::int32_t slot) const;           // the bytes of a slot

 private:
  SparseMlaBenchConfig config_;
  int max_batch_ = 0;
  float scale_ = 0;
  std::vector<std::uint8_t> pattern_;
  std::vector<std::int32_t> ids_;
  std::vector<std::uint16_t> q_;
  DeviceBuffer<std::uint8_t> kv_;
  DeviceBuffer<std::uint64_t> d_offsets_;
  DeviceBuffer<std::int32_t> d_ids_;
  DeviceBuffer<std::uint16_t> d_q_;
  DeviceBuffer<std::uint16_t> d_out_;
  DeviceBuffer<float> d_lse_;
};

}  // namespace ess::cuda
