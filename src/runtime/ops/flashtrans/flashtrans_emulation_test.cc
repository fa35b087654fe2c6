// FlashTrans's own device code (flashtrans_cta.h) run on the CPU by the CTA emulator
// (cta_emulator.h), on the cases of flashtrans_cases.h: the launch's grid is the one
// flashtrans.cu takes (flashtrans_grid), every global read and write is checked against the
// launch's buffers, and the buffers are guarded. The Sparse Memory Pool's fill builds its
// offsets as DeviceSlotStorage does. Runs without a device; label emulation.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "flashtrans_cases.h"
#include "runtime/ops/flashtrans/flashtrans_cta.h"
#include "runtime/ops/launch_args.h"
#include "testing/emulator/cta_emulator.h"

namespace ess::flashtrans_test {
namespace {

using cuda::flashtrans::Chunk;

class Prims {
 public:
  Prims(emu::Cta& c, const emu::GlobalRanges& g) : c_(c), g_(g) {}
  int tid() const { return c_.tid(); }
  int threads() const { return c_.threads(); }
  unsigned block() const { return c_.block(); }
  unsigned blocks() const { return c_.blocks(); }
  Chunk load(const Chunk* p) const {
    g_.check_read(p, sizeof(Chunk), "flashtrans");
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 16, 0u) << "a 16-byte load not 16-byte aligned";
    Chunk v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  void store(Chunk* p, const Chunk& v) const {
    g_.check_write(p, sizeof(Chunk), "flashtrans");
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 16, 0u) << "a 16-byte store not 16-byte aligned";
    std::memcpy(p, &v, sizeof v);
  }
  std::uint64_t load8(const std::uint64_t* p) const {
    g_.check_read(p, 8, "flashtrans");
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 8, 0u) << "an 8-byte load not 8-byte aligned";
    std::uint64_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  void store8(std::uint64_t* p, std::uint64_t v) const {
    g_.check_write(p, 8, "flashtrans");
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 8, 0u) << "an 8-byte store not 8-byte aligned";
    std::memcpy(p, &v, sizeof v);
  }

 private:
  emu::Cta& c_;
  const emu::GlobalRanges& g_;
};

std::uint64_t seed = 1;

// One launch as flashtrans.cu makes it, over guarded copies of the problem's buffers.
std::vector<std::uint8_t> emulated_copy(const std::uint8_t* src, std::size_t src_bytes, std::vector<std::uint8_t> dst_init,
                                        const std::vector<std::uint64_t>& src_offsets, const std::vector<std::uint64_t>& dst_offsets,
                                        std::int64_t count, int entry_bytes, std::int64_t device_count, int blocks,
                                        const RowTail& src_tail = {}, const RowTail& dst_tail = {}) {
  emu::Guarded<std::uint8_t> s(src_bytes), d;
  std::copy(src, src + src_bytes, s.data());
  d.assign(dst_init);
  emu::Guarded<std::uint64_t> so, dof;
  so.assign(src_offsets);
  dof.assign(dst_offsets);
  emu::Guarded<std::int64_t> dc;
  dc.assign({device_count});
  cuda::EntryCopy c;
  c.src_base = s.data();
  c.dst_base = d.data();
  c.src_offsets = so.data();
  c.dst_offsets = dof.data();
  c.count = count;
  c.entry_bytes = entry_bytes;
  c.device_count = device_count >= 0 ? dc.data() : nullptr;
  c.blocks = blocks;
  c.src_tail = src_tail;
  c.dst_tail = dst_tail;
  EXPECT_EQ(cuda::check_args(c), "");
  if (count > 0) {
    emu::GlobalRanges g;
    g.readable(s.data(), s.size(), "src");
    g.writable(d.data(), d.size(), "dst");
    const cuda::FlashTransGrid grid = cuda::flashtrans_grid(c);
    emu::launch("flashtrans", static_cast<unsigned>(grid.blocks), grid.threads, 0, seed++, [&](emu::Cta& cta, std::uint8_t*) {
      Prims p(cta, g);
      cuda::flashtrans::copy_entries_cta(cuda::flashtrans::copy_plan(c), p);
    });
  }
  for (const auto& damage : {s.damage(), d.damage(), so.damage(), dof.damage(), dc.damage()}) {
    EXPECT_TRUE(damage.empty()) << "flashtrans: a buffer " << damage;
  }
  return d.values();
}

std::vector<std::uint8_t> copy(const CopyProblem& p) {
  return emulated_copy(p.src.data(), p.src.size(), p.dst, p.src_offsets, p.dst_offsets, p.count, p.entry_bytes,
                       p.device_count, p.blocks, p.src_tail, p.dst_tail);
}

// DeviceSlotStorage::fill's offsets (row, layer, slot) -> slot entry; the source is the pool's arena.
std::vector<std::uint8_t> fill(const SparsePoolConfig& config, int rows, const MissPlan& plan, const TotalPool& total) {
  const std::uint64_t E = config.layout.bytes();
  std::vector<std::uint64_t> src, dst;
  for (const MissEntry& m : plan.entries) {
    src.push_back(m.host_offset);
    dst.push_back(((static_cast<std::uint64_t>(m.row) * config.num_layers + static_cast<std::uint64_t>(plan.layer)) *
                       static_cast<std::uint64_t>(config.slots) + static_cast<std::uint64_t>(m.slot)) * E);
  }
  const std::vector<std::uint8_t> slots(static_cast<std::size_t>(rows) * config.num_layers * config.slots * E);
  return emulated_copy(total.base(), total.capacity_bytes(), slots, src, dst, static_cast<std::int64_t>(src.size()),
                       static_cast<int>(E), -1, 0);
}

bool always() { return true; }

TEST(FlashTransEmulation, AnOffsetPastItsBufferFails) {
  std::vector<std::uint8_t> src(10 * 656, 1);
  std::vector<std::uint64_t> offsets = {0, 9 * 656 + 16};  // the second entry runs 16 bytes past src
  EXPECT_NONFATAL_FAILURE(
      (void)emulated_copy(src.data(), src.size(), std::vector<std::uint8_t>(10 * 656), offsets, {0, 656}, 2, 656, -1, 0),
      "outside every buffer of the launch it may read");
}

TEST(FlashTransEmulation, ALaunchPastFourBillionChunksIsRefused) {
  cuda::EntryCopy c;
  c.src_base = test::device_pointer<const std::uint8_t>();
  c.dst_base = test::device_pointer<std::uint8_t>();
  c.src_offsets = c.dst_offsets = test::device_pointer<const std::uint64_t>();
  c.count = (std::int64_t{1} << 32) / 41 + 1;
  EXPECT_NE(cuda::check_args(c).find("copy units (16-byte chunks, 8-byte tail units), more than the 4294967295 one launch "
                                     "addresses"),
            std::string::npos)
      << cuda::check_args(c);
}

}  // namespace

const FlashTransBackend& flashtrans_backend() {
  static const FlashTransBackend b{{"emulator", always}, HostMemoryKind::kAligned, copy, fill};
  return b;
}

}  // namespace ess::flashtrans_test
