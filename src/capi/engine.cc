// The C ABI's library, engine and request calls: ess::Offload behind an opaque handle.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <limits>
#include <span>

#include <nlohmann/json.hpp>

#include "capi/capi_internal.h"
#include "ess/model/model_spec.h"
#include "ess/runtime/backend.h"
#include "ess/version.h"

namespace ess::capi {
namespace {

thread_local std::string g_last_error;

ModelSpec model_of(const ess_config& c) {
  ESS_CHECK(c.model_path == nullptr || c.model_json == nullptr,
            "config: model_path and model_json are both given; pass one");
  if (c.model_path != nullptr) return ModelSpec::from_file(c.model_path);
  if (c.model_json != nullptr) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(c.model_json);
    } catch (const nlohmann::json::exception& e) {
      ESS_THROW("config: model_json is not JSON: {}", e.what());
    }
    return ModelSpec::from_json(j, "config.model_json");
  }
  return ModelSpec::deepseek_v32_exp();
}

OffloadConfig offload_config(const ess_config& c) {
  const ModelSpec model = model_of(c);
  ESS_CHECK(c.policy == ESS_POLICY_LRU,
            "config: policy = {} is not supported by the per-layer step (ESS_POLICY_LRU = {}; `ess trace analyze` "
            "compares the other policies on traces)",
            c.policy, static_cast<int>(ESS_POLICY_LRU));
  ESS_CHECK(c.backend == ESS_BACKEND_CPU || c.backend == ESS_BACKEND_CUDA,
            "config: backend = {} is neither ESS_BACKEND_CPU (0) nor ESS_BACKEND_CUDA (1)", c.backend);
  ESS_CHECK(c.layers >= 0, "config: layers = {} is negative (0: the model's {})", c.layers,
            model.offloaded_layers().size());
  ESS_CHECK(c.topk >= 0, "config: topk = {} is negative (0: the model's {})", c.topk, model.index_topk);
  ESS_CHECK(c.slots >= 0, "config: slots = {} is negative", c.slots);
  ESS_CHECK(std::isfinite(c.ratio) && c.ratio >= 0 && c.ratio <= 1, "config: ratio = {} must be in [0, 1]", c.ratio);
  ESS_CHECK(c.slots == 0 || c.ratio == 0, "config: slots = {} and ratio = {} are both given; pass one", c.slots,
            c.ratio);
  ESS_CHECK(c.slots > 0 || c.ratio > 0, "config: neither slots nor ratio is given");
  ESS_CHECK(c.max_context >= 1, "config: max_context = {} must be >= 1", c.max_context);
  ESS_CHECK(c.reserve_newest == 0 || c.reserve_newest == 1, "config: reserve_newest = {} must be 0 or 1",
            c.reserve_newest);
  OffloadConfig o = OffloadConfig::for_model(model, c.max_requests, c.slots, c.max_context, c.query_tokens);
  if (c.layers > 0) o.layers = c.layers;
  if (c.topk > 0) o.topk = c.topk;
  if (c.slots == 0) {
    const double slots = std::ceil(c.ratio * static_cast<double>(c.max_context));
    ESS_CHECK(slots <= static_cast<double>(std::numeric_limits<std::int32_t>::max()),
              "config: ratio {} of max_context {} gives {} slots, beyond int32", c.ratio, c.max_context, slots);
    o.slots = static_cast<std::int32_t>(slots);
  }
  o.reserve_newest = c.reserve_newest != 0;
  ESS_CHECK(c.residency >= ESS_RESIDENCY_SPARSE && c.residency <= ESS_RESIDENCY_ADAPTIVE,
            "config: residency = {} is not ESS_RESIDENCY_SPARSE, _WHOLE or _ADAPTIVE", c.residency);
  o.residency = static_cast<Residency>(c.residency);
  o.whole_headroom = c.whole_headroom;
  o.region_blocks = c.region_blocks;
  o.warmup_windows = c.warmup_windows;
  o.backend = c.backend == ESS_BACKEND_CUDA ? Backend::kCuda : Backend::kCpu;
  o.device = c.device;
  o.copy_blocks = c.copy_blocks;
  o.host_bytes = c.host_bytes;
  if (o.backend == Backend::kCuda) {
    if (!cuda_backend_built()) {
      throw StatusError(ESS_ERROR_UNAVAILABLE,
                        "config: backend CUDA, but this library was built without the CUDA backend (no nvcc)");
    }
    const int devices = cuda_device_count();
    if (c.device < 0 || c.device >= devices) {
      throw StatusError(ESS_ERROR_UNAVAILABLE, fmt::format("config: no CUDA device {} (found {})", c.device, devices));
    }
  }
  // The rows of a request-layer are int32 (OffloadConfig::rows_per_request): refused here by name
  // rather than wrapped.
  const std::int64_t rows = static_cast<std::int64_t>(o.slots) + (o.reserve_newest ? o.query_tokens : 0);
  ESS_CHECK(rows <= std::numeric_limits<std::int32_t>::max(),
            "config: slots = {}{} rows per request exceed int32 (at most {})", o.slots,
            o.reserve_newest ? fmt::format(" + query_tokens {} reserved", o.query_tokens) : "",
            std::numeric_limits<std::int32_t>::max());
  o.validate();
  return o;
}


}  // namespace

void set_last_error(const std::string& message) { g_last_error = message; }

}  // namespace ess::capi

using ess::capi::guard;

extern "C" {

int ess_abi_version(void) { return ESS_ABI_VERSION; }
const char* ess_version(void) { return ESS_VERSION; }
const char* ess_last_error(void) { return ess::capi::g_last_error.c_str(); }
int ess_cuda_built(void) { return ess::cuda_backend_built() ? 1 : 0; }
int ess_cuda_device_count(void) { return ess::cuda_device_count(); }

const char* ess_status_name(ess_status status) {
  switch (status) {
    case ESS_OK: return "ESS_OK";
    case ESS_ERROR_INVALID_ARGUMENT: return "ESS_ERROR_INVALID_ARGUMENT";
    case ESS_ERROR_OUT_OF_MEMORY: return "ESS_ERROR_OUT_OF_MEMORY";
    case ESS_ERROR_UNAVAILABLE: return "ESS_ERROR_UNAVAILABLE";
    case ESS_ERROR_DEVICE: return "ESS_ERROR_DEVICE";
    case ESS_ERROR_INTERNAL: return "ESS_ERROR_INTERNAL";
  }
  return "unknown ess_status";
}

void ess_config_init(ess_config* c) {
  if (c == nullptr) return;
  ess::capi::init_struct(c);
  c->query_tokens = 1;
  c->warmup_windows = 32;
  c->policy = ESS_POLICY_LRU;
  c->backend = ESS_BACKEND_CPU;
  c->residency = ESS_RESIDENCY_SPARSE;
  c->whole_headroom = 1;
}

namespace {

// The caller's region as the Total Memory Pool's one allocation (ess_config.host_memory).
class CallerHostMemory final : public ess::HostAllocator {
 public:
  CallerHostMemory(void* data, std::uint64_t bytes, bool pinned)
      : data_(static_cast<std::uint8_t*>(data)), bytes_(bytes), pinned_(pinned) {}
  ess::HostBlock allocate(std::size_t bytes, ess::HostMemoryKind) override {
    if (given_ || bytes > bytes_) return {};
    given_ = true;
    return {data_, bytes, pinned_ ? ess::HostMemoryKind::kPinned : ess::HostMemoryKind::kAligned};
  }
  void deallocate(const ess::HostBlock&) noexcept override { given_ = false; }

 private:
  std::uint8_t* data_;
  std::uint64_t bytes_;
  bool pinned_;
  bool given_ = false;
};

std::unique_ptr<ess::HostAllocator> caller_host_memory(const ess_config& c) {
  if (c.host_memory == nullptr) {
    ESS_CHECK(c.host_memory_bytes == 0 && c.host_memory_pinned == 0,
              "config: host_memory is NULL but host_memory_bytes = {}, host_memory_pinned = {}", c.host_memory_bytes,
              c.host_memory_pinned);
    return nullptr;
  }
  const auto address = reinterpret_cast<std::uintptr_t>(c.host_memory);
  ESS_CHECK(address % 4096 == 0, "config: host_memory = {:#x} is not 4 KiB-aligned", address);
  ESS_CHECK(c.host_memory_bytes >= 4096, "config: host_memory_bytes = {} is less than 4 KiB", c.host_memory_bytes);
  ESS_CHECK(c.host_memory_pinned == 0 || c.host_memory_pinned == 1, "config: host_memory_pinned = {} is not 0 or 1",
            c.host_memory_pinned);
  return std::make_unique<CallerHostMemory>(c.host_memory, c.host_memory_bytes, c.host_memory_pinned == 1);
}

}  // namespace

namespace {

// The caller's ess_config as this library's: a caller built against an earlier header (its
// struct_size one of the earlier layouts, whose fields are a prefix of this one) gets the
// defaults of the fields it does not know.
ess_config read_config(const ess_config* given) {
  ESS_CHECK(given != nullptr, "ess_config is required (got NULL)");
  constexpr std::uint32_t kLayouts[] = {
      offsetof(ess_config, host_memory),           // before the caller's host memory
      offsetof(ess_config, host_pages_per_layer),  // before foreign pages
      offsetof(ess_config, residency),             // before residency
      offsetof(ess_config, latent_tail),           // before buffers in two parts
      offsetof(ess_config, region_blocks),         // before regions
      sizeof(ess_config),
  };
  const std::uint32_t size = given->struct_size;
  ESS_CHECK(std::find(std::begin(kLayouts), std::end(kLayouts), size) != std::end(kLayouts),
            "ess_config.struct_size = {}: this library knows ess_config layouts of {}, {}, {}, {}, {} and {} bytes: "
            "call ess_config_init (a header of another ABI version?)",
            size, kLayouts[0], kLayouts[1], kLayouts[2], kLayouts[3], kLayouts[4], kLayouts[5]);
  ess_config c;
  ess_config_init(&c);
  std::memcpy(&c, given, size);
  c.struct_size = sizeof(ess_config);
  return c;
}

// Foreign pages (ess_config.host_pages_per_layer): the offload's view of them.
void set_foreign_pages(const ess_config& c, ess::OffloadConfig& o) {
  if (c.host_pages_per_layer == 0) {
    ESS_CHECK(c.host_page_stride == 0 && c.host_layer_first_page == nullptr,
              "config: host_pages_per_layer is 0 but host_page_stride = {} / host_layer_first_page is {}",
              c.host_page_stride, c.host_layer_first_page == nullptr ? "NULL" : "set");
    return;
  }
  ESS_CHECK(c.host_pages_per_layer > 0, "config: host_pages_per_layer = {} is negative", c.host_pages_per_layer);
  ESS_CHECK(c.host_memory != nullptr, "config: host_pages_per_layer = {} needs host_memory (the other engine's pool)",
            c.host_pages_per_layer);
  ESS_CHECK(c.host_layer_first_page != nullptr, "config: host_pages_per_layer = {} needs host_layer_first_page",
            c.host_pages_per_layer);
  o.foreign.pages_per_layer = c.host_pages_per_layer;
  o.foreign.page_stride = c.host_page_stride;
  o.foreign.layer_first_page.assign(c.host_layer_first_page, c.host_layer_first_page + o.layers);
  std::int64_t last = 0;
  for (const std::int64_t first : o.foreign.layer_first_page) last = std::max(last, first);
  // The region bounds the pages before the pool is built over it (whose own checks name a
  // layout that cannot be addressed); the pool's arena is rounded up to 4 KiB.
  std::uint64_t end = 0;
  const bool overflow =
      last > std::numeric_limits<std::int64_t>::max() - c.host_pages_per_layer ||
      __builtin_mul_overflow(static_cast<std::uint64_t>(last + c.host_pages_per_layer), c.host_page_stride, &end) ||
      end > std::numeric_limits<std::uint64_t>::max() - 4095;
  ESS_CHECK(!overflow && (end + 4095) / 4096 * 4096 <= c.host_memory_bytes,
            "config: foreign pages end at page {} of {} B each ({} B, rounded up to 4 KiB), beyond host_memory_bytes = "
            "{}",
            last + c.host_pages_per_layer, c.host_page_stride, end, c.host_memory_bytes);
}

std::span<const std::int32_t> page_list(const std::int32_t* pages, std::int64_t count) {
  ESS_CHECK(count >= 0, "page_count = {} is negative", count);
  ESS_CHECK(pages != nullptr || count == 0, "pages is NULL with page_count = {}", count);
  return {pages, static_cast<std::size_t>(count)};
}

}  // namespace

ess_status ess_engine_create(const ess_config* given, ess_engine** out) {
  if (out != nullptr) *out = nullptr;
  return guard("ess_engine_create", [&] {
    ESS_CHECK(out != nullptr, "the engine out-pointer is NULL");
    const ess_config full = read_config(given);
    const ess_config* config = &full;
    ess::OffloadConfig oc = ess::capi::offload_config(*config);
    set_foreign_pages(*config, oc);
    if (config->region_group != nullptr) oc.region_group.assign(config->region_group, config->region_group + oc.layers);
    ess::LatentBuffer buffer;
    const bool split = config->latent_tail != nullptr || config->latent_tail_count != 0 || config->split_bytes != 0 ||
                       config->tail_bytes != 0;
    if (split) {
      ESS_CHECK(config->latent != nullptr, "config: latent_tail needs the head buffers in latent (got NULL)");
      ESS_CHECK(config->latent_tail != nullptr && config->latent_tail_count == oc.layers,
                "config: {} latent tail buffers for {} layers", config->latent_tail_count, oc.layers);
      ESS_CHECK(config->split_bytes > 0 && config->split_bytes % 16 == 0 && config->tail_bytes > 0 &&
                    config->tail_bytes % 8 == 0 &&
                    static_cast<std::uint64_t>(config->split_bytes) + static_cast<std::uint64_t>(config->tail_bytes) <=
                        oc.layout.bytes(),
                "config: split_bytes = {} and tail_bytes = {} must be positive multiples of 16 and of 8 within the "
                "entry's {} bytes",
                config->split_bytes, config->tail_bytes, oc.layout.bytes());
      buffer.tail.head_bytes = config->split_bytes;
      buffer.tail.bytes = config->tail_bytes;
    }
    if (config->latent != nullptr || config->latent_count != 0) {
      ESS_CHECK(config->latent != nullptr && config->latent_count == oc.layers,
                "config: {} latent buffers for {} layers", config->latent_count, oc.layers);
      // With regions the requests' rows lie in the blocks ess_request_place names (checked there).
      const std::int64_t needed = oc.region_blocks > 0 ? 0 : static_cast<std::int64_t>(oc.max_requests) * oc.rows_per_request();
      for (int l = 0; l < oc.layers && split; ++l) {
        const auto t = ess::capi::layer_tensor(config->latent_tail[l], l, static_cast<std::uint64_t>(config->tail_bytes),
                                               ess::capi::placement_of(oc), "latent tail buffer");
        ESS_CHECK(t.capacity >= needed,
                  "latent tail buffer of layer {} holds {} rows; {} requests x {} rows per request need {}", l, t.capacity,
                  oc.max_requests, oc.rows_per_request(), needed);
        if (l == 0) {
          buffer.tail.rows = t.rows;
        } else {
          ESS_CHECK(t.rows.row_stride == buffer.tail.rows.row_stride && t.rows.block_rows == buffer.tail.rows.block_rows &&
                        t.rows.block_stride == buffer.tail.rows.block_stride,
                    "latent tail buffer of layer {}: its strides differ from layer 0's", l);
        }
        buffer.tail_base.push_back(t.base);
      }
      const std::uint64_t head_bytes = split ? static_cast<std::uint64_t>(config->split_bytes) : oc.layout.bytes();
      for (int l = 0; l < oc.layers; ++l) {
        const auto t = ess::capi::layer_tensor(config->latent[l], l, head_bytes, ess::capi::placement_of(oc));
        ESS_CHECK(t.capacity >= needed,
                  "latent buffer of layer {} holds {} rows; {} requests x {} rows per request need {}", l, t.capacity,
                  oc.max_requests, oc.rows_per_request(), needed);
        if (l == 0) {
          buffer.rows = t.rows;
          buffer.blocks = t.rows.block_rows > 0 ? t.capacity / t.rows.block_rows : 0;
        } else {
          ESS_CHECK(t.rows.row_stride == buffer.rows.row_stride && t.rows.block_rows == buffer.rows.block_rows &&
                        t.rows.block_stride == buffer.rows.block_stride,
                    "latent buffer of layer {}: its strides differ from layer 0's", l);
          ESS_CHECK(t.rows.block_rows == 0 || t.capacity / t.rows.block_rows == buffer.blocks,
                    "latent buffer of layer {} holds {} blocks, layer 0's {}", l, t.capacity / t.rows.block_rows,
                    buffer.blocks);
        }
        buffer.layer_base.push_back(t.base);
      }
    }
    auto host_memory = caller_host_memory(*config);
    auto offload = host_memory ? std::make_unique<ess::Offload>(oc, std::move(buffer), *host_memory)
                               : std::make_unique<ess::Offload>(oc, std::move(buffer));
    *out = ess::capi::add_engine(std::move(host_memory), std::move(offload));
  });
}

ess_status ess_engine_destroy(ess_engine* engine) {
  return guard("ess_engine_destroy", [&] { ess::capi::destroy_engine(engine); });
}

void ess_engine_info_init(ess_engine_info* info) { ess::capi::init_struct(info); }

ess_status ess_engine_get_info(const ess_engine* engine, ess_engine_info* info) {
  return guard("ess_engine_get_info", [&] {
    const auto call = ess::capi::engine_call(engine);
    const ess::Offload& o = call.offload();
    // A caller built against the layout before buffers in two parts gets the fields it knows.
    const bool earlier = ess::capi::check_struct(info, "ess_engine_info", "ess_engine_info_init",
                                                 offsetof(ess_engine_info, split_bytes), "buffers in two parts");
    const ess::OffloadConfig& c = o.config();
    info->layers = c.layers;
    info->max_requests = c.max_requests;
    info->max_context = c.max_context;
    info->query_tokens = c.query_tokens;
    info->topk = c.topk;
    info->slots = c.slots;
    info->rows_per_request = c.rows_per_request();
    info->reserve_newest = c.reserve_newest ? 1 : 0;
    info->backend = c.backend == ess::Backend::kCuda ? ESS_BACKEND_CUDA : ESS_BACKEND_CPU;
    info->device = c.device;
    info->entry_bytes = static_cast<std::int32_t>(c.layout.bytes());
    info->row_stride = o.buffer().rows.row_stride;
    info->block_rows = o.buffer().rows.block_rows;
    info->block_stride = o.buffer().rows.block_stride;
    info->host_bytes_capacity = o.host_pool().capacity_bytes();
    if (earlier) return;
    const ess::LatentBuffer& b = o.buffer();
    info->split_bytes = b.split() ? b.tail.head_bytes : 0;
    info->tail_bytes = b.split() ? b.tail.bytes : 0;
    info->tail_row_stride = b.split() ? b.tail.rows.row_stride : 0;
    info->tail_block_rows = b.split() ? b.tail.rows.block_rows : 0;
    info->tail_block_stride = b.split() ? b.tail.rows.block_stride : 0;
  });
}

ess_status ess_engine_layer_data(const ess_engine* engine, int32_t layer, void** data) {
  return guard("ess_engine_layer_data", [&] {
    const auto call = ess::capi::engine_call(engine);
    const ess::Offload& o = call.offload();
    ESS_CHECK(data != nullptr, "the data out-pointer is NULL");
    ESS_CHECK(layer >= 0 && layer < o.config().layers, "layer {} outside [0, {})", layer, o.config().layers);
    *data = o.buffer().layer_base[static_cast<std::size_t>(layer)];
  });
}

ess_status ess_engine_device_bytes(const ess_engine* engine, uint64_t* bytes) {
  return guard("ess_engine_device_bytes", [&] {
    const auto call = ess::capi::engine_call(engine);
    ESS_CHECK(bytes != nullptr, "the bytes out-pointer is NULL");
    *bytes = call.offload().device_bytes();
  });
}

ess_status ess_engine_read_row(const ess_engine* engine, int32_t layer, int32_t row, void* out, size_t bytes) {
  return guard("ess_engine_read_row", [&] {
    const auto call = ess::capi::engine_call(engine);
    const ess::Offload& o = call.offload();
    ESS_CHECK(out != nullptr, "the output is NULL");
    ESS_CHECK(bytes == o.config().layout.bytes(), "{} bytes asked for; an entry is {}", bytes, o.config().layout.bytes());
    const auto r = o.read_row(layer, row);
    std::memcpy(out, r.data(), r.size());
  });
}

void ess_host_layout_init(ess_host_layout* layout) { ess::capi::init_struct(layout); }

ess_status ess_engine_host_layout(const ess_engine* engine, ess_host_layout* layout) {
  return guard("ess_engine_host_layout", [&] {
    const auto call = ess::capi::engine_call(engine);
    const ess::TotalPool& pool = call.offload().host_pool();
    ess::capi::check_struct(layout, "ess_host_layout", "ess_host_layout_init");
    layout->layers = pool.num_layers();
    layout->page_tokens = static_cast<std::int32_t>(ess::kPageTokens);
    layout->pinned = pool.memory_kind() == ess::HostMemoryKind::kPinned ? 1 : 0;
    layout->entry_bytes = pool.entry_bytes();
    layout->page_bytes = pool.page_stride();
    layout->pages_per_layer = pool.pages_per_layer();
    layout->layer_bytes = static_cast<std::uint64_t>(pool.pages_per_layer()) * pool.page_stride();
  });
}

ess_status ess_engine_host_layer(const ess_engine* engine, int32_t layer, void** data) {
  return guard("ess_engine_host_layer", [&] {
    const auto call = ess::capi::engine_call(engine);
    const ess::TotalPool& pool = call.offload().host_pool();
    ESS_CHECK(data != nullptr, "the data out-pointer is NULL");
    *data = const_cast<std::uint8_t*>(pool.layer_base(layer));  // the arena is writable; the pool hands out its address
  });
}

ess_status ess_request_host_pages(const ess_engine* engine, int64_t id, int32_t* pages, int64_t capacity,
                                  int64_t* count) {
  return guard("ess_request_host_pages", [&] {
    const auto call = ess::capi::engine_call(engine);
    const ess::TotalPool& pool = call.offload().host_pool();
    ESS_CHECK(count != nullptr, "the count out-pointer is NULL");
    ESS_CHECK(capacity >= 0, "capacity = {} is negative", capacity);
    const std::vector<std::int32_t> idx = pool.page_indices(id);
    *count = static_cast<std::int64_t>(idx.size());
    ESS_CHECK(capacity >= std::ssize(idx), "request {} has {} pages; the output has room for {}", id, idx.size(),
              capacity);
    ESS_CHECK(pages != nullptr || idx.empty(), "the pages output is NULL");
    if (!idx.empty()) std::memcpy(pages, idx.data(), idx.size() * sizeof(std::int32_t));
  });
}

ess_status ess_request_residency(const ess_engine* engine, int64_t id, int32_t* whole, int32_t* rows, int32_t capacity,
                                 int32_t* count) {
  return guard("ess_request_residency", [&] {
    const auto call = ess::capi::engine_call(engine);
    const ess::Offload& o = call.offload();
    ESS_CHECK(count != nullptr, "the count out-pointer is NULL");
    ESS_CHECK(capacity >= 0, "capacity = {} is negative", capacity);
    const std::vector<std::int32_t> units = o.whole_units(id);  // refuses a request not admitted
    *count = static_cast<std::int32_t>(units.size());
    ESS_CHECK(capacity >= *count, "request {} takes {} pool rows; the output has room for {}", id, units.size(),
              capacity);
    ESS_CHECK(rows != nullptr, "the rows output is NULL");
    std::memcpy(rows, units.data(), units.size() * sizeof(std::int32_t));
    if (whole != nullptr) *whole = o.whole(id) ? 1 : 0;
  });
}

void ess_stats_init(ess_stats* stats) { ess::capi::init_struct(stats); }

ess_status ess_engine_get_stats(const ess_engine* engine, ess_stats* stats) {
  return guard("ess_engine_get_stats", [&] {
    const auto call = ess::capi::engine_call(engine);
    const ess::Offload& o = call.offload();
    // A caller built against the layout before residency gets the fields it knows.
    const bool earlier = ess::capi::check_struct(stats, "ess_stats", "ess_stats_init", offsetof(ess_stats, whole_requests),
                                                 "residency");
    const ess::OffloadStats s = o.stats();
    if (!earlier) {
      stats->whole_requests = s.whole_requests;
      stats->whole_steps = s.whole_steps;
      stats->sparse_steps = s.sparse_steps;
      stats->swap_launches = s.swap_launches;
      stats->demotions = s.demotions;
      stats->promotions = s.promotions;
    }
    stats->steps = s.steps;
    stats->warmup_fills = s.warmup_fills;
    stats->hits = s.hits;
    stats->misses = s.misses;
    stats->reserved_hits = s.reserved_hits;
    stats->host_bytes_used = s.host_bytes_used;
    stats->host_bytes_capacity = s.host_bytes_capacity;
    stats->requests = s.requests;
    stats->host_bytes_shared = s.host_bytes_shared;
    stats->host_bytes_retained = s.host_bytes_retained;
    stats->host_bytes_unshared = s.host_bytes_unshared;
  });
}

namespace {

// A prompt's token ids: int32 host memory [n].
std::span<const std::int32_t> prompt_of(const DLTensor* t) {
  const ess::capi::Tensor v = ess::capi::checked(t, "prompt_tokens", {ess::Backend::kCpu, 0});
  ESS_CHECK(t->dtype.code == kDLInt && t->dtype.bits == 32 && v.shape.size() == 1,
            "prompt_tokens: int32 [n] host memory is needed, got shape {}", ess::capi::shape_string(v.shape));
  return {reinterpret_cast<const std::int32_t*>(v.data), static_cast<std::size_t>(v.shape[0])};
}

}  // namespace

ess_status ess_request_admit_shared(ess_engine* engine, int64_t id, int64_t prompt_length, int64_t source,
                                    int64_t prefix, int32_t row, int32_t* row_out) {
  return guard("ess_request_admit_shared", [&] {
    const std::int32_t r = ess::capi::engine_call(engine).offload().admit_shared(id, prompt_length, source, prefix, row);
    if (row_out != nullptr) *row_out = r;
  });
}

ess_status ess_request_admit_cached(ess_engine* engine, int64_t id, const DLTensor* prompt_tokens, int32_t row,
                                    int32_t* row_out, int64_t* reused_out) {
  return guard("ess_request_admit_cached", [&] {
    const auto call = ess::capi::engine_call(engine);
    ess::Offload& o = call.offload();
    const ess::Offload::Admitted a = o.admit_cached(id, prompt_of(prompt_tokens), row);
    if (row_out != nullptr) *row_out = a.row;
    if (reused_out != nullptr) *reused_out = a.reused_tokens;
  });
}

ess_status ess_request_publish(ess_engine* engine, int64_t id, const DLTensor* prompt_tokens, int64_t* pages_out) {
  return guard("ess_request_publish", [&] {
    const auto call = ess::capi::engine_call(engine);
    ess::Offload& o = call.offload();
    const std::int64_t pages = o.publish(id, prompt_of(prompt_tokens));
    if (pages_out != nullptr) *pages_out = pages;
  });
}

ess_status ess_request_admit(ess_engine* engine, int64_t id, int64_t prompt_length, int32_t row, int32_t* row_out) {
  return guard("ess_request_admit", [&] {
    const std::int32_t r = ess::capi::engine_call(engine).offload().admit(id, prompt_length, row);
    if (row_out != nullptr) *row_out = r;
  });
}

namespace {

// The host entries [first, first + n) of (id, layer) as `t` describes them; checked whole
// before any byte moves.
struct EntryRange {
  std::uint8_t* data = nullptr;
  std::int64_t n = 0;
  std::size_t entry = 0;
};

EntryRange entry_range(const ess::Offload& o, std::int64_t id, int layer, std::int64_t first, const DLTensor* t) {
  const std::int64_t length = o.length(id);  // throws for an unknown request
  ESS_CHECK(layer >= 0 && layer < o.config().layers, "request {}: layer {} outside [0, {})", id, layer,
            o.config().layers);
  const ess::capi::Tensor v = ess::capi::checked(t, "entries", {ess::Backend::kCpu, 0});
  const std::size_t entry = o.config().layout.bytes();
  const std::int64_t bytes = v.elements() * v.item_bytes;
  const std::int64_t row_bytes = v.shape.back() * v.item_bytes;
  ESS_CHECK(static_cast<std::size_t>(row_bytes) == entry,
            "entries has shape {} of {}-byte elements: its last dimension spans {} bytes, an entry is {}",
            ess::capi::shape_string(v.shape), v.item_bytes, row_bytes, entry);
  const std::int64_t n = bytes / static_cast<std::int64_t>(entry);
  ESS_CHECK(first >= 0 && first <= length - n,  // first + n may overflow: not computed
            "request {} layer {}: {} entries from token {} outside its {} tokens", id, layer, n, first, length);
  return {v.data, n, entry};
}

// The windows LRU-Warmup reads (the last warmup_windows of each layer): every id -1 or a token of
// the request, none twice in a window. The swap engine checks one layer at a time as it warms it.
void check_windows(const ess::Offload& o, std::int64_t id, const std::int32_t* ids, std::int64_t W) {
  const std::int64_t length = o.length(id), K = o.config().topk;
  const std::int64_t used = std::min<std::int64_t>(W, o.config().warmup_windows);
  std::vector<std::int32_t> window;
  for (std::int64_t l = 0; l < o.config().layers; ++l) {
    for (std::int64_t w = W - used; w < W; ++w) {
      const std::int32_t* p = ids + (l * W + w) * K;
      window.clear();
      for (std::int64_t k = 0; k < K; ++k) {
        ESS_CHECK(p[k] >= -1 && p[k] < length,
                  "windows: request {} layer {} window {} position {} selects token {}, outside [0, {}) (-1 = padding)",
                  id, l, w, k, p[k], length);
        if (p[k] >= 0) window.push_back(p[k]);
      }
      std::sort(window.begin(), window.end());
      const auto twice = std::adjacent_find(window.begin(), window.end());
      ESS_CHECK(twice == window.end(), "windows: request {} layer {} window {} selects token {} twice", id, l, w,
                twice == window.end() ? 0 : *twice);
    }
  }
}

}  // namespace

ess_status ess_request_write_entries(ess_engine* engine, int64_t id, int32_t layer, int64_t first_token,
                                     const DLTensor* entries) {
  return guard("ess_request_write_entries", [&] {
    const auto call = ess::capi::engine_call(engine);
    ess::Offload& o = call.offload();
    const EntryRange r = entry_range(o, id, layer, first_token, entries);
    for (std::int64_t i = 0; i < r.n; ++i) {
      const auto dst = o.host_entry(id, layer, first_token + i);
      std::memcpy(dst.data(), r.data + static_cast<std::size_t>(i) * r.entry, r.entry);
    }
  });
}

ess_status ess_request_read_entries(const ess_engine* engine, int64_t id, int32_t layer, int64_t first_token,
                                    const DLTensor* entries) {
  return guard("ess_request_read_entries", [&] {
    const auto call = ess::capi::engine_call(engine);
    ess::Offload& o = call.offload();
    const EntryRange r = entry_range(o, id, layer, first_token, entries);
    for (std::int64_t i = 0; i < r.n; ++i) {
      const auto src = o.host_pool().entry(id, layer, first_token + i);
      std::memcpy(r.data + static_cast<std::size_t>(i) * r.entry, src.data(), r.entry);
    }
  });
}

ess_status ess_request_warmup(ess_engine* engine, int64_t id, const DLTensor* windows) {
  return guard("ess_request_warmup", [&] {
    const auto call = ess::capi::engine_call(engine);
    ess::Offload& o = call.offload();
    (void)o.row(id);  // names an unknown request before the shape
    const ess::capi::Tensor v = ess::capi::checked(windows, "windows", {ess::Backend::kCpu, 0});
    ESS_CHECK(windows->dtype.code == kDLInt && windows->dtype.bits == 32, "windows: int32 is needed");
    ESS_CHECK(v.shape.size() == 3 && v.shape[0] == o.config().layers && v.shape[2] == o.config().topk,
              "windows has shape {}; expected [layers {}, W, topk {}]", ess::capi::shape_string(v.shape),
              o.config().layers, o.config().topk);
    const auto* ids = reinterpret_cast<const std::int32_t*>(v.data);
    check_windows(o, id, ids, v.shape[1]);  // every layer before the first is warmed
    o.warmup(id, {ids, static_cast<std::size_t>(v.elements())}, static_cast<int>(v.shape[1]));
  });
}

ess_status ess_request_extend(ess_engine* engine, int64_t id, int64_t tokens) {
  return guard("ess_request_extend", [&] { ess::capi::engine_call(engine).offload().extend(id, tokens); });
}

ess_status ess_request_truncate(ess_engine* engine, int64_t id, int64_t length) {
  return guard("ess_request_truncate", [&] { ess::capi::engine_call(engine).offload().truncate(id, length); });
}

ess_status ess_request_adopt(ess_engine* engine, int64_t id, int64_t length, const int32_t* pages, int64_t page_count,
                             int32_t row, int32_t* row_out) {
  return guard("ess_request_adopt", [&] {
    const auto list = page_list(pages, page_count);
    const std::int32_t r = ess::capi::engine_call(engine).offload().adopt(id, length, list, row);
    if (row_out != nullptr) *row_out = r;
  });
}

ess_status ess_request_repage(ess_engine* engine, int64_t id, int64_t length, int64_t first_page, const int32_t* pages,
                              int64_t page_count) {
  return guard("ess_request_repage", [&] {
    const auto list = page_list(pages, page_count);
    ess::capi::engine_call(engine).offload().repage(id, length, first_page, list);
  });
}

ess_status ess_request_release(ess_engine* engine, int64_t id) {
  return guard("ess_request_release", [&] { ess::capi::engine_call(engine).offload().release(id); });
}

ess_status ess_engine_set_lifecycle_stream(ess_engine* engine, void* stream, int32_t ordered) {
  return guard("ess_engine_set_lifecycle_stream", [&] {
    ESS_CHECK(ordered == 0 || ordered == 1, "ess_engine_set_lifecycle_stream: ordered = {} must be 0 or 1", ordered);
    ESS_CHECK(ordered == 1 || stream == nullptr,
              "ess_engine_set_lifecycle_stream: stream {} given with ordered = 0 (each call waits for the device)", stream);
    ess::Offload& o = ess::capi::engine_call(engine).offload();
    if (ordered == 1) {
      o.set_lifecycle_stream(stream);
    } else {
      o.clear_lifecycle_stream();
    }
  });
}

ess_status ess_request_place(ess_engine* engine, int64_t id, const int32_t* blocks, int64_t count) {
  return guard("ess_request_place", [&] {
    ESS_CHECK(count >= 0 && (blocks != nullptr || count == 0), "blocks is NULL with count {}", count);
    ess::capi::engine_call(engine).offload().place(id, std::span<const std::int32_t>(blocks, static_cast<std::size_t>(count)));
  });
}

ess_status ess_engine_buffer_row(const ess_engine* engine, int32_t layer, int32_t row, int32_t slot, int32_t* out) {
  return guard("ess_engine_buffer_row", [&] {
    ESS_CHECK(out != nullptr, "the out-pointer is NULL");
    *out = ess::capi::engine_call(engine).offload().buffer_row(layer, row, slot);
  });
}

ess_status ess_request_reset(ess_engine* engine, int64_t id) {
  return guard("ess_request_reset", [&] { ess::capi::engine_call(engine).offload().reset(id); });
}

ess_status ess_request_get(const ess_engine* engine, int64_t id, int32_t* row, int64_t* length) {
  return guard("ess_request_get", [&] {
    const auto call = ess::capi::engine_call(engine);
    const ess::Offload& o = call.offload();
    const std::int32_t r = o.row(id);
    const std::int64_t n = o.length(id);
    if (row != nullptr) *row = r;
    if (length != nullptr) *length = n;
  });
}

void ess_string_free(char* s) { delete[] s; }

}  // extern "C"
