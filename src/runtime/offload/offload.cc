// Offload's front: configuration, requests and their pool rows, the Total Memory Pool; the
// step itself is the backend's (offload_cpu.cc, and the CUDA backend's offload_cuda.cc).
#include "ess/runtime/offload.h"

#include <algorithm>

#include "ess/cache/query_groups.h"
#include "ess/core/error.h"
#include "ess/runtime/backend.h"
#include "runtime/offload/offload_impl.h"

namespace ess {
namespace {
// Constant-initialized: null until the CUDA backend registers (before main).
OffloadBackendFactory g_make_cuda = nullptr;
}  // namespace

void register_cuda_offload(OffloadBackendFactory make) { g_make_cuda = make; }
OffloadBackendFactory cuda_offload_factory() { return g_make_cuda; }

OffloadConfig OffloadConfig::for_model(const ModelSpec& model, std::int32_t max_requests, std::int32_t slots,
                                       std::int64_t max_context, int query_tokens) {
  OffloadConfig c;
  c.layers = static_cast<int>(model.offloaded_layers().size());  // DeepSeek-V4: its C4 layers
  c.layout = LatentLayout::for_model(model);
  c.max_requests = max_requests;
  c.slots = slots;
  c.max_context = max_context;
  c.query_tokens = query_tokens;
  c.topk = model.index_topk;
  return c;
}

void OffloadConfig::validate() const {
  ESS_CHECK(layers >= 1 && layers <= 1024, "offload: layers = {} must be in [1, 1024]", layers);
  layout.validate();
  ESS_CHECK(max_requests >= 1, "offload: max_requests = {} must be >= 1", max_requests);
  ESS_CHECK(query_tokens >= 1 && query_tokens <= 16, "offload: query_tokens = {} must be in [1, 16]", query_tokens);
  ESS_CHECK(topk >= 1 && topk <= 65536, "offload: topk = {} must be in [1, 65536]", topk);
  ESS_CHECK(max_context >= 1, "offload: max_context = {} must be >= 1", max_context);
  ESS_CHECK(warmup_windows >= 0, "offload: warmup_windows = {} is negative", warmup_windows);
  const std::int64_t floor = std::min<std::int64_t>(topk, max_context);
  ESS_CHECK(slots >= floor && slots >= 1,
            "offload: {} slots per request-layer cannot hold one query token's top-k (min(topk {}, max_context {}) "
            "= {}); a step whose query tokens select more runs in query groups",
            slots, topk, max_context, floor);
  ESS_CHECK(static_cast<std::int64_t>(max_requests) * rows_per_request() <= std::int64_t{1} << 31,
            "offload: {} requests x {} rows per request exceed the int32 rows of a layer's buffer", max_requests,
            rows_per_request());
  ESS_CHECK(max_context < (std::int64_t{1} << 31), "offload: max_context = {} exceeds int32 token ids", max_context);
  ESS_CHECK(device >= 0, "offload: device = {} is negative", device);
  ESS_CHECK(copy_blocks >= 0 && copy_blocks <= 65535, "offload: copy_blocks = {} must be in [0, 65535] (0 = default)",
            copy_blocks);
  ESS_CHECK(residency == Residency::kSparse || residency == Residency::kWhole || residency == Residency::kAdaptive,
            "offload: residency = {} is not sparse, whole or adaptive", static_cast<int>(residency));
  ESS_CHECK(residency == Residency::kSparse || reserve_newest,
            "offload: residency {} needs reserve_newest (a whole request's newest entries reach its rows from the "
            "reserved rows, by write_back)",
            to_string(residency));
  ESS_CHECK(demotion_windows >= 0 && demotion_windows <= 1024, "offload: demotion_windows = {} must be in [0, 1024]",
            demotion_windows);
  ESS_CHECK(region_blocks >= 0, "offload: region_blocks = {} is negative", region_blocks);
  ESS_CHECK(region_group.empty() || (region_blocks > 0 && std::ssize(region_group) == layers),
            "offload: region_group has {} values: one per layer ({}) with regions, none without", region_group.size(),
            layers);
  for (std::size_t l = 0; l < region_group.size(); ++l) {
    ESS_CHECK(region_group[l] >= 0 && region_group[l] < layers, "offload: region_group of layer {} is {}, outside [0, {})",
              l, region_group[l], layers);
  }
  // Groups numbered from 0, none empty (each takes device memory).
  for (int g = 0; !region_group.empty() && g < region_groups(); ++g) {
    ESS_CHECK(std::find(region_group.begin(), region_group.end(), g) != region_group.end(),
              "offload: region_group has no layer in group {} (groups are numbered 0 .. {} without gaps)", g,
              region_groups() - 1);
  }
  ESS_CHECK(region_blocks == 0 || residency == Residency::kSparse,
            "offload: residency {} with regions (region_blocks = {}): a whole request's rows are pool rows of ESS's own "
            "layout; regions serve sparse requests only",
            to_string(residency), region_blocks);
  ESS_CHECK(whole_headroom >= 0 && whole_headroom <= max_requests,
            "offload: whole_headroom = {} must be in [0, max_requests = {}]", whole_headroom, max_requests);
}

namespace {

// One block of a buffer's rows: its rows' bytes span [begin, end) from the layer's base.
struct BlockSpan {
  std::int64_t begin = 0, end = 0;
  std::int64_t first_row = 0, rows = 0;
};

// The blocks holding rows [0, n) of `r`, `bytes` a row, from `base` bytes off the layer's base;
// ascending (a block holds its rows, blocks follow each other).
std::vector<BlockSpan> block_spans(const RowLayout& r, std::int64_t n, std::uint64_t bytes, std::int64_t base) {
  std::vector<BlockSpan> spans;
  const std::int64_t per = r.block_rows > 0 ? r.block_rows : n;
  for (std::int64_t first = 0; first < n; first += per) {
    const std::int64_t rows = std::min(per, n - first);
    const std::int64_t at = base + static_cast<std::int64_t>(r.offset(first));
    spans.push_back({at, at + (rows - 1) * static_cast<std::int64_t>(r.row_stride) + static_cast<std::int64_t>(bytes), first,
                     rows});
  }
  return spans;
}

// The first of a block's rows (at `begin`, `stride` apart, `bytes` each) that ends past `at`.
std::int64_t first_row_ending_past(std::int64_t begin, std::int64_t stride, std::int64_t bytes, std::int64_t at) {
  const std::int64_t x = at - begin - bytes;  // row k ends past `at` when k x stride > x
  if (x < 0) return 0;
  return x / stride + 1;
}

// Refuses a split buffer whose tails share a byte with its heads, in any layer: the first such
// head row and tail row by name. Blocks whose spans meet are compared row by row (rows ascend
// within a block) from the first rows that reach the other block, until either passes its end, so
// the cost is the buffer's blocks, plus the rows where blocks interleave.
void check_heads_and_tails_apart(const LatentBuffer& b, std::int64_t n) {
  const RowTail& t = b.tail;
  // Every layer's heads lie alike; where its tails start (delta) is the layer's own.
  const auto heads = block_spans(b.rows, n, static_cast<std::uint64_t>(t.head_bytes), 0);
  for (std::size_t l = 0; l < b.tail_base.size(); ++l) {
    const std::int64_t delta =
        reinterpret_cast<std::intptr_t>(b.tail_base[l]) - reinterpret_cast<std::intptr_t>(b.layer_base[l]);
    const auto tails = block_spans(t.rows, n, static_cast<std::uint64_t>(t.bytes), delta);
    std::size_t i = 0, j = 0;
    while (i < heads.size() && j < tails.size()) {
      const BlockSpan& h = heads[i];
      const BlockSpan& u = tails[j];
      if (h.begin < u.end && u.begin < h.end) {
        const auto hs = static_cast<std::int64_t>(b.rows.row_stride), us = static_cast<std::int64_t>(t.rows.row_stride);
        std::int64_t p = first_row_ending_past(h.begin, hs, t.head_bytes, u.begin);
        std::int64_t q = first_row_ending_past(u.begin, us, t.bytes, h.begin);
        while (p < h.rows && q < u.rows) {
          const std::int64_t hb = h.begin + p * hs, he = hb + t.head_bytes;
          const std::int64_t ub = u.begin + q * us, ue = ub + t.bytes;
          if (hb >= u.end || ub >= h.end) break;  // past the other block: no row of it is left to meet
          ESS_CHECK(!(hb < ue && ub < he),
                    "offload: layer {}: row {}'s head, bytes [{}, {}) of the layer's buffer, and row {}'s tail, bytes "
                    "[{}, {}), overlap: the tails must lie apart from the heads",
                    l, h.first_row + p, hb, he, u.first_row + q, ub, ue);
          if (he <= ue) {
            ++p;
          } else {
            ++q;
          }
        }
      }
      if (h.end <= u.end) {
        ++i;
      } else {
        ++j;
      }
    }
  }
}

// A split buffer (LatentBuffer::tail_base): the cut within the entry, where the tails lie.
// `rows`: the buffer rows a layer holds (OffloadState::buffer_rows).
void check_split(LatentBuffer& b, const OffloadConfig& c, bool owned, std::int64_t rows) {
  const RowTail& t = b.tail;
  const std::uint64_t entry = c.layout.bytes();
  ESS_CHECK(!owned, "offload: a buffer split in two parts (tail_base) needs the caller's layer buffers (layer_base)");
  ESS_CHECK(static_cast<int>(b.tail_base.size()) == c.layers, "offload: {} tail buffers for {} layers", b.tail_base.size(),
            c.layers);
  ESS_CHECK(t.head_bytes > 0 && t.head_bytes % 16 == 0 && t.bytes > 0 && t.bytes % 8 == 0 &&
                static_cast<std::uint64_t>(t.head_bytes) + static_cast<std::uint64_t>(t.bytes) <= entry,
            "offload: a split entry's head of {} bytes and tail of {} must be a positive multiple of 16 and of 8 within "
            "the entry's {} bytes",
            t.head_bytes, t.bytes, entry);
  ESS_CHECK(t.rows.row_stride >= static_cast<std::uint64_t>(t.bytes) && t.rows.row_stride % 8 == 0 && t.rows.block_rows >= 0 &&
                (t.rows.block_rows == 0 ||
                 (t.rows.block_stride % 8 == 0 && t.rows.block_stride >= static_cast<std::uint64_t>(t.rows.block_rows) * t.rows.row_stride)),
            "offload: the tails' row_stride = {}, block_rows = {}, block_stride = {}: a multiple of 8 of at least the "
            "tail's {} bytes, blocks holding block_rows rows",
            t.rows.row_stride, t.rows.block_rows, t.rows.block_stride, t.bytes);
  for (std::size_t l = 0; l < b.tail_base.size(); ++l) {
    ESS_CHECK(b.tail_base[l] != nullptr && reinterpret_cast<std::uintptr_t>(b.tail_base[l]) % 8 == 0,
              "offload: the tail buffer of layer {} is null or not 8-byte aligned", l);
  }
  check_heads_and_tails_apart(b, rows);
  b.tail.head = b.rows;
  b.tail.delta = 0;
}

}  // namespace

RowTail LatentBuffer::tail_of(int layer) const {
  if (!split()) return {};
  RowTail t = tail;
  t.head = rows;
  const auto l = static_cast<std::size_t>(layer);
  t.delta = reinterpret_cast<std::intptr_t>(tail_base[l]) - reinterpret_cast<std::intptr_t>(layer_base[l]);
  return t;
}

Offload::Impl::Impl(const OffloadConfig& c, LatentBuffer b, HostAllocator& host) : OffloadState{c, std::move(b), {}, {}, {}, {}, {}, {}, {}} {
  config.validate();
  const std::uint64_t entry = config.layout.bytes();
  const bool owned = buffer.layer_base.empty();
  if (buffer.rows.row_stride == 0) buffer.rows.row_stride = entry;
  // A split buffer's rows hold only the heads.
  const std::uint64_t row_bytes = buffer.split() ? static_cast<std::uint64_t>(std::max(buffer.tail.head_bytes, 0)) : entry;
  ESS_CHECK(buffer.rows.row_stride >= row_bytes && buffer.rows.row_stride % 16 == 0,
            "offload: row_stride = {} must be a multiple of 16 of at least the {} bytes a row holds", buffer.rows.row_stride,
            row_bytes);
  ESS_CHECK(buffer.rows.block_rows >= 0, "offload: block_rows = {} is negative", buffer.rows.block_rows);
  if (buffer.rows.block_rows > 0) {
    ESS_CHECK(buffer.rows.block_stride >= static_cast<std::uint64_t>(buffer.rows.block_rows) * buffer.rows.row_stride &&
                  buffer.rows.block_stride % 16 == 0,
              "offload: block_stride = {} must be a multiple of 16 holding block_rows {} x row_stride {}",
              buffer.rows.block_stride, buffer.rows.block_rows, buffer.rows.row_stride);
  }
  if (!owned) {
    ESS_CHECK(static_cast<int>(buffer.layer_base.size()) == config.layers,
              "offload: {} layer buffers for {} layers", buffer.layer_base.size(), config.layers);
    for (std::size_t l = 0; l < buffer.layer_base.size(); ++l) {
      ESS_CHECK(buffer.layer_base[l] != nullptr && reinterpret_cast<std::uintptr_t>(buffer.layer_base[l]) % 16 == 0,
                "offload: the buffer of layer {} is null or not 16-byte aligned", l);
    }
  }
  if (config.region_blocks > 0) {
    const std::int64_t block_rows = buffer.rows.block_rows;
    ESS_CHECK(!owned, "offload: regions (region_blocks = {}) need the caller's paged buffer (layer_base)", config.region_blocks);
    ESS_CHECK(block_rows > 0 && buffer.blocks >= 1,
              "offload: regions need a paged buffer: block_rows = {} and blocks = {} must be positive", block_rows,
              buffer.blocks);
    ESS_CHECK(static_cast<std::int64_t>(config.rows_per_request()) <= config.region_blocks * block_rows,
              "offload: {} rows per request (slots {} + reserved {}) do not fit a region of {} blocks of {} rows",
              config.rows_per_request(), config.slots, config.rows_per_request() - config.slots, config.region_blocks,
              block_rows);
    ESS_CHECK(buffer.blocks <= (std::int64_t{1} << 31) / block_rows,
              "offload: {} blocks of {} rows exceed the int32 rows of a layer's buffer", buffer.blocks, block_rows);
  } else if (!owned && buffer.blocks > 0) {
    ESS_CHECK(static_cast<std::int64_t>(config.max_requests) * config.rows_per_request() <=
                  buffer.blocks * std::max<std::int64_t>(buffer.rows.block_rows, 1),
              "offload: {} requests x {} rows per request do not fit the buffer's {} blocks of {} rows",
              config.max_requests, config.rows_per_request(), buffer.blocks, buffer.rows.block_rows);
  }
  if (buffer.split()) {
    check_split(buffer, config, owned, buffer_rows());
  } else {
    ESS_CHECK(buffer.tail.head_bytes == 0 && buffer.tail.bytes == 0,
              "offload: a split entry ({} + {} bytes) without tail_base: give the tails' buffers, or leave tail empty",
              buffer.tail.head_bytes, buffer.tail.bytes);
  }
  if (config.foreign.enabled()) {
    ESS_CHECK(config.host_bytes == 0,
              "offload: host_bytes = {} with foreign pages (the pool is the other engine's: pass 0)", config.host_bytes);
    pool = std::make_unique<TotalPool>(config.layers, config.layout, config.foreign, HostMemoryKind::kPinned, host);
  } else {
    std::uint64_t host_bytes = config.host_bytes;
    if (host_bytes == 0) {  // every request at max_context, whole pages
      const bool overflow =
          __builtin_mul_overflow(static_cast<std::uint64_t>(config.max_requests), static_cast<std::uint64_t>(config.layers),
                                 &host_bytes) ||
          __builtin_mul_overflow(host_bytes, static_cast<std::uint64_t>((config.max_context + kPageTokens - 1) / kPageTokens),
                                 &host_bytes) ||
          __builtin_mul_overflow(host_bytes, kPageTokens * entry, &host_bytes);
      ESS_CHECK(!overflow,
                "offload: host_bytes = 0 asks for max_requests {} x layers {} x max_context {} entries, beyond 64 bits "
                "of bytes; pass host_bytes",
                config.max_requests, config.layers, config.max_context);
    }
    pool = std::make_unique<TotalPool>(config.layers, config.layout, host_bytes, HostMemoryKind::kPinned, host);
  }
  request_of_row.assign(static_cast<std::size_t>(config.max_requests), -1);
  units_of_row.assign(static_cast<std::size_t>(config.max_requests), {});
  borrower_of_row.assign(static_cast<std::size_t>(config.max_requests), -1);
  if (config.region_blocks > 0) {
    region.assign(static_cast<std::size_t>(config.region_groups()) * static_cast<std::size_t>(config.max_requests) *
                      static_cast<std::size_t>(config.region_blocks),
                  -1);
    row_of_block.assign(static_cast<std::size_t>(buffer.blocks), -1);
  }
  if (config.backend == Backend::kCuda) {
    const OffloadBackendFactory make_cuda = cuda_offload_factory();
    ESS_CHECK(make_cuda != nullptr, "offload: the CUDA backend is not part of this build (nvcc was not found when it was built)");
    // A device that is not there is the machine's failure (exit status 3 in the CLI), not a bad argument.
    if (config.device >= cuda_device_count()) {
      throw_device_error(fmt::format("offload: no CUDA device {} (found {})", config.device, cuda_device_count()));
    }
    ESS_CHECK(pool->memory_kind() == HostMemoryKind::kPinned,
              "offload: the host pool is {} memory; the CUDA backend reads it zero-copy and needs it pinned and mapped",
              to_string(pool->memory_kind()));
    backend = make_cuda(*this, owned);
  } else {
    backend = make_cpu_offload(*this, owned);
  }
}

Offload::Offload(const OffloadConfig& config, LatentBuffer buffer, HostAllocator& host)
    : impl_(std::make_unique<Impl>(config, std::move(buffer), host)) {}

Offload::~Offload() = default;

void Offload::set_lifecycle_stream(cuda::Stream stream) {
  impl_->usable("set_lifecycle_stream");
  impl_->device("set_lifecycle_stream", [&] { impl_->backend->set_lifecycle_stream(stream, true); });
}

void Offload::clear_lifecycle_stream() {
  impl_->usable("clear_lifecycle_stream");
  impl_->device("clear_lifecycle_stream", [&] { impl_->backend->set_lifecycle_stream(nullptr, false); });
}

std::int32_t Offload::admit(RequestId id, std::int64_t prompt_length, std::int32_t wanted_row) {
  impl_->usable("admit");
  return impl_->admit(id, prompt_length, wanted_row, [&] { impl_->pool->admit(id, prompt_length); });
}

std::int32_t Offload::admit_shared(RequestId id, std::int64_t prompt_length, RequestId source, std::int64_t prefix,
                                   std::int32_t row) {
  impl_->usable("admit_shared");
  impl_->find_row(source, "shared admission's source");
  // The last T tokens stay the request's own: a write-back may write them.
  const std::int64_t limit = std::max<std::int64_t>(0, prompt_length - impl_->config.query_tokens);
  return impl_->admit(id, prompt_length, row,
                      [&] { impl_->pool->admit_shared(id, prompt_length, source, prefix, limit); });
}

Offload::Admitted Offload::admit_cached(RequestId id, std::span<const std::int32_t> prompt_tokens, std::int32_t row) {
  impl_->usable("admit_cached");
  const std::vector<std::uint64_t> hashes = prefix_page_hashes(prompt_tokens);
  Admitted a;
  const std::int64_t limit = std::max<std::int64_t>(0, std::ssize(prompt_tokens) - impl_->config.query_tokens);
  a.row = impl_->admit(id, static_cast<std::int64_t>(prompt_tokens.size()), row, [&] {
    a.reused_tokens = impl_->pool->admit_cached(id, std::ssize(prompt_tokens), hashes, limit);
  });
  return a;
}

std::int64_t Offload::publish(RequestId id, std::span<const std::int32_t> prompt_tokens) {
  impl_->usable("publish");
  Impl& x = *impl_;
  x.find_row(id, "publish");
  const std::int64_t length = x.pool->length(id);
  ESS_CHECK(std::ssize(prompt_tokens) <= length, "offload: publish of request {}: {} prompt tokens, it holds {}", id,
            prompt_tokens.size(), length);
  std::vector<std::uint64_t> hashes = prefix_page_hashes(prompt_tokens);
  // Pages holding any of the request's last T tokens stay its own: a write-back may write them.
  const auto own = std::max<std::int64_t>(0, length - x.config.query_tokens) / kPageTokens;
  if (std::ssize(hashes) > own) hashes.resize(static_cast<std::size_t>(own));
  return x.pool->publish(id, hashes);
}

void Offload::Impl::retire_host(RequestId id) {
  const std::uint64_t fence = device("release", [&] { return backend->fence(); });
  if (fence == 0) {
    pool->release(id);
  } else {  // under an id no caller uses, so that the engine may admit `id` again at once
    const RequestId hidden = -(++retired_serial);
    retiring.reserve(retiring.size() + 1);  // the push below cannot throw once the pool changed
    pool->retire(id, hidden);
    retiring.push_back(Retiring{hidden, fence});
  }
  reap(false);  // earlier releases whose work has run since
}

void Offload::Impl::reap(bool wait) {
  device("release", [&] {
    std::erase_if(retiring, [&](const Retiring& r) {
      if (wait) backend->wait_fence(r.fence);
      if (!wait && !backend->fence_passed(r.fence)) return false;
      pool->release(r.id);
      return true;
    });
  });
}

void Offload::Impl::with_retired_pages(const std::function<void()>& take) {
  reap(false);
  if (retiring.empty()) {
    take();
    return;
  }
  // Retained prefix-cache pages are evicted only when the pages of every retiring request would not
  // be enough either, as if each release had freed its pages at once: without a wait first, then
  // after one.
  struct HeldOff {
    TotalPool& pool;
    explicit HeldOff(TotalPool& p) : pool(p) { pool.evict_when_full(false); }
    ~HeldOff() { pool.evict_when_full(true); }
  };
  try {
    const HeldOff held(*pool);
    take();
  } catch (const PoolFull&) {  // other refusals are the caller's input: nothing to wait for
    reap(true);
    take();
  }
}

void Offload::Impl::usable(const char* call) const {
  if (!broken.empty()) [[unlikely]] {
    throw_device_error(fmt::format("offload: {}: the engine is unusable since a device call failed ({}); destroy it", call,
                                   broken));
  }
}

std::int32_t Offload::Impl::admit(RequestId id, std::int64_t prompt_length, std::int32_t wanted_row,
                                  const std::function<void()>& pool_admit) {
  Impl& x = *this;
  ESS_CHECK(id >= 0, "offload: admit: request id {} is negative", id);
  ESS_CHECK(!x.row_of_request.contains(id), "offload: admit: request {} is already admitted", id);
  ESS_CHECK(prompt_length >= 1 && prompt_length <= x.config.max_context,
            "offload: admit of request {}: prompt length {} outside [1, max_context = {}]", id, prompt_length,
            x.config.max_context);
  const bool adaptive = x.config.residency == Residency::kAdaptive;
  // The row, and the whole request to demote first when the row is one it borrows (kAdaptive).
  std::int32_t row = -1, victim = -1;
  if (wanted_row < 0) {
    ESS_CHECK(wanted_row == -1, "offload: admit of request {}: row {} must be -1 (any) or in [0, {})", id, wanted_row,
              x.config.max_requests);
    for (std::int32_t r = 0; r < x.config.max_requests && row < 0; ++r) row = x.row_free(r) ? r : -1;
    if (row < 0 && adaptive && (victim = x.demotion_victim()) >= 0) {
      const auto& units = x.units_of_row[static_cast<std::size_t>(victim)];
      row = *std::min_element(units.begin() + 1, units.end());
    }
    ESS_CHECK(row >= 0, "offload: admit of request {}: all {} rows are taken", id, x.config.max_requests);
  } else {
    ESS_CHECK(wanted_row < x.config.max_requests, "offload: admit of request {}: row {} outside [0, {})", id, wanted_row,
              x.config.max_requests);
    const RequestId holder = x.request_of_row[static_cast<std::size_t>(wanted_row)];
    ESS_CHECK(holder == -1, "offload: admit of request {}: row {} holds request {}", id, wanted_row, holder);
    const std::int32_t borrower = x.borrower_of_row[static_cast<std::size_t>(wanted_row)];
    ESS_CHECK(borrower < 0 || adaptive,
              "offload: admit of request {}: row {} is borrowed by the whole request {} (residency whole)", id, wanted_row,
              borrower < 0 ? -1 : x.request_of_row[static_cast<std::size_t>(borrower)]);
    victim = borrower;
    row = wanted_row;
  }
  // Whole or sparse, decided on the rows free once `row` is taken (and the victim's given back).
  const std::int32_t need = x.config.whole_rows(prompt_length);
  const std::int32_t free_after =
      x.free_rows() - 1 + (victim >= 0 ? static_cast<std::int32_t>(x.units_of_row[static_cast<std::size_t>(victim)].size()) - 1 : 0);
  bool whole = false;
  if (x.config.residency == Residency::kWhole) {
    ESS_CHECK(need - 1 <= free_after,
              "offload: admit of request {}: whole residency of {} tokens needs {} pool rows, {} are free", id,
              prompt_length, need, free_after + 1);
    whole = true;
  } else if (adaptive) {
    whole = need == 1 || need - 1 + x.config.whole_headroom <= free_after;
  }
  x.with_retired_pages(pool_admit);  // throws, changing nothing, when the pages do not fit
  try {
    if (victim >= 0) x.demote(victim);
    x.device("admit", [&] {
      x.backend->admit(row, id);
      x.backend->pages_added(row, id, 0);
    });
  } catch (...) {
    x.pool->release(id);
    throw;
  }
  x.request_of_row[static_cast<std::size_t>(row)] = id;
  x.row_of_request.emplace(id, row);
  if (whole) x.make_whole(row, need - 1, /*load=*/false);  // its entries arrive, then warmup loads them
  return row;
}

void Offload::warmup(RequestId id, std::span<const std::int32_t> windows, int window_count) {
  impl_->usable("warmup");
  Impl& x = *impl_;
  const std::int32_t row = x.find_row(id, "warmup");
  x.check_placed(row, id, "warmup");
  const std::size_t K = static_cast<std::size_t>(x.config.topk);
  ESS_CHECK(window_count >= 0 &&
                windows.size() == static_cast<std::size_t>(x.config.layers) * static_cast<std::size_t>(window_count) * K,
            "offload: warmup of request {}: {} ids for [layers {}][windows {}][topk {}]", id, windows.size(),
            x.config.layers, window_count, K);
  const int W = std::min(window_count, x.config.warmup_windows);
  // Every id the warm-up replays is a token of the request (the CUDA backend looks it up in the
  // device page table unchecked): refused before anything changes.
  const std::int64_t length = x.pool->length(id);
  for (int l = 0; l < x.config.layers; ++l) {
    for (int w = window_count - W; w < window_count; ++w) {
      for (std::size_t k = 0; k < K; ++k) {
        const std::int32_t t = windows[(static_cast<std::size_t>(l) * static_cast<std::size_t>(window_count) +
                                        static_cast<std::size_t>(w)) * K + k];
        ESS_CHECK(t >= -1 && t < length,
                  "offload: warmup of request {}: layer {} window {} position {} selects token {}, outside [0, {}) "
                  "(-1 = padding)",
                  id, l, w, k, t, length);
      }
    }
  }
  std::vector<std::int32_t> last;  // [layers][W][K]: each layer's last W windows
  last.reserve(static_cast<std::size_t>(x.config.layers) * static_cast<std::size_t>(W) * K);
  for (int l = 0; l < x.config.layers; ++l) {
    const auto first = windows.begin() + static_cast<std::ptrdiff_t>(
                                             (static_cast<std::size_t>(l) * static_cast<std::size_t>(window_count) +
                                              static_cast<std::size_t>(window_count - W)) * K);
    last.insert(last.end(), first, first + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(W) * K));
  }
  x.device("warmup", [&] {
    if (x.whole(row)) {
      x.backend->load_whole(row, id, last, W);
    } else if (W > 0) {
      x.backend->warmup(row, id, last, W);
    }
    if (x.config.reserve_newest) x.backend->load_newest(row, id);
  });
}

void Offload::extend(RequestId id, std::int64_t n) {
  impl_->usable("extend");
  Impl& x = *impl_;
  const std::int32_t row = x.find_row(id, "extend");
  ESS_CHECK(n >= 1, "offload: extend of request {} by {} tokens: must be >= 1", id, n);
  const std::int64_t length = x.pool->length(id);
  ESS_CHECK(n <= x.config.max_context - length,  // length + n may overflow: not computed
            "offload: extend of request {} ({} tokens) by {} exceeds max_context = {}", id, length, n,
            x.config.max_context);
  x.check_growth(row, length + n, "extend");  // kWhole: refused here when the rows are not free
  const auto pages_before = std::ssize(x.pool->page_table(id, 0));  // per layer
  x.with_retired_pages([&] { x.pool->extend(id, n); });
  x.device("extend", [&] { x.backend->pages_added(row, id, pages_before); });
  x.grow_whole(row, length + n);
}

void Offload::truncate(RequestId id, std::int64_t length) {
  impl_->usable("truncate");
  Impl& x = *impl_;
  x.find_row(id, "truncate");
  ESS_CHECK(x.config.reserve_newest,
            "offload: truncate of request {} needs reserve_newest (the tokens taken back must be outside the LRU)", id);
  const std::int64_t current = x.pool->length(id);
  const std::int64_t lowest = std::max<std::int64_t>(0, current - x.config.query_tokens);
  ESS_CHECK(length >= lowest && length <= current,
            "offload: truncate of request {} to {} tokens: outside [{}, {}] (its length less at most T = {})", id, length,
            lowest, current, x.config.query_tokens);
  // The entries taken back are zeroed and their pages freed on the host: after the lifecycle
  // work enqueued so far (a write-back of them may be pending on an ordered lifecycle stream).
  x.device("truncate", [&] { x.backend->wait_fence(x.backend->fence()); });
  x.pool->truncate(id, length);
}

std::int32_t Offload::adopt(RequestId id, std::int64_t length, std::span<const std::int32_t> pages, std::int32_t row) {
  impl_->usable("adopt");
  return impl_->admit(id, length, row, [&] { impl_->pool->adopt(id, length, pages); });
}

void Offload::repage(RequestId id, std::int64_t length, std::int64_t first_page, std::span<const std::int32_t> pages) {
  impl_->usable("repage");
  Impl& x = *impl_;
  const std::int32_t row = x.find_row(id, "repage");
  ESS_CHECK(x.pool->foreign(),
            "offload: repage of request {}: the pool hands out its own pages (no foreign pages): extend and truncate",
            id);
  const std::int64_t current = x.pool->length(id);
  ESS_CHECK(length >= 1 && length <= x.config.max_context, "offload: repage of request {} to {} tokens: outside [1, max_context = {}]",
            id, length, x.config.max_context);
  if (length < current) {
    ESS_CHECK(x.config.reserve_newest,
              "offload: repage of request {} from {} to {} tokens needs reserve_newest (the tokens taken back must be "
              "outside the LRU)",
              id, current, length);
    ESS_CHECK(length >= current - x.config.query_tokens,
              "offload: repage of request {} from {} to {} tokens takes back more than T = {}", id, current, length,
              x.config.query_tokens);
  }
  // The pages that may change (layer 0's, from first_page on; the pool checks first_page), to
  // find the first whose id does: the device page table is uploaded from there.
  x.check_growth(row, length, "repage");  // kWhole: refused here when the rows are not free
  const auto old = x.pool->page_table(id, 0);
  const std::vector<std::int32_t> tail(old.begin() + std::clamp<std::int64_t>(first_page, 0, std::ssize(old)), old.end());
  x.pool->repage(id, length, first_page, pages);  // checks the rest; throws changing nothing
  const auto now = x.pool->page_table(id, 0);
  std::size_t changed = 0;
  while (changed < tail.size() && static_cast<std::size_t>(first_page) + changed < now.size() &&
         tail[changed] == now[static_cast<std::size_t>(first_page) + changed]) {
    ++changed;
  }
  x.device("repage", [&] { x.backend->pages_added(row, id, first_page + static_cast<std::int64_t>(changed)); });
  x.grow_whole(row, length);
}

void Offload::release(RequestId id) {
  impl_->usable("release");
  Impl& x = *impl_;
  const std::int32_t row = x.find_row(id, "release");
  x.device("release", [&] { x.backend->release(row, id); });
  x.free_region(row);
  x.retire_host(id);
  x.give_back(row);
  x.request_of_row[static_cast<std::size_t>(row)] = -1;
  x.row_of_request.erase(id);
  x.promote_waiting();
}

void Offload::reset(RequestId id) {
  impl_->usable("reset");
  Impl& x = *impl_;
  const std::int32_t row = x.find_row(id, "reset");
  x.device("reset", [&] {
    x.backend->reset(row, id);
    if (x.whole(row)) x.backend->load_whole(row, id, {}, 0);  // rows the engine may have reused: read again
  });
}

void Offload::Impl::free_region(std::int32_t row) {
  if (region.empty()) return;
  const auto n = static_cast<std::size_t>(config.region_blocks);
  for (int g = 0; g < config.region_groups(); ++g) {
    const std::size_t at = region_at(g, row);
    for (std::size_t i = at; i < at + n; ++i) {
      if (region[i] >= 0) row_of_block[static_cast<std::size_t>(region[i])] = -1;
      region[i] = -1;
    }
  }
}

void Offload::place(RequestId id, std::span<const std::int32_t> blocks) {
  impl_->usable("place");
  Impl& x = *impl_;
  const std::int32_t row = x.find_row(id, "place");
  const std::int32_t n = x.config.region_blocks;
  ESS_CHECK(n > 0, "offload: place of request {}: the engine has no regions (region_blocks = 0)", id);
  const int groups = x.config.region_groups();
  ESS_CHECK(std::ssize(blocks) == static_cast<std::int64_t>(groups) * n,
            "offload: place of request {}: {} blocks for {} region group(s) of {}", id, blocks.size(), groups, n);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const std::int32_t k = blocks[i];
    ESS_CHECK(k >= 0 && k < x.buffer.blocks, "offload: place of request {}: block {} of its region is {}, outside [0, {})",
              id, i, k, x.buffer.blocks);
    const std::int32_t holder = x.row_of_block[static_cast<std::size_t>(k)];
    ESS_CHECK(holder < 0 || holder == row,
              "offload: place of request {}: block {} ({} of its region) lies in the region of request {} (row {})", id, k,
              i, x.request_of_row[static_cast<std::size_t>(holder)], holder);
    for (std::size_t j = 0; j < i; ++j) {
      ESS_CHECK(blocks[j] != k, "offload: place of request {}: block {} is named twice ({} and {} of its region)", id, k, j,
                i);
    }
  }
  x.free_region(row);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    x.region[x.region_at(static_cast<int>(i / static_cast<std::size_t>(n)), row) + i % static_cast<std::size_t>(n)] = blocks[i];
    x.row_of_block[static_cast<std::size_t>(blocks[i])] = row;
  }
  x.device("place", [&] {
    x.backend->placed(row, id);
    if (x.config.reserve_newest) x.backend->load_newest(row, id);
  });
}

std::int32_t Offload::buffer_row(int layer, std::int32_t row, std::int32_t slot) const {
  impl_->usable("buffer_row");
  const Impl& x = *impl_;
  ESS_CHECK(layer >= 0 && layer < x.config.layers, "offload: buffer_row: layer {} outside [0, {})", layer, x.config.layers);
  ESS_CHECK(row >= 0 && row < x.config.max_requests, "offload: buffer_row: row {} outside [0, {})", row, x.config.max_requests);
  ESS_CHECK(slot >= 0 && slot < x.config.rows_per_request(), "offload: buffer_row: slot {} outside [0, {}) (rows per request)",
            slot, x.config.rows_per_request());
  return x.pool_rows(layer).at(row, slot);
}

bool Offload::whole(RequestId id) const {
  impl_->usable("whole");
  return impl_->whole(impl_->find_row(id, "whole"));
}

std::vector<std::int32_t> Offload::whole_units(RequestId id) const {
  impl_->usable("whole_units");
  const std::int32_t row = impl_->find_row(id, "whole_units");
  const auto& units = impl_->units_of_row[static_cast<std::size_t>(row)];
  return units.empty() ? std::vector<std::int32_t>{row} : units;
}

std::int32_t Offload::row(RequestId id) const {
  impl_->usable("row");
  return impl_->find_row(id, "row");
}

std::int64_t Offload::length(RequestId id) const {
  impl_->usable("length");
  impl_->find_row(id, "length");
  return impl_->pool->length(id);
}

std::span<std::uint8_t> Offload::host_entry(RequestId id, int layer, std::int64_t token) {
  impl_->usable("host_entry");
  impl_->find_row(id, "host_entry");
  return impl_->pool->writable_entry(id, layer, token);  // checks layer and token, refuses shared pages
}

void Offload::step(const LayerStep& s) {
  impl_->usable("step");
  const Impl& x = *impl_;
  ESS_CHECK(s.layer >= 0 && s.layer < x.config.layers, "offload: step: layer {} outside [0, {})", s.layer, x.config.layers);
  ESS_CHECK(s.batch >= 0 && s.batch <= x.config.max_requests, "offload: step of layer {}: batch {} outside [0, {}]",
            s.layer, s.batch, x.config.max_requests);
  if (s.batch == 0) return;
  ESS_CHECK(s.rows != nullptr && s.topk != nullptr && s.lengths != nullptr && s.physical != nullptr,
            "offload: step of layer {}: rows, topk, lengths and physical are required", s.layer);
  const bool any_split = s.resident != nullptr || s.fetched != nullptr || s.resident_count != nullptr ||
                         s.fetched_count != nullptr;
  ESS_CHECK(!any_split || (s.resident != nullptr && s.fetched != nullptr && s.resident_count != nullptr &&
                           s.fetched_count != nullptr),
            "offload: step of layer {}: resident, fetched and their counts go together", s.layer);
  ESS_CHECK((s.copy_stream == nullptr) == (s.copy_done == nullptr),
            "offload: step of layer {}: copy_stream and copy_done go together (attention must wait for the copy)",
            s.layer);
  ESS_CHECK(s.part >= 0 && s.part < kParts, "offload: step of layer {}: part {} outside [0, {})", s.layer, s.part, kParts);
  ESS_CHECK((s.query_begin == 0 && s.query_end == 0) ||
                (s.query_begin >= 0 && s.query_begin < s.query_end && s.query_end <= x.config.query_tokens),
            "offload: step of layer {}: query group [{}, {}) is not a non-empty range of the {} query tokens "
            "(0, 0 = all)",
            s.layer, s.query_begin, s.query_end, x.config.query_tokens);
  if (s.query_end == 0) {
    LayerStep all = s;
    all.query_end = x.config.query_tokens;
    impl_->device("step", [&] { impl_->backend->step(all); });
  } else {
    impl_->device("step", [&] { impl_->backend->step(s); });
  }
}

std::vector<int> Offload::query_groups(int batch, const std::int32_t* rows, const std::int32_t* topk,
                                       const std::int32_t* lengths) const {
  impl_->usable("query_groups");
  const Impl& x = *impl_;
  const int T = x.config.query_tokens, K = x.config.topk;
  ESS_CHECK(batch >= 0 && batch <= x.config.max_requests, "offload: query_groups: batch {} outside [0, {}]", batch,
            x.config.max_requests);
  ESS_CHECK(batch == 0 || (rows != nullptr && topk != nullptr && lengths != nullptr),
            "offload: query_groups: rows, topk and lengths are required");
  const std::size_t P = static_cast<std::size_t>(T) * K;
  std::vector<std::int32_t> ids(P);
  QueryGrouper grouper;
  GroupStarts starts = 0;
  for (int b = 0; b < batch; ++b) {
    if (x.padding(rows[b], "query_groups", b)) continue;
    const RequestId request = x.request_at(rows[b], "query_groups", b);
    const std::int32_t len = lengths[b];
    x.check_step_length("query_groups", -1, b, request, len);
    const bool whole = x.whole(rows[b]);  // no slots to fit: its ids are only checked
    for (std::size_t i = 0; i < P; ++i) {
      const std::int32_t id = topk[static_cast<std::size_t>(b) * P + i];
      ESS_CHECK(id >= -1 && id < len, "offload: query_groups: position {} query token {} selects token {}, outside [0, {})",
                b, i / static_cast<std::size_t>(K), id, len);
      ids[i] = x.config.reserve_newest && id >= len - T ? -1 : id;
    }
    // Sub-ranges of a position's groups fit it too, so the union of every position's group
    // starts serves the whole batch.
    if (T > 1 && !whole) starts |= grouper.split(ids, T, K, x.config.slots);
  }
  return group_bounds(starts, T);
}

void Offload::write_back(const WriteBack& w) {
  impl_->usable("write_back");
  const Impl& x = *impl_;
  ESS_CHECK(w.layer >= 0 && w.layer < x.config.layers, "offload: write_back: layer {} outside [0, {})", w.layer,
            x.config.layers);
  ESS_CHECK(w.batch >= 0 && w.batch <= x.config.max_requests, "offload: write_back of layer {}: batch {} outside [0, {}]",
            w.layer, w.batch, x.config.max_requests);
  if (w.batch == 0) return;
  ESS_CHECK(w.rows != nullptr && w.lengths != nullptr, "offload: write_back of layer {}: rows and lengths are required",
            w.layer);
  ESS_CHECK(w.source_rows != nullptr || x.config.reserve_newest,
            "offload: write_back of layer {}: without reserve_newest the source rows are required", w.layer);
  impl_->device("write_back", [&] { impl_->backend->write_back(w); });
}

const OffloadConfig& Offload::config() const { return impl_->config; }
const TotalPool& Offload::host_pool() const { return *impl_->pool; }
const LatentBuffer& Offload::buffer() const { return impl_->buffer; }

std::uint64_t Offload::device_bytes() const { return impl_->backend->device_bytes(); }

std::vector<std::uint8_t> Offload::read_row(int layer, std::int32_t p) const {
  impl_->usable("read_row");
  const Impl& x = *impl_;
  ESS_CHECK(layer >= 0 && layer < x.config.layers, "offload: read_row: layer {} outside [0, {})", layer, x.config.layers);
  ESS_CHECK(p >= 0 && static_cast<std::int64_t>(p) < x.buffer_rows(), "offload: read_row: row {} outside the layer's {} rows", p,
            x.buffer_rows());
  return impl_->device("read_row", [&] { return x.backend->read_row(layer, p); });
}

OffloadStats Offload::stats() const {
  const Impl& x = *impl_;
  OffloadStats st;
  const TotalPoolAccount a = x.pool->account();
  st.host_bytes_used = x.pool->used_bytes();
  st.host_bytes_capacity = x.pool->capacity_bytes();
  st.host_bytes_shared = a.shared_bytes;
  st.host_bytes_retained = a.retained_bytes;
  st.host_bytes_unshared = a.unshared_bytes;
  st.requests = static_cast<std::int32_t>(x.row_of_request.size());
  for (const auto& units : x.units_of_row) st.whole_requests += units.empty() ? 0 : 1;
  st.demotions = x.demotions;
  st.promotions = x.promotions;
  if (x.broken.empty()) {
    x.device("stats", [&] { x.backend->add_stats(st, true); });
  } else {
    x.backend->add_stats(st, false);
  }
  return st;
}

}  // namespace ess
