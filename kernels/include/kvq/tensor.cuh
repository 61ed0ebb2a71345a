// kvq/tensor.cuh — the unit's I/O conversions and access to its two cached tensors (K and V) in
// the page layout of docs/LAYOUT.md. Every function works on one KV head of one sequence.
//
// The including unit defines first (kvq/common.cuh included before them):
//   D          head_dim;
//   IO         the KvqDtype of queries and outputs (decode) or of the K/V handed in (cache);
//   KTensor, VTensor   each tensor's layout, a struct of static constexpr members, every one
//              present whatever the tensor's kind (FP16 tensors hold zeros in the integer ones):
//     KIND (KvqKind), BLOCK_BYTES (one page of one KV head), LOCAL (FP16 local window),
//     TAIL_CAP (rows of the FP16 tail ring), BITS, PER_WORD (codes a u32 word of the low plane),
//     MASK, LOW_PLANE_WORDS (3-bit codes: words of the 2-bit plane a row), ROW_WORDS,
//     AXIS (KvqAxis), SYMMETRIC, OFFSET (offset-binary shift of symmetric codes), GROUP,
//     GROUPS_PER_TOKEN, CODES_OFFSET, SCALES_OFFSET, ZEROS_OFFSET (bytes into a block),
//     LEVELS (largest code magnitude), SCALE_COUNT (scale entries a block), and Kitty's boost:
//     BOOST, BOOST_BY (KvqBoostBy), BOOST_LEVELS, BOOST_CHANNELS, HIGH_BITS, HIGH_PER_WORD,
//     HIGH_MASK, HIGH_ROW_WORDS, HIGH_OFFSET, MAP_OFFSET, SLOTS_OFFSET.
//
// The accessors are templates on a tensor's struct; k_* and v_* (and K_BLOCK_BYTES, K_LOCAL,
// K_TAIL_CAP, …) name them for the unit's two tensors. They are meaningful for integer tensors
// only; for an FP16 tensor they compile (divisors are kept non-zero) and go unused.
#pragma once

#include "kvq/io.cuh"

// A divisor of a tensor's struct that is 0 for FP16 tensors, as 1 there.
static __device__ __forceinline__ constexpr int kvq_divisor(int x) { return x > 0 ? x : 1; }

// Code of channel c in row `row` of a page block: low plane(s) first, little-endian in u32 words.
template <class T>
static __device__ __forceinline__ kvq_u32 kvq_code(const kvq_u8* block, int row, int c) {
    const kvq_u32* r = (const kvq_u32*)(block + T::CODES_OFFSET) + row * T::ROW_WORDS;
    if constexpr (T::BITS == 3) {
        const kvq_u32 lo = (r[c >> 4] >> ((c & 15) * 2)) & 3u;
        const kvq_u32 hi = (r[T::LOW_PLANE_WORDS + (c >> 5)] >> (c & 31)) & 1u;
        return lo | (hi << 2);
    } else {
        constexpr int PER_WORD = kvq_divisor(T::PER_WORD);
        return (r[c / PER_WORD] >> ((c % PER_WORD) * T::BITS)) & T::MASK;
    }
}
// Kitty: high bits of boosted channels, slot-ordered rows; the map sends channel -> slot (0xFF: none).
template <class T>
static __device__ __forceinline__ kvq_u32 kvq_boosted_code(const kvq_u8* block, int row, int c, kvq_u32 low) {
    constexpr int HIGH_PER_WORD = kvq_divisor(T::HIGH_PER_WORD);
    const int slot = block[T::MAP_OFFSET + c];
    if (slot == 0xFF) return low;
    const kvq_u32* r = (const kvq_u32*)(block + T::HIGH_OFFSET) + row * T::HIGH_ROW_WORDS;
    const kvq_u32 high = (r[slot / HIGH_PER_WORD] >> ((slot % HIGH_PER_WORD) * T::HIGH_BITS)) & T::HIGH_MASK;
    return low | (high << T::BITS);
}
// Offset of symmetric (offset-binary) codes: 2^(b-1) of the channel's own bit width.
template <class T>
static __device__ __forceinline__ int kvq_code_offset(const kvq_u8* block, int c) {
    if constexpr (T::BOOST && T::SYMMETRIC) return block[T::MAP_OFFSET + c] == 0xFF ? T::OFFSET : T::BOOST_LEVELS + 1;
    else return T::OFFSET;
}
// Scale and zero of (row, channel); symmetric codes are offset-binary, so zero = -offset * scale.
template <class T>
static __device__ __forceinline__ void kvq_scale_zero(const kvq_u8* block, int row, int c, float& s, float& z) {
    int i;
    if constexpr (T::AXIS == KvqAxis::Channel) i = c;
    else i = row * T::GROUPS_PER_TOKEN + c / T::GROUP;
    s = kvq_f16_to_f32(((const kvq_u16*)(block + T::SCALES_OFFSET))[i]);
    if constexpr (T::SYMMETRIC) z = -(float)kvq_code_offset<T>(block, c) * s;
    else z = kvq_f16_to_f32(((const kvq_u16*)(block + T::ZEROS_OFFSET))[i]);
}
template <class T>
static __device__ __forceinline__ kvq_u32 kvq_full_code(const kvq_u8* block, int row, int c) {
    if constexpr (T::BOOST) return kvq_boosted_code<T>(block, row, c, kvq_code<T>(block, row, c));
    else return kvq_code<T>(block, row, c);
}
// Dequantised value: fma(scale, code, zero) in f32, exactly as the CPU reference decodes.
template <class T>
static __device__ __forceinline__ float kvq_page_value(const kvq_u8* block, int row, int c) {
    float s, z;
    kvq_scale_zero<T>(block, row, c, s, z);
    if constexpr (T::SYMMETRIC) return s * (float)((int)kvq_full_code<T>(block, row, c) - kvq_code_offset<T>(block, c));
    else return fmaf(s, (float)kvq_full_code<T>(block, row, c), z);
}

// The unit's two tensors under the names its kernels use.
static constexpr int K_BLOCK_BYTES = KTensor::BLOCK_BYTES, K_LOCAL = KTensor::LOCAL, K_TAIL_CAP = KTensor::TAIL_CAP;
static constexpr int V_BLOCK_BYTES = VTensor::BLOCK_BYTES, V_LOCAL = VTensor::LOCAL, V_TAIL_CAP = VTensor::TAIL_CAP;
static __device__ __forceinline__ kvq_u32 k_code(const kvq_u8* b, int row, int c) { return kvq_code<KTensor>(b, row, c); }
static __device__ __forceinline__ kvq_u32 v_code(const kvq_u8* b, int row, int c) { return kvq_code<VTensor>(b, row, c); }
static __device__ __forceinline__ kvq_u32 k_boosted_code(const kvq_u8* b, int row, int c, kvq_u32 low) { return kvq_boosted_code<KTensor>(b, row, c, low); }
static __device__ __forceinline__ kvq_u32 v_boosted_code(const kvq_u8* b, int row, int c, kvq_u32 low) { return kvq_boosted_code<VTensor>(b, row, c, low); }
static __device__ __forceinline__ int k_offset(const kvq_u8* b, int c) { return kvq_code_offset<KTensor>(b, c); }
static __device__ __forceinline__ int v_offset(const kvq_u8* b, int c) { return kvq_code_offset<VTensor>(b, c); }
static __device__ __forceinline__ void k_scale_zero(const kvq_u8* b, int row, int c, float& s, float& z) { kvq_scale_zero<KTensor>(b, row, c, s, z); }
static __device__ __forceinline__ void v_scale_zero(const kvq_u8* b, int row, int c, float& s, float& z) { kvq_scale_zero<VTensor>(b, row, c, s, z); }
static __device__ __forceinline__ kvq_u32 k_full_code(const kvq_u8* b, int row, int c) { return kvq_full_code<KTensor>(b, row, c); }
static __device__ __forceinline__ kvq_u32 v_full_code(const kvq_u8* b, int row, int c) { return kvq_full_code<VTensor>(b, row, c); }
static __device__ __forceinline__ float k_page_value(const kvq_u8* b, int row, int c) { return kvq_page_value<KTensor>(b, row, c); }
static __device__ __forceinline__ float v_page_value(const kvq_u8* b, int row, int c) { return kvq_page_value<VTensor>(b, row, c); }
