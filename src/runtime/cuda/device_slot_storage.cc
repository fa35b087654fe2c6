#include "runtime/cuda/device_slot_storage.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "ess/cache/total_pool.h"
#include "ess/runtime/backend.h"
#include "runtime/cuda/check.h"

namespace ess::cuda {

DeviceSlotStorage::DeviceSlotStorage(int device, Stream stream) : device_(device), stream_(stream) {
  ESS_CHECK(cuda_device_present(), "device slot storage: no CUDA device is present");
  int n = 0;
  ESS_CUDA_CHECK(cudaGetDeviceCount(&n), "device slot storage: counting CUDA devices");
  ESS_CHECK(device >= 0 && device < n, "device slot storage: CUDA device {} out of [0, {})", device, n);
}

DeviceSlotStorage::~DeviceSlotStorage() {
  if (slots_ != nullptr) cudaFree(slots_);
  if (dev_offsets_ != nullptr) cudaFree(dev_offsets_);
  if (host_offsets_ != nullptr) cudaFreeHost(host_offsets_);
}

void DeviceSlotStorage::allocate(const SparsePoolConfig& config) {
  ESS_CHECK(slots_ == nullptr, "device slot storage: allocate called twice");
  ESS_CUDA_CHECK(cudaSetDevice(device_), "device slot storage: selecting device {}", device_);
  entry_bytes_ = config.layout.bytes();
  layers_ = static_cast<std::uint64_t>(config.num_layers);
  slots_per_ = static_cast<std::uint64_t>(config.slots);
  rows_ = static_cast<std::uint32_t>(config.max_requests);
  bytes_ = rows_ * layers_ * slots_per_ * entry_bytes_;
  void* p = nullptr;
  ESS_CUDA_CHECK(cudaMalloc(&p, bytes_), "device slot storage: allocating {} bytes ({} rows x {} layers x {} slots x {} B)",
                 bytes_, rows_, layers_, slots_per_, entry_bytes_);
  slots_ = static_cast<std::uint8_t*>(p);
  ESS_CUDA_CHECK(cudaMemset(slots_, 0, bytes_), "device slot storage: zeroing slots");
}

void DeviceSlotStorage::reserve_offsets(std::size_t n) {
  if (n <= capacity_) return;
  const std::size_t cap = std::max<std::size_t>(n, capacity_ * 2);
  void* h = nullptr;
  void* d = nullptr;
  ESS_CUDA_CHECK(cudaMallocHost(&h, 2 * cap * sizeof(std::uint64_t)), "device slot storage: staging {} offsets", cap);
  if (cudaMalloc(&d, 2 * cap * sizeof(std::uint64_t)) != cudaSuccess) {
    cudaFreeHost(h);
    ESS_CUDA_CHECK(cudaGetLastError(), "device slot storage: device buffer for {} offsets", cap);
    ESS_THROW("device slot storage: cannot allocate a device buffer for {} offsets", cap);
  }
  if (host_offsets_ != nullptr) cudaFreeHost(host_offsets_);
  if (dev_offsets_ != nullptr) cudaFree(dev_offsets_);
  host_offsets_ = static_cast<std::uint64_t*>(h);
  dev_offsets_ = static_cast<std::uint64_t*>(d);
  capacity_ = cap;
}

void DeviceSlotStorage::fill(const MissPlan& plan, const TotalPool& total) {
  const std::size_t n = plan.entries.size();
  if (n == 0) return;
  ESS_CHECK(total.memory_kind() == HostMemoryKind::kPinned,
            "device slot storage: the total pool is in {} host memory; FlashTrans reads it zero-copy and needs it "
            "pinned and mapped",
            to_string(total.memory_kind()));
  ESS_CHECK(total.entry_bytes() == entry_bytes_, "device slot storage: total pool entries are {} B, slots {} B",
            total.entry_bytes(), entry_bytes_);
  ESS_CHECK(plan.layer >= 0 && static_cast<std::uint64_t>(plan.layer) < layers_,
            "device slot storage: plan layer {} out of [0, {})", plan.layer, layers_);
  for (std::size_t i = 0; i < n; ++i) {
    const MissEntry& m = plan.entries[i];
    ESS_CHECK(m.row >= 0 && static_cast<std::uint32_t>(m.row) < rows_ && m.slot >= 0 &&
                  static_cast<std::uint64_t>(m.slot) < slots_per_ &&
                  m.host_offset + entry_bytes_ <= total.capacity_bytes(),
              "device slot storage: miss {} (row {}, slot {}, host offset {}) is outside the pools", i, m.row, m.slot,
              m.host_offset);
  }
  const std::uint8_t* src = device_view(total.base());
  ESS_CHECK(src != nullptr, "device slot storage: the total pool is not mapped into the device address space");
  reserve_offsets(n);
  for (std::size_t i = 0; i < n; ++i) {
    host_offsets_[i] = plan.entries[i].host_offset;
    host_offsets_[n + i] = slot_offset(plan.entries[i].row, plan.layer, plan.entries[i].slot);
  }
  const auto stream = static_cast<cudaStream_t>(stream_);
  ESS_CUDA_CHECK(cudaMemcpyAsync(dev_offsets_, host_offsets_, 2 * n * sizeof(std::uint64_t), cudaMemcpyHostToDevice, stream),
                 "device slot storage: uploading {} miss offsets", n);
  EntryCopy c;
  c.src_base = src;
  c.dst_base = slots_;
  c.src_offsets = dev_offsets_;
  c.dst_offsets = dev_offsets_ + n;
  c.count = static_cast<std::int64_t>(n);
  c.entry_bytes = static_cast<int>(entry_bytes_);
  ESS_CUDA_CHECK(static_cast<cudaError_t>(flashtrans_gather(c, stream_)), "FlashTrans gather of {} entries (layer {})", n,
                 plan.layer);
  ESS_CUDA_CHECK(cudaStreamSynchronize(stream), "FlashTrans gather of {} entries (layer {})", n, plan.layer);
}

void DeviceSlotStorage::read(std::int32_t row, int layer, std::int32_t slot, std::span<std::uint8_t> out) const {
  ESS_CHECK(out.size() == entry_bytes_, "device slot read: buffer of {} bytes, entry is {}", out.size(), entry_bytes_);
  ESS_CHECK(row >= 0 && static_cast<std::uint32_t>(row) < rows_ && layer >= 0 && static_cast<std::uint64_t>(layer) < layers_ &&
                slot >= 0 && static_cast<std::uint64_t>(slot) < slots_per_,
            "device slot read: (row {}, layer {}, slot {}) out of range", row, layer, slot);
  ESS_CUDA_CHECK(cudaMemcpy(out.data(), slots_ + slot_offset(row, layer, slot), entry_bytes_, cudaMemcpyDeviceToHost),
                 "device slot read of row {} layer {} slot {}", row, layer, slot);
}

}  // namespace ess::cuda
