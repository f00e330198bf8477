// The memory-flow allocator installed into PyTorch as its CUDA allocator.
// See torch_cuda_allocator.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "waterwave_allocator.h"

namespace wwrun::alloc::torch_cuda {

// Replaces PyTorch's CUDA caching allocator; must run before CUDA is initialised.
void install();
bool installed();
// The allocator core of `device`; throws if not installed.
MemoryFlowAllocator& core(int device);

}  // namespace wwrun::alloc::torch_cuda
