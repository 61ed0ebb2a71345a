#pragma once
// Per-page parameters a decode warp loads: channel-axis V scales and zeros, the calibration constants.

// Per-channel (s, z) f16x2 broadcasts of this thread's V channels in a channel-axis V page, from
// its parameter section in the block (`params`: the scales, then the zeros).
static __device__ __forceinline__ void kvq_v_channel_params(const kvq_u8* params, int g, kvq_u32 (&s2)[NT], kvq_u32 (&z2)[NT]) {
    if constexpr (V_QUANT && VTensor::AXIS == KvqAxis::Channel) {
    kvq_u32 sw[NT / 2];
    kvq_load_share<8, 16, 16>(params, g, sw);
#pragma unroll
    for (int j = 0; j < NT; ++j) s2[j] = kvq_prmt(sw[j >> 1], sw[j >> 1], (j & 1) ? 0x3232u : 0x1010u);
    if constexpr (VTensor::SYMMETRIC) {
#pragma unroll
    for (int j = 0; j < NT; ++j) z2[j] = 0u;
    } else {
    kvq_u32 zw[NT / 2];
    kvq_load_share<8, 16, 16>(params + VTensor::ZEROS_OFFSET - VTensor::SCALES_OFFSET, g, zw);
#pragma unroll
    for (int j = 0; j < NT; ++j) z2[j] = kvq_prmt(zw[j >> 1], zw[j >> 1], (j & 1) ? 0x3232u : 0x1010u);
    }
    } else {
#pragma unroll
    for (int j = 0; j < NT; ++j) { s2[j] = 0u; z2[j] = 0u; }
    }
}

// Calibration constants of heads 2r, 2r+1: scores of quantized keys go through g(x) = a·x + b
// (natural units) before the softmax; in log2 units that is raw·(a·log2e/√D) + b·log2e.
static __device__ __forceinline__ void kvq_calibration(const float* score_range, int seq, int kvh, int kv_heads,
    int range_splits, int g, int r, float (&cmul)[2], float (&cadd)[2])
{
    const float base = KVQ_LOG2E * rsqrtf((float)D);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        cmul[e] = base; cadd[e] = 0.f;
        if constexpr (CALIBRATE) {
        // The eight lanes that share r (and so heads 2r, 2r+1) take every eighth split: the
        // split count grows as batches shrink, and one thread's serial loop over them sat in front
        // of every warp's first chunk.
        const int h = min(kvq_col_head(2 * r + e), GQA - 1);  // columns past GQA are computed, never used
        const float* rr;
        if constexpr (UNEVEN_GROUPS) rr = score_range + (kvq_head_row(seq, kvh, kv_heads) + h) * range_splits * 2;   // by query head
        else rr = score_range + (((long)seq * kv_heads + kvh) * GQA + h) * range_splits * 2;
        float lo = __int_as_float(0x7f800000), hi = KVQ_NEG_INF;
        for (int s = g; s < range_splits; s += 8) { lo = fminf(lo, rr[2 * s]); hi = fmaxf(hi, rr[2 * s + 1]); }
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
            hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
        }
        const float tau1 = KVQ_TAU1, tau2 = KVQ_TAU2;
        float a = 1.f;
        if (hi - lo > 0.f) a = (hi - lo + tau1 - tau2) / (hi - lo);
        cmul[e] = base * a;
        cadd[e] = KVQ_LOG2E * (lo - tau1 - a * lo);
        }
    }
}
