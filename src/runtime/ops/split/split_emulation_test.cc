// The split's own device code (split_cta.h: the miss-offsets scan and the per-position
// split) run on the CPU by the CTA emulator (cta_emulator.h), on the cases of split_cases.h,
// with the launches split.cu makes (one scan block, then one block per position) and the
// device test's poisoned outputs; every buffer is guarded. Runs without a device; label
// emulation.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "runtime/ops/split/split_cta.h"
#include "split_cases.h"
#include "testing/emulator/cta_emulator.h"

namespace ess::split_test {
namespace {

std::uint64_t seed = 1;

SplitResult emulated_split(const SplitProblem& p) {
  const std::size_t n = p.slot_ids.size();
  emu::Guarded<std::int32_t> slot_ids, counts, fill_slots, rows, resident, fetched, resident_count, fetched_count;
  emu::Guarded<std::uint64_t> fill_host, src, dst;
  slot_ids.assign(p.slot_ids);
  counts.assign(p.counts);
  fill_slots.assign(p.fill_slots);
  rows.assign(p.rows);
  fill_host.assign(p.fill_host_offsets);
  src.assign(std::vector<std::uint64_t>(n, ~0ull));
  dst.assign(std::vector<std::uint64_t>(n, ~0ull));
  resident.assign(std::vector<std::int32_t>(n, -9));
  fetched.assign(std::vector<std::int32_t>(n, -9));
  const std::size_t query_rows = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.query_tokens);
  resident_count.assign(std::vector<std::int32_t>(query_rows, -9));
  fetched_count.assign(std::vector<std::int32_t>(query_rows, -9));
  emu::Guarded<std::int64_t> miss_offsets(static_cast<std::size_t>(p.batch)), total(1);
  emu::Guarded<std::uint8_t> flags(static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.rows_per_request));
  SplitArgs a;
  a.batch = p.batch;
  a.positions = p.positions;
  emu::Guarded<std::int32_t> region;
  region.assign(p.region.empty() ? std::vector<std::int32_t>{-1} : p.region);
  a.pool = PoolRows{p.rows_per_request, p.region.empty() ? nullptr : region.data(), p.region_blocks, p.block_rows};
  a.buffer = p.buffer;
  a.rows = rows.data();
  a.slot_ids = slot_ids.data();
  a.counts = counts.data();
  a.fill_slots = fill_slots.data();
  a.fill_host_offsets = fill_host.data();
  a.miss_offsets = miss_offsets.data();
  a.src_offsets = src.data();
  a.dst_offsets = dst.data();
  a.total = total.data();
  a.query_tokens = p.query_tokens;
  if (p.split) {
    a.flags = flags.data();
    a.resident = resident.data();
    a.fetched = fetched.data();
    a.resident_count = resident_count.data();
    a.fetched_count = fetched_count.data();
  }
  EXPECT_EQ(check_args(a), "");
  if (p.batch > 0) {  // split_misses_cuda's two launches
    emu::launch("split_miss_offsets", 1, cuda::split::kScanThreads, 0, seed++, [&](emu::Cta& c, std::uint8_t*) {
      cuda::split::miss_offsets_cta(a.counts, a.batch, a.miss_offsets, a.total, c);
    });
    emu::launch("split", static_cast<unsigned>(p.batch), cuda::split::kThreads, 0, seed++,
                [&](emu::Cta& c, std::uint8_t*) { cuda::split::split_cta(a, c); });
  } else {
    total[0] = 0;
  }
  for (const std::string& d : {slot_ids.damage(), counts.damage(), fill_slots.damage(), rows.damage(), resident.damage(),
                               fetched.damage(), resident_count.damage(), fetched_count.damage(), fill_host.damage(),
                               src.damage(), dst.damage(), miss_offsets.damage(), total.damage(), flags.damage()}) {
    EXPECT_TRUE(d.empty()) << "split: a buffer " << d;
  }
  SplitResult r;
  r.total = total[0];
  const auto listed = static_cast<std::size_t>(std::max<std::int64_t>(0, std::min<std::int64_t>(r.total, static_cast<std::int64_t>(n))));
  r.src_offsets.assign(src.data(), src.data() + listed);
  r.dst_offsets.assign(dst.data(), dst.data() + listed);
  if (p.split) {
    r.resident = resident.values();
    r.fetched = fetched.values();
    r.resident_count = resident_count.values();
    r.fetched_count = fetched_count.values();
  }
  return r;
}

bool always() { return true; }

}  // namespace

const SplitBackend& split_backend() {
  static const SplitBackend b{{"emulator", always}, emulated_split};
  return b;
}

}  // namespace ess::split_test
