// The emulated CUDA target's stand-in for the CUDA runtime API (see cuda_runtime.h here).
#pragma once

#include "cuda_runtime.h"  // IWYU pragma: export
