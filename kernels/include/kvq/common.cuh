// kvq/common.cuh — helpers every kvq kernel shares: 16-bit float conversions through PTX, warp
// reductions, programmatic dependent launch, and the enums the units' traits are written in.
//
// Header-free on purpose: only the driver and libnvrtc are needed to compile kvq's kernels, so
// nothing here includes a CUDA header. Nothing here depends on a unit's constants either; the
// per-unit pieces (the I/O dtype, the cached tensors' layouts) live in kvq/tensor.cuh.
#pragma once

// Helpers a variant does not use are fine: silence "declared but never referenced".
#pragma nv_diag_suppress 177

typedef unsigned char kvq_u8;
typedef unsigned short kvq_u16;
typedef unsigned int kvq_u32;
typedef int kvq_i32;
#define KVQ_NEG_INF __int_as_float(0xff800000)

// The 16-bit float format of a unit's queries and outputs (decode) or of the K/V it is handed
// (cache kernels). The cache's own FP16 regions are always IEEE half.
enum class KvqDtype { F16, Bf16 };
// How a cached tensor is stored: FP16 pages, or integer codes with per-group scales (and zeros).
enum class KvqKind { Fp16, Int };
// The axis an integer tensor's groups run along: a channel over a page's tokens, or a slice of
// one token's channels.
enum class KvqAxis { Channel, Token };
// What ranks Kitty's boosted channels: the sum of |x| or the variance over the page.
enum class KvqBoostBy { Magnitude, Variance };

static __device__ __forceinline__ float kvq_f16_to_f32(kvq_u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
static __device__ __forceinline__ kvq_u16 kvq_f32_to_f16(float f) {
    kvq_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// Directed f32 -> f16 conversions (the CPU reference's f16_down / f16_up) and the next f16 up.
static __device__ __forceinline__ kvq_u16 kvq_f32_to_f16_rd(float f) {
    kvq_u16 h;
    asm("cvt.rm.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
static __device__ __forceinline__ kvq_u16 kvq_f32_to_f16_ru(float f) {
    kvq_u16 h;
    asm("cvt.rp.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
static __device__ __forceinline__ kvq_u16 kvq_f16_next_up(kvq_u16 b) {
    if ((b & 0x7fff) == 0) return 0x0001;
    return (b & 0x8000) == 0 ? (kvq_u16)(b + 1) : (kvq_u16)(b - 1);
}
static __device__ __forceinline__ float kvq_bf16_to_f32(kvq_u16 h) {
    return __uint_as_float(((kvq_u32)h) << 16);
}
static __device__ __forceinline__ kvq_u16 kvq_f32_to_bf16(float f) {
    kvq_u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// A 16-bit float of format T to f32 and back (round to nearest even).
template <KvqDtype T>
static __device__ __forceinline__ float kvq_to_f32(kvq_u16 x) {
    if constexpr (T == KvqDtype::Bf16) return kvq_bf16_to_f32(x);
    else return kvq_f16_to_f32(x);
}
template <KvqDtype T>
static __device__ __forceinline__ kvq_u16 kvq_from_f32(float x) {
    if constexpr (T == KvqDtype::Bf16) return kvq_f32_to_bf16(x);
    else return kvq_f32_to_f16(x);
}

static __device__ __forceinline__ float kvq_warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
static __device__ __forceinline__ float kvq_warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
static __device__ __forceinline__ float kvq_warp_min(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// Programmatic dependent launch (sm_90 on): a grid lets the runtime schedule the next grid of the
// step early (range → decode → combine), and that grid waits here for its predecessor's writes
// before reading them. Both are no-ops when the launch did not ask for the overlap (and compile
// away before sm_90).
static __device__ __forceinline__ void kvq_allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
static __device__ __forceinline__ void kvq_wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
