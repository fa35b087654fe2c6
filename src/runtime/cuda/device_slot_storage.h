// The GPU backend of the Sparse Memory Pool: slots in device memory, filled by FlashTrans
// straight from the pinned Total Memory Pool. Drops in behind SlotStorage.
#pragma once

#include <cstdint>
#include <vector>

#include "ess/cache/sparse_pool.h"
#include "ess/ops/flashtrans.h"

namespace ess::cuda {

class DeviceSlotStorage final : public SlotStorage {
 public:
  // Uses CUDA device `device` and `stream` (nullptr = the legacy default stream).
  explicit DeviceSlotStorage(int device = 0, Stream stream = nullptr);
  ~DeviceSlotStorage() override;
  DeviceSlotStorage(const DeviceSlotStorage&) = delete;
  DeviceSlotStorage& operator=(const DeviceSlotStorage&) = delete;

  std::string_view backend() const override { return "cuda"; }
  void allocate(const SparsePoolConfig& config) override;
  // Uploads the plan's offsets and runs one FlashTrans gather for all of its misses, then
  // waits for it. The Total Memory Pool must be pinned (HostMemoryKind::kPinned).
  void fill(const MissPlan& plan, const TotalPool& total) override;
  void read(std::int32_t row, int layer, std::int32_t slot, std::span<std::uint8_t> out) const override;
  const std::uint8_t* host_entry(std::int32_t, int, std::int32_t) const override { return nullptr; }

  // Device address of the slot array: entry (row, layer, slot) is at
  // data() + ((row * layers + layer) * slots + slot) * entry_bytes.
  std::uint8_t* data() { return slots_; }
  std::uint64_t slot_offset(std::int32_t row, int layer, std::int32_t slot) const {
    return ((static_cast<std::uint64_t>(row) * layers_ + static_cast<std::uint64_t>(layer)) * slots_per_ +
            static_cast<std::uint64_t>(slot)) * entry_bytes_;
  }

 private:
  void reserve_offsets(std::size_t n);

  int device_;
  Stream stream_;
  std::uint8_t* slots_ = nullptr;
  std::uint64_t entry_bytes_ = 0;
  std::uint64_t layers_ = 0;
  std::uint64_t slots_per_ = 0;
  std::uint64_t bytes_ = 0;
  std::uint32_t rows_ = 0;
  // Offsets staged in pinned host memory, uploaded to device buffers.
  std::uint64_t* host_offsets_ = nullptr;
  std::uint64_t* dev_offsets_ = nullptr;
  std::size_t capacity_ = 0;  // entries per offset array
};

}  // namespace ess::cuda
