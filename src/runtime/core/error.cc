#include "ess/core/error.h"

namespace ess {

void throw_error(std::string message) { throw Error(message); }
void throw_device_error(std::string message) { throw DeviceError(message); }
void throw_out_of_memory(std::string message) { throw OutOfMemory(message); }

void throw_internal(const char* expr, const char* file, int line, std::string message) {
  throw Error(fmt::format("internal error: check '{}' failed at {}:{}{}{}", expr, file, line,
                          message.empty() ? "" : ": ", message));
}

}  // namespace ess
