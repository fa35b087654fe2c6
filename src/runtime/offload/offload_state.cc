// The state Offload's front keeps and its backends read (offload_impl.h): which request holds a
// pool row, and the checks of a row or request a call names.
#include "ess/core/error.h"
#include "runtime/offload/offload_impl.h"

namespace ess {

std::int32_t OffloadState::find_row(RequestId id, const char* what) const {
  const auto it = row_of_request.find(id);
  ESS_CHECK(it != row_of_request.end(), "offload: {} of request {}: not admitted", what, id);
  return it->second;
}

RequestId OffloadState::request_at(std::int32_t row, const char* what, int position) const {
  ESS_CHECK(row >= 0 && row < config.max_requests, "offload: {}: position {} names row {}, outside [0, {})", what,
            position, row, config.max_requests);
  const RequestId id = request_of_row[static_cast<std::size_t>(row)];
  ESS_CHECK(id >= 0, "offload: {}: position {} names row {}, which holds no request", what, position, row);
  return id;
}

void OffloadState::check_step_length(const char* what, int layer, int position, RequestId id,
                                     std::int64_t length) const {
  const std::int64_t held = pool->length(id);
  if (pool->foreign() ? length >= 1 && length <= held : length == held) [[likely]] return;
  const std::string where = layer >= 0 ? fmt::format("offload: {} of layer {}", what, layer) : fmt::format("offload: {}", what);
  if (pool->foreign()) {
    throw Error(fmt::format("{}: position {} (request {}) has length {}; on foreign pages from 1 to the {} tokens the "
                            "request holds",
                            where, position, id, length, held));
  }
  throw Error(fmt::format("{}: position {} (request {}) has length {}, the request holds {} tokens (extend before the "
                          "step)",
                          where, position, id, length, held));
}

bool OffloadState::padding(std::int32_t row, const char* what, int position) const {
  ESS_CHECK(row >= -1, "offload: {}: position {} names row {}; -1 marks padding, other negative rows are refused",
            what, position, row);
  return row == -1;
}

}  // namespace ess
