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

bool OffloadState::padding(std::int32_t row, const char* what, int position) const {
  ESS_CHECK(row >= -1, "offload: {}: position {} names row {}; -1 marks padding, other negative rows are refused",
            what, position, row);
  return row == -1;
}

}  // namespace ess
