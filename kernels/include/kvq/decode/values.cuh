#pragma once
// P·V: token-axis and channel-axis V codes (magic-number f16 or subnormals) and FP16 rows.

// KvqPairs::get reads field Q at the position kvq_pair_pos gives the layout maps (slabs.cuh,
// host-checked without KvqPairs): the two must agree, or subnormal units and the K fold drift.
template <int BITS, int Q = 0>
static __host__ __device__ constexpr bool kvq_pair_pos_agrees() {
    if constexpr (Q == 16 / BITS) return true;
    else return kvq_pair_pos<BITS>(Q) == Q * BITS - KvqPairs<BITS, 0>::template SHIFT<Q> && kvq_pair_pos_agrees<BITS, Q + 1>();
}
static_assert(kvq_pair_pos_agrees<1>() && kvq_pair_pos_agrees<2>() && kvq_pair_pos_agrees<4>(), "KvqPairs::get and kvq_pair_pos agree");

// The pairs of two tokens' blocks `a` and `b` of a V row: half H of each, interleaved (token a
// in the low half of each f16x2), becomes its pairs.
template <int BITS, int OFF, bool SUB, int H = 0>
static __device__ __forceinline__ void kvq_v_pairs(const kvq_u32* a, const kvq_u32* b, kvq_u32* vp) {
    if constexpr (H < kvq_block_halves<8, BITS>()) {
        using L = KvqVHalfOf<BITS, H>;
        const kvq_u32 comb = kvq_prmt(a[H >> 1], b[H >> 1], (H & 1) ? 0x7632u : 0x5410u);
        KvqPairs<BITS, OFF>::template get<SUB, L::PAIRS>(comb, vp + L::FIRST);
        kvq_v_pairs<BITS, OFF, SUB, H + 1>(a, b, vp);
    }
}

// O^T += V^T·P^T for a chunk. Thread (g, r) owns its lane group's block of NT channels
// (kvq/decode/slabs.cuh) and tokens 2r, 2r+1, 2r+8, 2r+9 of each subtile; token pairs are
// interleaved with prmt so each f16x2 holds one channel of two tokens. MODE 0: values as they are
// (f16 rows, or token-axis codes whose scale went into P); MODE 1: channel-axis dequantisation with
// per-channel (s, z) f16x2 broadcasts; MODE 2: token-axis codes as subnormals (V_SUBNORMAL), summed
// from 0 in their pairs' units, with the chunk's Σ p' per head (an mma against ones) added to
// `psum`, which kvq_centre_flush takes off as OFF·Σ p' every other K page, so the running sums stay
// near those of MODE 0: the f16 rounding of p' meets c − OFF, not c (uncentred over a warp's whole
// range, long spans lost precision). Other modes leave `psum` alone. Each V fragment, loaded and
// converted once, meets every head tile t's P^T (pb[t]) into acc[t] (and psum[t]).
template <int BITS, int OFF, int MODE, bool GUARD, int TILES>
static __device__ __forceinline__ void kvq_chunk_pv(const kvq_u8* rows, int n, int g, int r,
    const kvq_u32 (&pb)[TILES][NSUB][2], const kvq_u32* s2, const kvq_u32* z2, float (&acc)[TILES][MT][4], float (&psum)[TILES][4])
{
    constexpr int VH = kvq_block_halves<8, BITS>();   // 16-bit halves of a thread's channels of one row (kvq/decode/slabs.cuh)
    constexpr int VW = (VH + 1) / 2;                  // words (the last half-filled where VH is odd)
    constexpr int PRE = (4 * VW * NSUB <= 32) ? NSUB : ((32 / (4 * VW)) > 0 ? (32 / (4 * VW)) : 1);
    constexpr int ROW = BITS == 16 ? D * 2 : V_ROW_BYTES;
    constexpr bool CENTRE = MODE == 2 && OFF != 0;
#pragma unroll
    for (int s0 = 0; s0 < NSUB; s0 += PRE) {
        kvq_u32 raw[PRE][4][VW];
#pragma unroll
        for (int s = 0; s < PRE; ++s) {
            if (kvq_subtile_live<GUARD>(s0 + s, n)) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int t = kvq_row<GUARD>((s0 + s) * 16 + 2 * r + (j & 1) + (j >> 1) * 8, n);
                    kvq_load_share<8, BITS, kvq_align_of(ROW), 0, DVV / 8, 0, BITS < 16>(rows + (long)t * ROW, g, raw[s][j]);
                }
            }
        }
#pragma unroll
        for (int s = 0; s < PRE; ++s) {
            if (kvq_subtile_live<GUARD>(s0 + s, n)) {
                kvq_u32 vp[2][NT];
#pragma unroll
                for (int pi = 0; pi < 2; ++pi) kvq_v_pairs<BITS, OFF, MODE == 2>(raw[s][2 * pi], raw[s][2 * pi + 1], vp[pi]);
                if constexpr (MODE == 1) {
#pragma unroll
                    for (int pi = 0; pi < 2; ++pi)
#pragma unroll
                        for (int j = 0; j < NT; ++j)
                            vp[pi][j] = OFF != 0 ? kvq_h2_mul(vp[pi][j], s2[j]) : kvq_h2_fma(vp[pi][j], s2[j], z2[j]);
                }
#pragma unroll
                for (int t = 0; t < TILES; ++t) {
#pragma unroll
                    for (int i = 0; i < MT; ++i)
                        kvq_mma(acc[t][i], vp[0][2 * i], vp[0][2 * i + 1], vp[1][2 * i], vp[1][2 * i + 1], pb[t][s0 + s][0], pb[t][s0 + s][1]);
                    if constexpr (CENTRE)
                        kvq_mma(psum[t], KVQ_H2_ONE, KVQ_H2_ONE, KVQ_H2_ONE, KVQ_H2_ONE, pb[t][s0 + s][0], pb[t][s0 + s][1]);
                }
            }
        }
    }
}

// Takes the centring of the subnormal pairs off the accumulators: OFF·Σ p' per head, summed over
// the chunks since the last time (`psum`, rescaled with acc), then restarts the sum.
static __device__ __forceinline__ void kvq_centre_flush(float (&acc)[MT][4], float (&psum)[4]) {
    if constexpr (V_SUBNORMAL && V_OFF != 0) {
        // acc (i, j) is pair 2i + j/2 of head 2r + j%2.
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                acc[i][j] = fmaf(-(float)V_OFF / kvq_v_pair_units<VBITS>(2 * i + (j >> 1)), psum[j & 1], acc[i][j]);
#pragma unroll
        for (int j = 0; j < 4; ++j) psum[j] = 0.f;
    }
}

// Accumulators into values (TO_VALUES) or back into the subnormal pairs' units (V_SUBNORMAL):
// powers of two, exact.
template <bool TO_VALUES>
static __device__ __forceinline__ void kvq_pair_units_apply(float (&acc)[MT][4]) {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float u = kvq_v_pair_units<VBITS>(2 * i + (j >> 1));
            acc[i][j] *= TO_VALUES ? u : 1.f / u;
        }
}

// Channel-axis V as subnormals (V_CHANNEL_SUB). P·V sums p·code·2^(pos−24) per channel, so the
// accumulators run in units u = s·2^(24−pos) of the current V page (scale s): a page's zeros add
// (z/u)·Σp per chunk, and a new page rescales them by u_old/u_new (once per page instead of two
// f16 ops per code pair: the code fix and the dequantising fma). A zero scale (whose codes are 0
// as kvq's quantizers write them) takes u = 2^-64·2^(24−pos), so any code there adds nothing
// visible. `vu` holds the units (1 before the first page and after FP16 rows), `vzq` z/u; `params`
// is the page's parameter section in its block (the scales, then the zeros).
static __device__ __forceinline__ void kvq_v_channel_units(const kvq_u8* params, int g, float (&vu)[NT], float (&vzq)[NT],
    float (&acc)[MT][4])
{
    if constexpr (V_CHANNEL_SUB) {
    kvq_u32 sw[NT / 2], zw[NT / 2];
    kvq_load_share<8, 16, 16>(params, g, sw);
    kvq_load_share<8, 16, 16>(params + VTensor::ZEROS_OFFSET - VTensor::SCALES_OFFSET, g, zw);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const float sv = kvq_f16_to_f32((kvq_u16)(sw[j >> 1] >> (16 * (j & 1))));
        const float zv = kvq_f16_to_f32((kvq_u16)(zw[j >> 1] >> (16 * (j & 1))));
        const float u = (sv != 0.f ? sv : 0x1p-64f) * kvq_v_pair_units<VBITS>(j);
        float inv;   // u is a normal float far from the range ends: the bare approximate reciprocal
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(u));
        const float ratio = vu[j] * inv;
        // Pair j is accumulator (j / 2, 2·(j % 2) + head).
        acc[j >> 1][2 * (j & 1)] *= ratio;
        acc[j >> 1][2 * (j & 1) + 1] *= ratio;
        vu[j] = u;
        vzq[j] = zv * inv;
    }
    }
}

// The accumulators back into values before FP16 rows add to them (V_CHANNEL_SUB; otherwise nothing).
static __device__ __forceinline__ void kvq_v_units_to_values(float (&vu)[NT], float (&acc)[MT][4], int& v_page) {
    if constexpr (V_CHANNEL_SUB) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            acc[j >> 1][2 * (j & 1)] *= vu[j];
            acc[j >> 1][2 * (j & 1) + 1] *= vu[j];
            vu[j] = 1.f;
        }
        v_page = -1;
    }
}

// P·V of a chunk of channel-axis V codes as subnormals (V_CHANNEL_SUB): the codes' sums, then the
// page's zeros times the chunk's Σ p per head (an mma against ones, from the same rounded p).
template <bool GUARD>
static __device__ __forceinline__ void kvq_chunk_pv_channel_sub(const kvq_u8* rows, int n, int g, int r,
    const kvq_u32 (&pb)[NSUB][2], const float (&vzq)[NT], float (&acc)[MT][4])
{
    float unused[4];
    kvq_chunk_pv<VBITS, 0, 2, GUARD>(rows, n, g, r, kvq_one(pb), nullptr, nullptr, kvq_one(acc), kvq_one(unused));   // MODE 2 reads no (s, z)
    float psum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < NSUB; ++s)
        if (kvq_subtile_live<GUARD>(s, n)) kvq_mma(psum, KVQ_H2_ONE, KVQ_H2_ONE, KVQ_H2_ONE, KVQ_H2_ONE, pb[s][0], pb[s][1]);
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(vzq[2 * i + (j >> 1)], psum[j & 1], acc[i][j]);
}

// P·V over FP16 rows in a quantized-V scheme (rare chunks): one m-tile's loads at a time. They add
// values, so where quantized chunks sum in the subnormal pairs' units they are added out of them.
static __device__ __forceinline__ void kvq_chunk_pv_lean(const kvq_u8* rows, int n, int g, int r,
    const kvq_u32 (&pb)[NSUB][2], float (&acc)[MT][4], float (&psum)[4])
{
    kvq_centre_flush(acc, psum);
    if constexpr (V_SUBNORMAL) kvq_pair_units_apply<true>(acc);
#pragma unroll
    for (int s = 0; s < NSUB; ++s) {
        if (s * 16 < n) {
            // The subtile's four rows are loaded before the first mma: one round trip per subtile.
            kvq_u32 w[4][MT];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const kvq_u8* const row = rows + (long)min(s * 16 + 2 * r + (j & 1) + (j >> 1) * 8, n - 1) * D * 2;
                const kvq_u32* t = (const kvq_u32*)(row + g * NT * 2);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    // Word i holds block-order channels 2i and 2i + 1, two channels of one slab's share.
                    if constexpr (KVQ_V_ONE_SLAB) {
                        w[j][i] = t[i];
                    } else {
                        const int c = kvq_share_channel<8>(2 * i, g);
                        w[j][i] = c < D ? *(const kvq_u32*)(row + 2 * c) : 0u;
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < MT; ++i)
                kvq_mma(acc[i], kvq_prmt(w[0][i], w[1][i], 0x5410u), kvq_prmt(w[0][i], w[1][i], 0x7632u), kvq_prmt(w[2][i], w[3][i], 0x5410u),
                        kvq_prmt(w[2][i], w[3][i], 0x7632u), pb[s][0], pb[s][1]);
        }
    }
    if constexpr (V_SUBNORMAL) kvq_pair_units_apply<false>(acc);
}
