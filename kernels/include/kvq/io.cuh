#pragma once
// The unit's 16-bit I/O format (IO, a KvqDtype the including unit defines): queries and outputs of
// a decode, new K/V handed to the cache kernels. Shared by every kernel family.

// Queries and outputs (decode) or new K/V (cache) in the unit's 16-bit format.
static __device__ __forceinline__ float kvq_io_to_f32(kvq_u16 x) { return kvq_to_f32<IO>(x); }
static __device__ __forceinline__ kvq_u16 kvq_f32_to_io(float x) { return kvq_from_f32<IO>(x); }
// One output value from a query row's unnormalised sum and softmax denominator (0 where no token
// was seen): the combine kernel's last step, which a decode launch of one part takes itself.
static __device__ __forceinline__ kvq_u16 kvq_output_value(float sum, float total) {
    return kvq_f32_to_io(total > 0.f ? sum / total : 0.f);
}
