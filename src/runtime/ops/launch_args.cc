#include "runtime/ops/launch_args.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <utility>

#include "runtime/ops/sparse_mla/mma_layout.h"

namespace ess::cuda {
namespace {

bool aligned(const void* p, std::uintptr_t n) { return reinterpret_cast<std::uintptr_t>(p) % n == 0; }

// The first failed condition's message, in the order given.
class Checks {
 public:
  explicit Checks(const char* what) : what_(what) {}
  template <typename... Args>
  Checks& require(bool ok, fmt::format_string<Args...> message, Args&&... args) {
    if (!ok && error_.empty()) error_ = fmt::format("{}: {}", what_, fmt::format(message, std::forward<Args>(args)...));
    return *this;
  }
  Checks& not_null(const void* p, const char* field) { return require(p != nullptr, "{} is null", field); }
  Checks& aligned_to(const void* p, std::uintptr_t n, const char* field) {
    return require(aligned(p, n), "{} = {} is not {}-byte aligned", field, p, n);
  }
  std::string error() const { return error_; }

 private:
  const char* what_;
  std::string error_;
};

}  // namespace

std::string check_args(const EntryCopy& c) {
  Checks k("FlashTrans");
  k.require(c.count >= 0, "count = {} is negative", c.count)
      .require(c.blocks >= 0, "blocks = {} is negative", c.blocks)
      .require(c.threads == 0 || (c.threads >= 32 && c.threads <= kFlashTransDefaultThreads && c.threads % 32 == 0),
               "threads = {} must be 0 (default) or a multiple of 32 in [32, {}]", c.threads, kFlashTransDefaultThreads);
  if (c.count == 0) return k.error();
  k.require(c.entry_bytes > 0 && c.entry_bytes % 16 == 0, "entry_bytes = {} must be a positive multiple of 16",
            c.entry_bytes)
      .not_null(c.src_base, "src_base")
      .not_null(c.dst_base, "dst_base")
      .not_null(c.src_offsets, "src_offsets")
      .not_null(c.dst_offsets, "dst_offsets")
      .aligned_to(c.src_base, 16, "src_base")
      .aligned_to(c.dst_base, 16, "dst_base");
  if (c.split()) {
    const RowTail& t = c.tail();
    k.require(t.head_bytes % 16 == 0 && t.bytes > 0 && t.bytes % 8 == 0 && t.head_bytes + t.bytes <= c.entry_bytes,
              "a split entry's head of {} bytes and tail of {} must be a multiple of 16 and a positive multiple of 8 "
              "within entry_bytes = {}",
              t.head_bytes, t.bytes, c.entry_bytes)
        .require(!c.src_tail.split() || !c.dst_tail.split() ||
                     (c.src_tail.head_bytes == c.dst_tail.head_bytes && c.src_tail.bytes == c.dst_tail.bytes),
                 "src_tail and dst_tail cut the entry differently ({} + {} and {} + {} bytes)", c.src_tail.head_bytes,
                 c.src_tail.bytes, c.dst_tail.head_bytes, c.dst_tail.bytes);
    for (const auto& [side, name] : {std::pair{&c.src_tail, "src_tail"}, std::pair{&c.dst_tail, "dst_tail"}}) {
      if (!side->split()) continue;
      k.require(side->head.row_stride >= static_cast<std::uint64_t>(side->head_bytes) && side->head.row_stride % 16 == 0 &&
                    (side->head.block_rows <= 0 || side->head.block_stride > 0),
                "{}: the heads' row_stride = {} must be a multiple of 16 of at least the head's {} bytes", name,
                side->head.row_stride, side->head_bytes)
          .require(side->rows.row_stride >= static_cast<std::uint64_t>(side->bytes) && side->rows.row_stride % 8 == 0 &&
                       side->rows.block_stride % 8 == 0 && side->delta % 8 == 0,
                   "{}: the tails' row_stride = {}, block_stride = {} and delta = {} must be multiples of 8 (row_stride of "
                   "at least the tail's {} bytes)",
                   name, side->rows.row_stride, side->rows.block_stride, side->delta, side->bytes);
    }
  }
  if (c.entry_bytes > 0 && c.units_per_entry() > 0) {  // the kernel splits a unit index into (entry, unit) in 32 bits
    const std::int64_t units = c.units_per_entry();
    k.require(c.count <= static_cast<std::int64_t>(UINT32_MAX) / units,
              "count = {} entries of {} bytes is {} copy units (16-byte chunks, 8-byte tail units), more than the {} "
              "one launch addresses",
              c.count,
              c.entry_bytes, c.count > INT64_MAX / units ? INT64_MAX : c.count * units, UINT32_MAX);
  }
  return k.error();
}

FlashTransGrid flashtrans_grid(const EntryCopy& c) {
  FlashTransGrid g;
  g.threads = c.threads > 0 ? c.threads : kFlashTransDefaultThreads;
  const std::int64_t cap = c.blocks > 0 ? c.blocks : kFlashTransDefaultBlocks;
  const std::int64_t chunks = c.count * (c.entry_bytes > 0 ? c.units_per_entry() : 0);
  const std::int64_t per_block = static_cast<std::int64_t>(g.threads) * kFlashTransChunksPerThread;
  const std::int64_t want = (chunks + per_block - 1) / per_block;
  g.blocks = static_cast<int>(want < 1 ? 1 : (want < cap ? want : cap));
  return g;
}

std::string check_args(const SparseMlaArgs& a) {
  Checks k("sparse MLA decode");
  k.require(a.batch >= 0, "batch = {} is negative", a.batch)
      .require(a.query_tokens >= 1, "query_tokens = {} must be >= 1", a.query_tokens)
      .require(a.topk >= 1, "topk = {} must be >= 1", a.topk)
      .require(a.heads > 0 && a.heads % mla::kHeadsPerCta == 0 && a.heads <= 128,
               "heads = {} must be {} or 128", a.heads, mla::kHeadsPerCta)
      .require(a.softmax_scale > 0.0f && std::isfinite(a.softmax_scale), "softmax_scale = {} must be positive and finite",
               a.softmax_scale)
      .require(a.slots >= 0, "slots = {} is negative", a.slots)
      .not_null(a.q, "q")
      .not_null(a.kv, "kv")
      .not_null(a.kv_offsets, "kv_offsets")
      .not_null(a.indices, "indices")
      .not_null(a.lse, "lse")
      .aligned_to(a.q, 16, "q")
      .aligned_to(a.kv, 16, "kv")
      .aligned_to(a.out, 4, "out")
      .aligned_to(a.out_f32, 8, "out_f32")
      .require(static_cast<long long>(a.batch) * a.query_tokens * (a.heads / mla::kHeadsPerCta) <= INT_MAX,
               "batch {} x query_tokens {} x head blocks {} exceeds a grid", a.batch, a.query_tokens,
               a.heads / mla::kHeadsPerCta);
  return k.error();
}

std::string check_args(const MergeArgs& a) {
  Checks k("merge of partial states");
  k.require(a.rows >= 0, "rows = {} is negative", a.rows)
      .require(a.dim > 0 && a.dim % 4 == 0, "dim = {} must be a positive multiple of 4", a.dim)
      .not_null(a.o_a, "o_a")
      .not_null(a.lse_a, "lse_a")
      .not_null(a.o_b, "o_b")
      .not_null(a.lse_b, "lse_b")
      .aligned_to(a.o_a, 16, "o_a")
      .aligned_to(a.o_b, 16, "o_b")
      .aligned_to(a.out_f32, 16, "out_f32")
      .aligned_to(a.out, 8, "out");
  return k.error();
}

std::string check_args(const IndexerArgs& a) {
  Checks k("indexer logits");
  k.require(a.batch >= 0 && a.batch <= 65535, "batch = {} must be in [0, 65535]", a.batch);
  if (a.batch == 0) return k.error();
  k.require(a.query_tokens >= 1, "query_tokens = {} must be >= 1", a.query_tokens)
      .require(a.heads >= 16 && a.heads <= 64 && a.heads % 16 == 0, "heads = {} must be a multiple of 16 in [16, 64]",
               a.heads)
      .require(a.head_dim == 128, "head_dim = {} must be 128", a.head_dim)
      .require(a.max_pages >= 0, "max_pages = {} is negative", a.max_pages)
      .require(a.logits_stride > 0, "logits_stride = {} must be positive", a.logits_stride)
      .not_null(a.q, "q")
      .not_null(a.weights, "weights")
      .not_null(a.pages, "pages")
      .not_null(a.page_table, "page_table")
      .not_null(a.lengths, "lengths")
      .not_null(a.logits, "logits")
      .aligned_to(a.q, 16, "q")
      .aligned_to(a.pages, 16, "pages");
  return k.error();
}

std::string check_args(const TopkArgs& a) {
  Checks k("top-k");
  k.require(a.rows >= 0 && a.rows <= INT_MAX, "rows = {} must be in [0, 2^31)", a.rows);
  if (a.rows == 0) return k.error();
  k.require(a.k >= 1 && a.k <= 2048, "k = {} must be in [1, 2048]", a.k)
      .require(a.stride > 0 && a.stride <= INT_MAX, "stride = {} must be in [1, 2^31)", a.stride)
      .not_null(a.logits, "logits")
      .not_null(a.lengths, "lengths")
      .not_null(a.out, "out");
  return k.error();
}

std::string check_args(const GpuSwapConfig& c) {
  Checks k("gpu swap engine");
  k.require(c.rows > 0 && c.layers > 0 && c.slots > 0 && c.max_positions > 0,
            "rows {}, layers {}, slots {}, max_positions {} must be positive", c.rows, c.layers, c.slots,
            c.max_positions)
      .require(c.device >= 0, "device = {} is negative", c.device)
      .require(c.cluster == 0 || c.cluster == 1 || c.cluster == 2 || c.cluster == 4 || c.cluster == 8,
               "cluster = {} must be 0 (by the step), 1, 2, 4 or 8 (blocks per request)", c.cluster);
  return k.error();
}

std::string check_args(const GpuSwapConfig& c, const GpuSwapStep& s) {
  if (std::string e = check_args(c); !e.empty()) return e;
  Checks k("gpu swap engine step");
  k.require(s.layer >= 0 && s.layer < c.layers, "layer {} out of [0, {})", s.layer, c.layers)
      .require(s.batch >= 0 && s.batch <= c.rows, "batch = {} must be in [0, {}] (the engine's rows)", s.batch, c.rows)
      .require(s.query_tokens > 0 && s.topk > 0 &&
                   static_cast<long long>(s.query_tokens) * s.topk <= c.max_positions,
               "T {} x K {} exceeds the {} positions the engine was built for", s.query_tokens, s.topk,
               c.max_positions);
  if (s.batch == 0) return k.error();
  k.not_null(s.rows, "rows")
      .not_null(s.ids, "ids")
      .not_null(s.slot_ids, "slot_ids")
      .not_null(s.fill_tokens, "fill_tokens")
      .not_null(s.fill_slots, "fill_slots")
      .not_null(s.counts, "counts");
  if (s.page_table != nullptr) {
    k.not_null(s.fill_host_offsets, "fill_host_offsets (a page table is given)")
        .require(s.max_pages > 0 && s.page_bytes > 0 && s.entry_bytes > 0,
                 "max_pages {}, page_bytes {}, entry_bytes {} must be positive with a page table", s.max_pages,
                 s.page_bytes, s.entry_bytes);
  }
  return k.error();
}

double sparse_mla_flops(int batch, int query_tokens, int heads, int topk) {
  return static_cast<double>(batch) * query_tokens * heads * topk * 2.0 * (mla::kQkDim + mla::kNopeDim);
}

double indexer_flops(double keys, int heads, int head_dim) {
  // The dot products: 2 FLOP per (key, head, dim); ReLU, weights and scale are O(heads).
  return 2.0 * keys * heads * head_dim;
}

int swap_hash_capacity(int positions) {
  int h = kSwapMaxCluster;  // at least one entry per block of the largest cluster
  while (h < 2 * positions) h <<= 1;
  return h;
}

std::size_t swap_step_smem_bytes(int positions, std::int32_t slots, int ranks) {
  const auto r = static_cast<std::size_t>(ranks);
  const std::size_t hash = static_cast<std::size_t>(swap_hash_capacity(positions)) / r;
  const std::size_t misses = (static_cast<std::size_t>(positions) + r - 1) / r;
  const std::size_t flags = (static_cast<std::size_t>(slots) + r - 1) / r;
  return (2 * hash + misses + (ranks > 1 ? 1 : 0)) * 4 + flags;
}

int swap_cluster_size(int batch, int positions, std::int32_t slots, int multiprocessors, int max_cluster) {
  const int most = std::min(max_cluster, kSwapMaxCluster);
  const long long items = static_cast<long long>(positions) + slots;
  int ranks = 1;
  while (2 * ranks <= most && static_cast<long long>(batch) * 2 * ranks <= static_cast<long long>(multiprocessors) &&
         items >= 2LL * ranks * kSwapStepThreads) {
    ranks *= 2;
  }
  return ranks;
}

}  // namespace ess::cuda
