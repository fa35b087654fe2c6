// Sparse Memory Pool: per request and layer a fixed number of slots holding latent entries.
//
// Geometry (rows x layers x slots x entry bytes) and request admission live here; the bytes
// live in a SlotStorage backend. The CPU backend keeps them in host memory; the GPU backend
// (CUDA target) keeps them in device memory and fills them with FlashTrans. Both implement
// the same interface, so the swap engine and the tools do not care which one they drive.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ess/cache/types.h"
#include "ess/model/entry_layout.h"

namespace ess {

class TotalPool;

struct SparsePoolConfig {
  int num_layers = 0;
  LatentLayout layout;
  std::int32_t max_requests = 0;  // rows
  std::int32_t slots = 0;         // per request-layer
  int query_tokens = 1;           // T: query tokens per request per step (MTP)
  int topk = 2048;                // K: entries each query token selects
  // Longest request the pool will serve (0 = unbounded). A query token never selects more
  // ids than the request's length, so with a bound the pool needs min(K, max_context) slots.
  std::int64_t max_context = 0;

  // The smallest usable pool: one query token's top-k, min(K, max_context or unbounded). A
  // step whose T query tokens select more distinct ids than the pool holds is served in query
  // groups (ess/cache/query_groups.h).
  std::int64_t min_slots() const;
  // Throws ess::Error naming the field unless the configuration is usable; in particular a
  // pool with fewer slots than min_slots() is refused.
  void validate() const;
};

// Slots for a Sparse Memory Ratio: ceil(ratio x context_length), e.g. 0.2 x 32768 -> 6554.
// ratio must be in (0, 1] and context_length positive.
std::int32_t slots_for_ratio(double ratio, std::int64_t context_length);

// Where slot bytes live. Entries are addressed as (row, layer, slot).
class SlotStorage {
 public:
  virtual ~SlotStorage() = default;
  virtual std::string_view backend() const = 0;
  // Sizes the storage for the pool's geometry. Called once by SparsePool's constructor.
  virtual void allocate(const SparsePoolConfig& config) = 0;
  // Copies every miss of `plan` from the Total Memory Pool into its slot (FlashTrans on GPU).
  virtual void fill(const MissPlan& plan, const TotalPool& total) = 0;
  // Copies one slot's bytes out (for tests and the lossless check).
  virtual void read(std::int32_t row, int layer, std::int32_t slot, std::span<std::uint8_t> out) const = 0;
  // Host pointer to a slot's entry when the bytes are host-resident, else nullptr.
  virtual const std::uint8_t* host_entry(std::int32_t row, int layer, std::int32_t slot) const = 0;
};

// Host-memory backend.
class CpuSlotStorage final : public SlotStorage {
 public:
  std::string_view backend() const override { return "cpu"; }
  void allocate(const SparsePoolConfig& config) override;
  void fill(const MissPlan& plan, const TotalPool& total) override;
  void read(std::int32_t row, int layer, std::int32_t slot, std::span<std::uint8_t> out) const override;
  const std::uint8_t* host_entry(std::int32_t row, int layer, std::int32_t slot) const override {
    return bytes_.data() + index(row, layer, slot) * entry_bytes_;
  }

 private:
  std::size_t index(std::int32_t row, int layer, std::int32_t slot) const {
    return (static_cast<std::size_t>(row) * layers_ + static_cast<std::size_t>(layer)) * slots_ +
           static_cast<std::size_t>(slot);
  }
  std::vector<std::uint8_t> bytes_;
  std::size_t entry_bytes_ = 0;
  std::size_t layers_ = 0;
  std::size_t slots_ = 0;
};

class SparsePool {
 public:
  explicit SparsePool(SparsePoolConfig config,
                      std::unique_ptr<SlotStorage> storage = std::make_unique<CpuSlotStorage>());

  // Gives the request a row. Throws when it is already admitted or every row is taken.
  std::int32_t admit(RequestId id);
  void release(RequestId id);
  bool contains(RequestId id) const { return rows_.contains(id); }
  std::int32_t row(RequestId id) const;

  const SparsePoolConfig& config() const { return config_; }
  std::int32_t slots() const { return config_.slots; }
  int num_layers() const { return config_.num_layers; }
  std::int32_t free_rows() const { return static_cast<std::int32_t>(free_rows_.size()); }
  std::uint64_t bytes() const;  // the storage the pool holds: rows x layers x slots x entry
  SlotStorage& storage() { return *storage_; }
  const SlotStorage& storage() const { return *storage_; }
  std::uint64_t digest() const;  // row assignment (not the slot bytes)

 private:
  SparsePoolConfig config_;
  std::unique_ptr<SlotStorage> storage_;
  std::unordered_map<RequestId, std::int32_t> rows_;
  std::vector<std::int32_t> free_rows_;  // stack; back() is handed out next
};

}  // namespace ess
