// The C ABI's per-layer step and write-back: tensors checked once when bound, then each call
// passes a layer, a batch and streams.
#include "capi/capi_internal.h"

namespace ess::capi {
namespace {

// The batch of one call: -1 = the bound B.
int call_batch(int bound, std::int32_t batch, const char* what) {
  if (batch == -1) return bound;
  ESS_CHECK(batch >= 0 && batch <= bound, "{}: batch {} outside [0, {}] (the bound tensors' B; -1 = all)", what,
            batch, bound);
  return batch;
}

}  // namespace

std::int64_t bound_positions(const DLTensor* rows, const Offload& o) {
  const Tensor v = checked(rows, "rows", placement_of(o.config()));
  ESS_CHECK(v.shape.size() == 1, "rows has shape {}; expected [B]", shape_string(v.shape));
  ESS_CHECK(v.shape[0] <= o.config().max_requests, "rows has {} positions; the engine has {} rows (max_requests)",
            v.shape[0], o.config().max_requests);
  return v.shape[0];
}

}  // namespace ess::capi

using ess::capi::guard;

extern "C" {

void ess_step_tensors_init(ess_step_tensors* t) { ess::capi::init_struct(t); }

ess_status ess_step_bind(ess_engine* engine, const ess_step_tensors* t, ess_step_binding** out) {
  if (out != nullptr) *out = nullptr;
  return guard("ess_step_bind", [&] {
    auto call = ess::capi::engine_call(engine);
    ESS_CHECK(out != nullptr, "the binding out-pointer is NULL");
    ess::capi::check_struct(t, "ess_step_tensors", "ess_step_tensors_init");
    const ess::Offload& o = call.offload();
    const ess::capi::Placement p = ess::capi::placement_of(o.config());
    const std::int64_t B = ess::capi::bound_positions(t->rows, o), T = o.config().query_tokens, K = o.config().topk;
    const std::vector<std::vector<std::int64_t>> per_id = {{B, T, K}, {B * T, K}};
    const std::vector<std::vector<std::int64_t>> per_query = {{B, T}, {B * T}};
    auto binding = std::make_shared<ess::capi::StepObject>();
    binding->engine = call.engine;
    binding->batch = static_cast<int>(B);
    ess::LayerStep& s = binding->step;
    s.rows = ess::capi::int32_tensor(t->rows, "rows", p, {{B}});
    s.topk = ess::capi::int32_tensor(t->topk, "topk", p, per_id);
    s.lengths = ess::capi::int32_tensor(t->lengths, "lengths", p, {{B}});
    s.physical = ess::capi::int32_tensor(t->physical, "physical", p, per_id);
    if (t->counts != nullptr) s.counts = ess::capi::int32_tensor(t->counts, "counts", p, {{B, 2}});
    const bool any_split = t->resident != nullptr || t->fetched != nullptr || t->resident_count != nullptr ||
                           t->fetched_count != nullptr;
    if (any_split) {
      ESS_CHECK(t->resident != nullptr && t->fetched != nullptr && t->resident_count != nullptr &&
                    t->fetched_count != nullptr,
                "resident, fetched, resident_count and fetched_count go together");
      s.resident = ess::capi::int32_tensor(t->resident, "resident", p, per_id);
      s.fetched = ess::capi::int32_tensor(t->fetched, "fetched", p, per_id);
      s.resident_count = ess::capi::int32_tensor(t->resident_count, "resident_count", p, per_query);
      s.fetched_count = ess::capi::int32_tensor(t->fetched_count, "fetched_count", p, per_query);
    }
    *out = ess::capi::add_step(call, std::move(binding));
  });
}

ess_status ess_step_binding_destroy(ess_step_binding* binding) {
  return guard("ess_step_binding_destroy", [&] { ess::capi::destroy_step(binding); });
}

ess_status ess_step_async(ess_step_binding* binding, int32_t layer, int32_t batch, int32_t part, void* stream,
                          void* copy_stream, void* copy_done) {
  return guard("ess_step", [&] {
    const auto call = ess::capi::step_call(binding);
    ess::LayerStep s = call.binding->step;
    s.layer = layer;
    s.batch = ess::capi::call_batch(call.binding->batch, batch, "step");
    s.part = part;
    s.stream = static_cast<ess::cuda::Stream>(stream);
    s.copy_stream = static_cast<ess::cuda::Stream>(copy_stream);
    s.copy_done = copy_done;
    call.offload().step(s);
  });
}

ess_status ess_step(ess_step_binding* binding, int32_t layer, int32_t batch, void* stream) {
  return ess_step_async(binding, layer, batch, 0, stream, nullptr, nullptr);
}

ess_status ess_step_group(ess_step_binding* binding, int32_t layer, int32_t batch, int32_t query_begin,
                          int32_t query_end, void* stream) {
  return guard("ess_step_group", [&] {
    const auto call = ess::capi::step_call(binding);
    const int T = call.offload().config().query_tokens;
    ESS_CHECK(query_begin >= 0 && query_begin < query_end && query_end <= T,
              "query group [{}, {}) is not a non-empty range of the {} query tokens", query_begin, query_end, T);
    ess::LayerStep s = call.binding->step;
    s.layer = layer;
    s.batch = ess::capi::call_batch(call.binding->batch, batch, "step");
    s.stream = static_cast<ess::cuda::Stream>(stream);
    s.query_begin = query_begin;
    s.query_end = query_end;
    call.offload().step(s);
  });
}

ess_status ess_query_groups(const ess_engine* engine, const DLTensor* rows, const DLTensor* topk, const DLTensor* lengths,
                            int32_t* bounds, int32_t* count) {
  if (count != nullptr) *count = 0;
  return guard("ess_query_groups", [&] {
    const auto call = ess::capi::engine_call(engine);
    const ess::Offload& o = call.offload();
    ESS_CHECK(bounds != nullptr && count != nullptr, "bounds and count are required (bounds holds T + 1 = {} values)",
              o.config().query_tokens + 1);
    const ess::capi::Placement host{ess::Backend::kCpu, 0};
    const ess::capi::Tensor r = ess::capi::checked(rows, "rows", host);
    ESS_CHECK(r.shape.size() == 1 && r.shape[0] <= o.config().max_requests,
              "rows has shape {}; expected [B] with B at most the engine's {} rows", ess::capi::shape_string(r.shape),
              o.config().max_requests);
    const std::int64_t B = r.shape[0], T = o.config().query_tokens, K = o.config().topk;
    const std::int32_t* rp = ess::capi::int32_tensor(rows, "rows", host, {{B}});
    const std::int32_t* tp = ess::capi::int32_tensor(topk, "topk", host, {{B, T, K}, {B * T, K}});
    const std::int32_t* lp = ess::capi::int32_tensor(lengths, "lengths", host, {{B}});
    const std::vector<int> b = o.query_groups(static_cast<int>(B), rp, tp, lp);
    for (std::size_t i = 0; i < b.size(); ++i) bounds[i] = b[i];
    *count = static_cast<std::int32_t>(b.size()) - 1;
  });
}

ess_status ess_write_back_bind(ess_engine* engine, const DLTensor* rows, const DLTensor* lengths,
                               const DLTensor* source_rows, ess_write_back_binding** out) {
  if (out != nullptr) *out = nullptr;
  return guard("ess_write_back_bind", [&] {
    auto call = ess::capi::engine_call(engine);
    ESS_CHECK(out != nullptr, "the binding out-pointer is NULL");
    const ess::Offload& o = call.offload();
    const ess::capi::Placement p = ess::capi::placement_of(o.config());
    const std::int64_t B = ess::capi::bound_positions(rows, o), T = o.config().query_tokens;
    ESS_CHECK(source_rows != nullptr || o.config().reserve_newest,
              "source_rows is required: the engine has no reserved rows (reserve_newest is off)");
    auto binding = std::make_shared<ess::capi::WriteBackObject>();
    binding->engine = call.engine;
    binding->batch = static_cast<int>(B);
    ess::WriteBack& w = binding->write_back;
    w.rows = ess::capi::int32_tensor(rows, "rows", p, {{B}});
    w.lengths = ess::capi::int32_tensor(lengths, "lengths", p, {{B}});
    if (source_rows != nullptr) w.source_rows = ess::capi::int32_tensor(source_rows, "source_rows", p, {{B, T}, {B * T}});
    *out = ess::capi::add_write_back(call, std::move(binding));
  });
}

ess_status ess_write_back_binding_destroy(ess_write_back_binding* binding) {
  return guard("ess_write_back_binding_destroy", [&] { ess::capi::destroy_write_back(binding); });
}

ess_status ess_write_back(ess_write_back_binding* binding, int32_t layer, int32_t batch, void* stream) {
  return guard("ess_write_back", [&] {
    const auto call = ess::capi::write_back_call(binding);
    ess::WriteBack w = call.binding->write_back;
    w.layer = layer;
    w.batch = ess::capi::call_batch(call.binding->batch, batch, "write_back");
    w.stream = static_cast<ess::cuda::Stream>(stream);
    call.offload().write_back(w);
  });
}

}  // extern "C"
