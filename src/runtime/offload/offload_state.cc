// The state Offload's front keeps and its backends read (offload_impl.h): which request holds a
// pool row, and the checks of a row or request a call names.
#include <cstring>

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

std::int64_t OffloadState::buffer_rows() const {
  if (config.region_blocks > 0) return buffer.blocks * buffer.rows.block_rows;
  return static_cast<std::int64_t>(config.max_requests) * config.rows_per_request();
}

void OffloadState::check_placed(std::int32_t row, RequestId id, const char* what) const {
  ESS_CHECK(pool_rows(0).placed(row), "offload: {} of request {} (row {}): it has no region yet (place it first)", what,
            id, row);
}

bool OffloadState::padding(std::int32_t row, const char* what, int position) const {
  ESS_CHECK(row >= -1, "offload: {}: position {} names row {}; -1 marks padding, other negative rows are refused",
            what, position, row);
  return row == -1;
}

void OffloadState::put_row(int layer, std::int32_t p, std::span<const std::uint8_t> entry) const {
  const auto l = static_cast<std::size_t>(layer);
  std::uint8_t* head = buffer.layer_base[l] + buffer.rows.offset(p);
  if (!buffer.split()) {
    std::memcpy(head, entry.data(), entry.size());
    return;
  }
  const auto h = static_cast<std::size_t>(buffer.tail.head_bytes);
  std::memcpy(head, entry.data(), h);
  std::memcpy(buffer.tail_base[l] + buffer.tail.rows.offset(p), entry.data() + h, static_cast<std::size_t>(buffer.tail.bytes));
}

void OffloadState::get_row(int layer, std::int32_t p, std::span<std::uint8_t> entry) const {
  const auto l = static_cast<std::size_t>(layer);
  const std::uint8_t* head = buffer.layer_base[l] + buffer.rows.offset(p);
  if (!buffer.split()) {
    std::memcpy(entry.data(), head, entry.size());
    return;
  }
  const auto h = static_cast<std::size_t>(buffer.tail.head_bytes), t = static_cast<std::size_t>(buffer.tail.bytes);
  std::memcpy(entry.data(), head, h);
  std::memcpy(entry.data() + h, buffer.tail_base[l] + buffer.tail.rows.offset(p), t);
}

}  // namespace ess
