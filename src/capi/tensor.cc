// DLTensor checks of the C ABI: every tensor is read once, when it is bound, and refused by
// name (which tensor, which dimension, which value) unless the backend can use it as is.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "capi/capi_internal.h"

namespace ess::capi {
namespace {

std::string device_string(const DLDevice& d) {
  switch (d.device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return fmt::format("cuda:{}", d.device_id);
    case kDLCUDAHost: return "cuda_host (pinned)";
    case kDLCUDAManaged: return fmt::format("cuda_managed:{}", d.device_id);
    default: return fmt::format("DLPack device type {}", static_cast<int>(d.device_type));
  }
}

void check_device(const DLTensor& t, const char* what, const Placement& p) {
  const DLDevice d = t.device;
  if (p.backend == Backend::kCpu) {
    ESS_CHECK(d.device_type == kDLCPU || d.device_type == kDLCUDAHost,
              "{} is on {}; the CPU backend needs host memory (cpu or pinned)", what, device_string(d));
  } else {
    const bool ok = (d.device_type == kDLCUDA && d.device_id == p.device) || d.device_type == kDLCUDAHost ||
                    (d.device_type == kDLCUDAManaged);
    ESS_CHECK(ok, "{} is on {}; the CUDA backend needs memory of cuda:{} (device, managed or pinned host)", what,
              device_string(d), p.device);
  }
}

// a x b, refused by name when it overflows int64 (a shape's elements, a stride's bytes).
std::int64_t product(std::int64_t a, std::int64_t b, const std::string& what, const std::vector<std::int64_t>& shape,
                     const char* of) {
  std::int64_t out = 0;
  ESS_CHECK(!__builtin_mul_overflow(a, b, &out), "{} has shape {}: its {} overflow 64 bits", what, shape_string(shape),
            of);
  return out;
}

}  // namespace

std::int64_t Tensor::elements() const {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  return n;
}

std::string shape_string(const std::vector<std::int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

Tensor checked(const DLTensor* t, const char* what, const Placement& placement) {
  ESS_CHECK(t != nullptr, "{} is required (got NULL)", what);
  ESS_CHECK(t->ndim >= 1 && t->ndim <= 8, "{} has {} dimensions (1 to 8 are accepted)", what, t->ndim);
  ESS_CHECK(t->shape != nullptr, "{} has no shape", what);
  Tensor v;
  v.shape.assign(t->shape, t->shape + t->ndim);
  for (int d = 0; d < t->ndim; ++d) {
    ESS_CHECK(v.shape[static_cast<std::size_t>(d)] >= 1, "{} has shape {}: dimension {} is empty", what,
              shape_string(v.shape), d);
  }
  ESS_CHECK(t->dtype.lanes == 1 && t->dtype.bits % 8 == 0 && t->dtype.bits >= 8,
            "{} has dtype code {} bits {} lanes {}: whole-byte scalar elements are needed", what,
            static_cast<int>(t->dtype.code), static_cast<int>(t->dtype.bits), static_cast<int>(t->dtype.lanes));
  v.item_bytes = t->dtype.bits / 8;
  std::int64_t bytes = v.item_bytes;  // elements() and every count below stay within int64
  for (std::int64_t size : v.shape) bytes = product(bytes, size, what, v.shape, "bytes");
  if (t->strides != nullptr) {
    std::int64_t expected = 1;
    for (int d = t->ndim - 1; d >= 0; --d) {
      const std::int64_t size = v.shape[static_cast<std::size_t>(d)];
      ESS_CHECK(size == 1 || t->strides[d] == expected,
                "{} is not contiguous: dimension {} of shape {} has stride {} (expected {}); pass a contiguous copy",
                what, d, shape_string(v.shape), t->strides[d], expected);
      expected *= size;
    }
  }
  ESS_CHECK(t->data != nullptr, "{} has no data (NULL)", what);
  check_device(*t, what, placement);
  v.data = static_cast<std::uint8_t*>(t->data) + t->byte_offset;
  return v;
}

std::int32_t* int32_tensor(const DLTensor* t, const char* what, const Placement& placement,
                           const std::vector<std::vector<std::int64_t>>& shapes) {
  const Tensor v = checked(t, what, placement);
  ESS_CHECK(t->dtype.code == kDLInt && t->dtype.bits == 32, "{} has dtype code {} bits {}: int32 is needed", what,
            static_cast<int>(t->dtype.code), static_cast<int>(t->dtype.bits));
  bool ok = false;
  std::vector<std::string> wanted;
  for (const auto& s : shapes) {
    ok = ok || s == v.shape;
    wanted.push_back(shape_string(s));
  }
  ESS_CHECK(ok, "{} has shape {}; expected {}", what, shape_string(v.shape), fmt::join(wanted, " or "));
  ESS_CHECK(reinterpret_cast<std::uintptr_t>(v.data) % 4 == 0, "{} is not 4-byte aligned", what);
  return reinterpret_cast<std::int32_t*>(v.data);
}

LayerTensor layer_tensor(const DLTensor* t, int layer, std::uint64_t entry_bytes, const Placement& placement, const char* name) {
  const std::string what = fmt::format("{} of layer {}", name, layer);
  ESS_CHECK(t != nullptr, "{} is required (got NULL)", what);
  ESS_CHECK(t->ndim >= 2 && t->ndim <= 8 && t->shape != nullptr,
            "{} has {} dimensions: [rows, E] or [blocks, block_rows, E] are accepted", what, t->ndim);
  ESS_CHECK(t->data != nullptr, "{} has no data (NULL)", what);
  ESS_CHECK(t->dtype.lanes == 1 && t->dtype.bits % 8 == 0 && t->dtype.bits >= 8,
            "{} has dtype bits {} lanes {}: whole-byte scalar elements are needed", what,
            static_cast<int>(t->dtype.bits), static_cast<int>(t->dtype.lanes));
  check_device(*t, what.c_str(), placement);
  const std::int64_t item = t->dtype.bits / 8;
  const std::vector<std::int64_t> shape(t->shape, t->shape + t->ndim);
  std::int64_t bytes = item;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    ESS_CHECK(shape[d] >= 1, "{} has shape {}: dimension {} is empty", what, shape_string(shape), d);
    bytes = product(bytes, shape[d], what, shape, "bytes");
  }
  std::vector<std::int64_t> strides(shape.size());
  if (t->strides != nullptr) {
    strides.assign(t->strides, t->strides + t->ndim);
  } else {
    std::int64_t s = 1;
    for (int d = t->ndim - 1; d >= 0; --d) {
      strides[static_cast<std::size_t>(d)] = s;
      s *= shape[static_cast<std::size_t>(d)];  // within the byte count checked above
    }
  }
  const std::int64_t last = shape.back();
  ESS_CHECK(static_cast<std::uint64_t>(last * item) == entry_bytes,
            "{} has shape {} of {}-byte elements: its last dimension spans {} bytes; a row holds {}", what,
            shape_string(shape), item, last * item, entry_bytes);
  ESS_CHECK(last == 1 || strides.back() == 1, "{}: the entry's dimension has stride {} (must be 1)", what,
            strides.back());
  std::vector<std::size_t> lead;  // leading dimensions of size > 1
  for (std::size_t d = 0; d + 1 < shape.size(); ++d) {
    if (shape[d] > 1) lead.push_back(d);
  }
  ESS_CHECK(lead.size() <= 2, "{} has shape {}: more than two row dimensions ([rows, E] or [blocks, block_rows, E])",
            what, shape_string(shape));
  LayerTensor out;
  out.base = static_cast<std::uint8_t*>(t->data) + t->byte_offset;
  std::int64_t span = item;  // the bytes from the first row to the end of the last
  for (std::size_t d : lead) {
    ESS_CHECK(strides[d] > 0, "{}: dimension {} has stride {} (must be positive)", what, d, strides[d]);
    const std::int64_t step = product(strides[d], item, what, shape, "strides in bytes");
    std::int64_t reach = 0;
    ESS_CHECK(!__builtin_mul_overflow(step, shape[d] - 1, &reach) && !__builtin_add_overflow(span, reach, &span),
              "{} has shape {} with stride {} in dimension {}: the rows it spans overflow 64 bits", what,
              shape_string(shape), strides[d], d);
  }
  if (lead.empty()) {
    out.rows.row_stride = entry_bytes;
    out.capacity = 1;
  } else if (lead.size() == 1) {
    out.rows.row_stride = static_cast<std::uint64_t>(strides[lead[0]] * item);
    out.capacity = shape[lead[0]];
  } else {
    out.rows.block_stride = static_cast<std::uint64_t>(strides[lead[0]] * item);
    out.rows.row_stride = static_cast<std::uint64_t>(strides[lead[1]] * item);
    out.rows.block_rows = shape[lead[1]];
    out.capacity = shape[lead[0]] * shape[lead[1]];
  }
  return out;
}

}  // namespace ess::capi
