// What the C ABI's sources share: the objects behind the opaque handles and the table that
// finds them, the guard that turns every exception into a status and this thread's message,
// and the DLTensor checks.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <vector>

#include "ess/cache/host_memory.h"
#include "ess/core/error.h"
#include "ess/ess_c.h"
#include "ess/runtime/offload.h"

namespace ess::capi {

// An error the C layer raises with its own status (the runtime's exceptions map by type).
struct StatusError : Error {
  StatusError(ess_status s, const std::string& what) : Error(what), status(s) {}
  ess_status status;
};

void set_last_error(const std::string& message);

// The versioned structs (struct_size first): init_struct zeroes one and stamps its size;
// check_struct refuses a NULL one or one of another size (another header's layout), naming
// `what` and the init function to call.
template <typename S>
void init_struct(S* s) {
  if (s == nullptr) return;
  *s = S{};
  s->struct_size = sizeof(S);
}

template <typename S>
void check_struct(const S* s, const char* what, const char* init) {
  ESS_CHECK(s != nullptr, "{} is required (got NULL)", what);
  ESS_CHECK(s->struct_size == sizeof(S),
            "{}.struct_size = {}, this library's {} has {} bytes: call {} (a header of another ABI version?)", what,
            s->struct_size, what, sizeof(S), init);
}
// The same, also accepting the layout of an earlier header that ended at `before` bytes (`change`:
// what came after it); true when the caller's struct is that earlier one.
template <typename S>
bool check_struct(const S* s, const char* what, const char* init, std::uint32_t before, const char* change) {
  ESS_CHECK(s != nullptr, "{} is required (got NULL)", what);
  ESS_CHECK(s->struct_size == sizeof(S) || s->struct_size == before,
            "{}.struct_size = {}, this library's {} has {} bytes (or {} before {}): call {} (a header of another ABI "
            "version?)",
            what, s->struct_size, what, sizeof(S), before, change, init);
  return s->struct_size == before;
}

// Runs f; maps what it throws to a status and this thread's message (prefixed with `where`).
template <typename F>
ess_status guard(const char* where, F&& f) noexcept {
  try {
    f();
    return ESS_OK;
  } catch (const StatusError& e) {
    set_last_error(std::string(where) + ": " + e.what());
    return e.status;
  } catch (const OutOfMemory& e) {
    set_last_error(std::string(where) + ": " + e.what());
    return ESS_ERROR_OUT_OF_MEMORY;
  } catch (const DeviceError& e) {
    set_last_error(std::string(where) + ": " + e.what());
    return ESS_ERROR_DEVICE;
  } catch (const Error& e) {
    const std::string what = e.what();
    set_last_error(std::string(where) + ": " + what);
    return what.rfind("internal error", 0) == 0 ? ESS_ERROR_INTERNAL : ESS_ERROR_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    set_last_error(std::string(where) + ": out of host memory");
    return ESS_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(std::string(where) + ": internal error: " + e.what());
    return ESS_ERROR_INTERNAL;
  } catch (...) {
    set_last_error(std::string(where) + ": internal error: unknown exception");
    return ESS_ERROR_INTERNAL;
  }
}

// Where the backend's kernels read and write: host memory for the CPU backend, device or
// mapped memory of the configured device for the CUDA one.
struct Placement {
  Backend backend = Backend::kCpu;
  int device = 0;
};

inline Placement placement_of(const OffloadConfig& c) { return {c.backend, c.device}; }

// ---- handles (handles.cc) ----
// A handle is not an address: it is a number the table gives out once and never again (a
// serial number, with the kind of object in its low bits), so a destroyed handle, a handle of
// another kind, NULL or garbage is refused with ESS_ERROR_INVALID_ARGUMENT instead of being
// dereferenced. The table holds the objects; a call holds its object (shared_ptr) and the
// engine's lock for its duration, so a destroy from another thread waits for the call to end.
struct EngineObject {
  std::mutex mutex;                   // one call at a time on the engine and its bindings
  std::unique_ptr<HostAllocator> host_memory;  // the caller's region (ess_config.host_memory); outlives offload
  std::unique_ptr<Offload> offload;   // null once destroyed
  std::set<std::uint64_t> bindings;   // the handles of its bindings (destroyed with it)
};

struct StepObject {
  std::shared_ptr<EngineObject> engine;
  int batch = 0;   // B
  LayerStep step;  // the bound pointers (layer, batch and streams set per call)
};

struct WriteBackObject {
  std::shared_ptr<EngineObject> engine;
  int batch = 0;
  WriteBack write_back;
};

// A call on a live engine (or one of its bindings): the objects, kept alive, and the engine's lock.
struct EngineCall {
  std::shared_ptr<EngineObject> engine;
  std::unique_lock<std::mutex> lock;
  Offload& offload() const { return *engine->offload; }
};

template <typename B>
struct BindingCall {
  std::shared_ptr<B> binding;
  std::unique_lock<std::mutex> lock;
  Offload& offload() const { return *binding->engine->offload; }
};

EngineCall engine_call(const ess_engine* handle);
BindingCall<StepObject> step_call(const ess_step_binding* handle);
BindingCall<WriteBackObject> write_back_call(const ess_write_back_binding* handle);
// New handles for new objects (a binding is registered with its engine, whose lock the caller holds).
ess_engine* add_engine(std::unique_ptr<HostAllocator> host_memory, std::unique_ptr<Offload> offload);
ess_step_binding* add_step(EngineCall& call, std::shared_ptr<StepObject> binding);
ess_write_back_binding* add_write_back(EngineCall& call, std::shared_ptr<WriteBackObject> binding);
// Destroys: NULL is a no-op; a handle that is not live is refused (a second destroy included).
void destroy_engine(ess_engine* handle);
void destroy_step(ess_step_binding* handle);
void destroy_write_back(ess_write_back_binding* handle);

// A checked view of a DLTensor: its first byte, its shape, its element size.
struct Tensor {
  std::uint8_t* data = nullptr;
  std::vector<std::int64_t> shape;
  int item_bytes = 0;
  std::int64_t elements() const;
};

// `t` non-null, with data, on memory the placement can reach, C-contiguous (size-1
// dimensions aside). `what` names it in every message.
Tensor checked(const DLTensor* t, const char* what, const Placement& placement);
// The same, int32, with one of the shapes `shapes` (each a list of sizes).
std::int32_t* int32_tensor(const DLTensor* t, const char* what, const Placement& placement,
                           const std::vector<std::vector<std::int64_t>>& shapes);
std::string shape_string(const std::vector<std::int64_t>& shape);

// The engine's layer buffer `t`: its base and row placement; `min_rows` rows must fit.
struct LayerTensor {
  std::uint8_t* base = nullptr;
  RowLayout rows;
  std::int64_t capacity = 0;  // rows it holds
};
// The step's or write-back's `rows` ([B], B at most the engine's rows): returns B.
std::int64_t bound_positions(const DLTensor* rows, const Offload& o);

// A layer's buffer tensor (`name`: "latent buffer", "latent tail buffer"), rows of entry_bytes.
LayerTensor layer_tensor(const DLTensor* t, int layer, std::uint64_t entry_bytes, const Placement& placement,
                         const char* name = "latent buffer");

}  // namespace ess::capi
