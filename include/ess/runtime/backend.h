// Which backends this build has, and what the machine offers.
//
// The CPU backend is always there. The CUDA backend is compiled into the runtime library
// when nvcc exists and registers itself when a program that links the runtime starts; code
// above the runtime never asks the compiler, only these functions. Without it, every CUDA op
// (ess/ops/*.h) returns kNoCudaDevice and every CUDA object refuses to be made, by name.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace ess {

class SlotStorage;

bool cuda_backend_built();
// Visible CUDA devices: 0 without the backend, a driver or a device (never throws).
int cuda_device_count();
bool cuda_device_present();
// The name of a device, "" when there is none.
std::string cuda_device_name(int device = 0);

// The Sparse Memory Pool's device backend: slots in device memory, filled by FlashTrans from
// the pinned Total Memory Pool. Throws ess::Error without the backend or the device.
std::unique_ptr<SlotStorage> make_device_slot_storage(int device = 0, void* stream = nullptr);

namespace cuda {
// The device pointer through which kernels reach mapped pinned host memory (equal to the
// host pointer under UVA). nullptr when `host` is not mapped pinned memory, or without the
// backend.
const std::uint8_t* device_view(const std::uint8_t* host);
}  // namespace cuda

}  // namespace ess
