// Hardware profile: what one GPU, its node and the cluster fabric can do, read from JSON.
//
// Every number has its source written beside it in the file's "sources" object (field ->
// text); a profile with a number and no source, an unknown field, or a value out of range is
// refused with a message naming the file, the field and the value.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <map>
#include <string>
#include <vector>

namespace ess::sim {

struct HardwareProfile {
  std::string name;         // "h200", ...
  std::string description;  // free text
  std::string gpu;          // the GPU as its vendor names it ("NVIDIA H200 SXM 141 GB"); optional
  // GPU memory.
  double hbm_capacity_gb = 0;       // usable device memory, 1e9 bytes
  double hbm_bandwidth_gbps = 0;    // peak, GB/s
  double memory_efficiency = 0;     // achievable fraction of hbm_bandwidth_gbps
  // GPU compute (dense, no sparsity).
  double bf16_tflops = 0;
  double fp8_tflops = 0;
  double sm_count = 0;              // streaming multiprocessors (GEMM waves, top-k rows, transfer share)
  double gemm_efficiency = 0;       // GEMM main loop on a full tile: fraction of the SM's peak
  double gemm_tile_overhead_k = 0;  // per tile: prologue + epilogue, as this many more K of main loop
  double gemm_memory_efficiency = 0;  // GEMMs bound by streaming their weights: fraction of HBM peak
  double attention_efficiency = 0;  // sparse MLA decode main loop (FlashMLA): fraction of the SM's BF16 peak
  double indexer_efficiency = 0;    // FP8 paged MQA logits (DeepGEMM), fraction of FP8 peak
  double kernel_launch_us = 0;      // per kernel: launch gap inside a CUDA graph
  double step_overhead_us = 0;      // per step: host scheduling, sampling bookkeeping between steps
  double step_overhead_per_request_us = 0;  // per step and request of the GPU's batch: the host's per-request work
  // Host link (PCIe), per GPU, GB/s.
  double h2d_scattered_gbps = 0;    // 656-byte entries, FlashTrans kernel (zero-copy)
  double d2h_scattered_gbps = 0;
  double h2d_bulk_gbps = 0;         // large contiguous copies (copy engine)
  double d2h_bulk_gbps = 0;
  double transfer_launch_us = 0;    // fixed cost of one FlashTrans launch
  double transfer_sms = 0;          // SMs a FlashTrans copy holds while it runs (its grid)
  // Expert-parallel fabric, per GPU.
  double nvlink_gbps = 0;           // achievable all-to-all bandwidth inside a node
  double nvlink_latency_us = 0;
  double rdma_gbps = 0;             // achievable all-to-all bandwidth across nodes
  double rdma_latency_us = 0;
  // Host, per node.
  double host_dram_gb = 0;
  double host_dram_bandwidth_gbps = 0;
  // The share of host DRAM ESS's host pool leaves to everything else on the node (the OS, the
  // serving engine's processes, pinned staging buffers, the page cache).
  double host_dram_reserve = 0.1;
  double host_dram_usable_gb() const { return host_dram_gb * (1.0 - host_dram_reserve); }
  // Memory the CUDA context, NCCL/DeepEP buffers and allocator take outside the model's pools.
  double cuda_context_gb = 0;

  std::map<std::string, std::string> sources;  // field -> where its value comes from

  static HardwareProfile from_json(const nlohmann::json& j, const std::string& source);
  static HardwareProfile from_file(const std::string& path);
  // One of the profiles shipped in configs/hardware (compiled in): see shipped_names().
  static HardwareProfile shipped(const std::string& name);
  static std::vector<std::string> shipped_names();
  // A shipped name or a path to a JSON file.
  static HardwareProfile load(const std::string& name_or_path);

  nlohmann::json to_json() const;
  void validate(const std::string& source) const;
};

}  // namespace ess::sim
