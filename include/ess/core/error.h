// The project's one exception type and the checks that raise it.
//
// Every public entry point validates its input and throws ess::Error with a message that
// names what was wrong, where (request, layer, position, field) and the offending value.
// A call that throws leaves the object it was called on exactly as it was.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace ess {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A CUDA call failed (the device, its driver or a kernel), not the caller's input.
class DeviceError : public Error {
 public:
  using Error::Error;
};

// Host or device memory could not be allocated.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// A pool has no room for what a call asks (the Total Memory Pool's pages for an admission or
// growth): a refusal, nothing changed.
class PoolFull : public Error {
 public:
  using Error::Error;
};

[[noreturn]] void throw_error(std::string message);
[[noreturn]] void throw_device_error(std::string message);
[[noreturn]] void throw_out_of_memory(std::string message);
[[noreturn]] void throw_internal(const char* expr, const char* file, int line, std::string message);

}  // namespace ess

// User-facing validation: ESS_CHECK(cond, "fmt {}", args...) throws ess::Error(message).
#define ESS_CHECK(cond, ...)                                 \
  do {                                                       \
    if (!(cond)) [[unlikely]] {                              \
      ::ess::throw_error(::fmt::format(__VA_ARGS__));        \
    }                                                        \
  } while (0)

#define ESS_THROW(...) ::ess::throw_error(::fmt::format(__VA_ARGS__))

// Internal invariant: a failure is a bug in ESS, reported with the expression and location.
#define ESS_ASSERT(cond, ...)                                                              \
  do {                                                                                     \
    if (!(cond)) [[unlikely]] {                                                            \
      ::ess::throw_internal(#cond, __FILE__, __LINE__, ::fmt::format("" __VA_ARGS__));     \
    }                                                                                      \
  } while (0)
