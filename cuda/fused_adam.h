#pragma once
// Host entry points of the fused CUDA Adam/AdamW (fused_adam.cu); internal to
// shardtorch. Pointers are device memory of n elements; `low` (may be null)
// receives the updated parameters as bf16 bits.
#include <cstdint>

#include "adam_math.h"

namespace shardtorch::cuda {

/// Queues one update on `stream` (a cudaStream_t). Returns a cudaError_t
/// (0 on success) of the launch, not of the kernel's execution.
int fused_adam_launch(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, uint16_t* low, int64_t n,
                      const AdamCoeffs& c, void* stream);
const char* fused_adam_error_string(int code);

}  // namespace shardtorch::cuda
