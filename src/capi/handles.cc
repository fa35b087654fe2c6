// The C ABI's handle table: every engine and binding handle is a serial number given out once,
// looked up on each call, so a handle that was destroyed (or never created, or is of another
// kind) is refused by name instead of dereferenced.
#include <cstdint>
#include <unordered_map>

#include <fmt/format.h>

#include "capi/capi_internal.h"

namespace ess::capi {
namespace {

enum Kind : std::uint64_t { kEngine = 1, kStep = 2, kWriteBack = 3 };
constexpr int kKindBits = 2;

const char* kind_name(Kind k) {
  switch (k) {
    case kEngine: return "engine";
    case kStep: return "step binding";
    case kWriteBack: return "write-back binding";
  }
  return "handle";
}

// The live objects by handle value. Its own mutex guards the maps only; it is never held while
// an engine's lock is taken.
class Table {
 public:
  std::uint64_t add(Kind kind, std::shared_ptr<void> object) {
    const std::lock_guard<std::mutex> g(mutex_);
    const std::uint64_t value = (next_++ << kKindBits) | kind;
    objects_.emplace(value, std::move(object));
    return value;
  }

  // The object of `value` when it is live and of `kind`, else null.
  std::shared_ptr<void> find(std::uint64_t value, Kind kind) {
    if ((value & ((1u << kKindBits) - 1)) != kind) return nullptr;
    const std::lock_guard<std::mutex> g(mutex_);
    const auto it = objects_.find(value);
    return it == objects_.end() ? nullptr : it->second;
  }

  // Removes `value` (and `also`); returns its object, or null when it was not live.
  std::shared_ptr<void> remove(std::uint64_t value, Kind kind, const std::set<std::uint64_t>* also = nullptr) {
    if ((value & ((1u << kKindBits) - 1)) != kind) return nullptr;
    const std::lock_guard<std::mutex> g(mutex_);
    const auto it = objects_.find(value);
    if (it == objects_.end()) return nullptr;
    std::shared_ptr<void> object = std::move(it->second);
    objects_.erase(it);
    if (also != nullptr) {
      for (std::uint64_t b : *also) objects_.erase(b);
    }
    return object;
  }

 private:
  std::mutex mutex_;
  std::uint64_t next_ = 1;  // 2^62 handles: never reused in a process's life
  std::unordered_map<std::uint64_t, std::shared_ptr<void>> objects_;
};

Table& table() {
  static Table* t = new Table;  // never destroyed: calls from other threads may come during exit
  return *t;
}

std::uint64_t value_of(const void* handle) { return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(handle)); }

template <typename H>
H* handle_of(std::uint64_t value) {
  return reinterpret_cast<H*>(static_cast<std::uintptr_t>(value));
}

[[noreturn]] void not_live(Kind kind, const void* handle) {
  if (handle == nullptr) throw StatusError(ESS_ERROR_INVALID_ARGUMENT, fmt::format("{} is NULL", kind_name(kind)));
  throw StatusError(ESS_ERROR_INVALID_ARGUMENT,
                    fmt::format("{} handle {} is not live: destroyed already{}, or never created by this library",
                                kind_name(kind), fmt::ptr(handle), kind == kEngine ? "" : " (or its engine was)"));
}

// The engine's lock, taken once the table's is released; refused if the engine went meanwhile.
std::unique_lock<std::mutex> lock_live(EngineObject& e, Kind kind, const void* handle) {
  std::unique_lock<std::mutex> lock(e.mutex);
  if (e.offload == nullptr) not_live(kind, handle);
  return lock;
}

template <typename B>
BindingCall<B> binding_call(const void* handle, Kind kind) {
  auto object = std::static_pointer_cast<B>(table().find(value_of(handle), kind));
  if (object == nullptr) not_live(kind, handle);
  BindingCall<B> call{object, lock_live(*object->engine, kind, handle)};
  if (object->engine->bindings.count(value_of(handle)) == 0) not_live(kind, handle);  // destroyed while we waited
  return call;
}

template <typename B>
void destroy_binding(const void* handle, Kind kind) {
  if (handle == nullptr) return;
  auto object = std::static_pointer_cast<B>(table().remove(value_of(handle), kind));
  if (object == nullptr) not_live(kind, handle);
  const std::lock_guard<std::mutex> g(object->engine->mutex);
  object->engine->bindings.erase(value_of(handle));
}

}  // namespace

EngineCall engine_call(const ess_engine* handle) {
  auto object = std::static_pointer_cast<EngineObject>(table().find(value_of(handle), kEngine));
  if (object == nullptr) not_live(kEngine, handle);
  std::unique_lock<std::mutex> lock = lock_live(*object, kEngine, handle);
  return {std::move(object), std::move(lock)};
}

BindingCall<StepObject> step_call(const ess_step_binding* handle) { return binding_call<StepObject>(handle, kStep); }

BindingCall<WriteBackObject> write_back_call(const ess_write_back_binding* handle) {
  return binding_call<WriteBackObject>(handle, kWriteBack);
}

ess_engine* add_engine(std::unique_ptr<HostAllocator> host_memory, std::unique_ptr<Offload> offload) {
  auto object = std::make_shared<EngineObject>();
  object->host_memory = std::move(host_memory);
  object->offload = std::move(offload);
  return handle_of<ess_engine>(table().add(kEngine, std::move(object)));
}

ess_step_binding* add_step(EngineCall& call, std::shared_ptr<StepObject> binding) {
  const std::uint64_t value = table().add(kStep, std::move(binding));
  call.engine->bindings.insert(value);
  return handle_of<ess_step_binding>(value);
}

ess_write_back_binding* add_write_back(EngineCall& call, std::shared_ptr<WriteBackObject> binding) {
  const std::uint64_t value = table().add(kWriteBack, std::move(binding));
  call.engine->bindings.insert(value);
  return handle_of<ess_write_back_binding>(value);
}

void destroy_engine(ess_engine* handle) {
  if (handle == nullptr) return;
  auto object = std::static_pointer_cast<EngineObject>(table().find(value_of(handle), kEngine));
  if (object == nullptr) not_live(kEngine, handle);
  std::unique_ptr<HostAllocator> host_memory;  // declared first: it outlives the offload
  std::unique_ptr<Offload> offload;
  {
    const std::lock_guard<std::mutex> g(object->mutex);  // a call in flight on another thread ends first
    if (object->offload == nullptr) not_live(kEngine, handle);
    table().remove(value_of(handle), kEngine, &object->bindings);
    object->bindings.clear();
    offload = std::move(object->offload);
    host_memory = std::move(object->host_memory);
  }
  // Both go here, outside the lock; calls that waited for the lock now find the engine gone.
}

void destroy_step(ess_step_binding* handle) { destroy_binding<StepObject>(handle, kStep); }

void destroy_write_back(ess_write_back_binding* handle) { destroy_binding<WriteBackObject>(handle, kWriteBack); }

}  // namespace ess::capi
