// kvq/quantize_regs.cuh — the coarsened and vectorized page quantizers: a page of one KV head
// lives in registers, so the only shared memory is a few KB of per-channel reductions (none at
// all for token-axis groups) and the only barriers are the channel reductions'. Bit-exact with
// kvq_reference::int like the tiled form: the same group parameters, the same division-free exact
// encoding, Kitty's fold order.
//
// Lane l of warp w holds channels 8·(l % LPR) .. +7 of rows r0 + i·RS (r0 = w·RPW + l / LPR,
// i < ITER), loaded as one 16-byte vector per row (vectorized) or as eight 16-bit values
// (coarsened). A row's D / 8 chunks take LPR lanes, the next power of two: where that is more
// (D = 80, 96, 112, 160, 192, …), the lanes past the row's chunks ("idle") hold no channel,
// take part in the shuffles with neutral values and zero fields, and store only the zero
// padding at the end of a row. Templates on the tensor's quantizer traits Q (kvq/quantize.cuh
// lists them).
#pragma once
#include "kvq/quantize.cuh"

// The smallest power of two at least x.
static __host__ __device__ constexpr int kvq_pow2_at_least(int x) {
    int p = 1;
    while (p < x) p *= 2;
    return p;
}

// The register forms' thread layout for a quantizer Q.
template <class Q>
struct KvqRegShape {
    static constexpr int THREADS = Q::THREADS;
    static constexpr int ITER = Q::REG_ITER;
    // A row's 8-channel chunks, and whether lanes past them idle (enumerators: unlike static
    // members they emit no PTX global).
    enum : int { CHUNKS = D / 8 };
    enum : bool { IDLE = kvq_pow2_at_least(CHUNKS) != CHUNKS };
    static constexpr int LPR = kvq_pow2_at_least(CHUNKS);  // lanes per row
    static constexpr int RPW = 32 / LPR;              // rows per warp and step
    static constexpr int WARPS = THREADS / 32;
    static constexpr int RS = WARPS * RPW;            // rows per step (a power of two)
    static_assert(ITER * RS >= PAGE, "a step pattern that misses rows of the page");
};

// Value j (0..7) of this lane's chunk of one row, as f32.
template <bool BF16>
static __device__ __forceinline__ float kvq_lane_value(const kvq_u32 (&w)[4], int j) {
    return kvq_raw_to_f32<BF16>((kvq_u16)((j & 1) ? (w[j / 2] >> 16) : (w[j / 2] & 0xFFFFu)));
}

// Packs bit field SHIFT.. (WIDTH bits) of this lane's 8 codes into the row's words: the lanes whose
// fields share a word OR them with shuffles (every lane takes part; `valid` gates the stores only).
template <class Q, int WIDTH, int SHIFT>
static __device__ __forceinline__ void kvq_store_field(const kvq_u32 (&bits)[8], kvq_u32* words, int chunk, bool valid) {
    constexpr int F = 8 * WIDTH;
    constexpr kvq_u32 MASK = (1u << WIDTH) - 1u;
    if constexpr (F == 64) {
        kvq_u32 a = 0, b = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            a |= ((bits[j] >> SHIFT) & MASK) << (WIDTH * j);
            b |= ((bits[j + 4] >> SHIFT) & MASK) << (WIDTH * j);
        }
        if (valid) {
            if constexpr (Q::CODES_OFFSET % 8 == 0) {
                *(uint2*)(words + 2 * chunk) = make_uint2(a, b);
            } else {
                words[2 * chunk] = a;
                words[2 * chunk + 1] = b;
            }
        }
    } else {
        constexpr int L = 32 / F;  // lanes per word
        kvq_u32 f = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) f |= ((bits[j] >> SHIFT) & MASK) << (WIDTH * j);
        f <<= (chunk % L) * F;
#pragma unroll
        for (int o = 1; o < L; o <<= 1) f |= __shfl_xor_sync(0xffffffffu, f, o);
        if (valid && chunk % L == 0) words[chunk / L] = f;
    }
}

// Zeroes an idle lane's codes (their fields are the zero padding of a row's last word, which the
// row's last live lanes OR in and store).
template <class S>
static __device__ __forceinline__ void kvq_zero_idle(kvq_u32 (&bits)[8], bool live) {
    if constexpr (S::IDLE)
        if (!live)
#pragma unroll
            for (int j = 0; j < 8; ++j) bits[j] = 0;
}

// Stores this lane's 8 codes of row r (the bits encode_bits returned).
template <class Q>
static __device__ __forceinline__ void kvq_store_row(kvq_u8* block, int r, const kvq_u32 (&bits)[8], int chunk, bool valid) {
    kvq_u32* words = (kvq_u32*)(block + Q::CODES_OFFSET) + r * Q::ROW_WORDS;
    if constexpr (Q::BITS == 3) {
        kvq_store_field<Q, 2, 0>(bits, words, chunk, valid);
        kvq_store_field<Q, 1, 2>(bits, words + Q::LOW_PLANE_WORDS, chunk, valid);
    } else {
        kvq_store_field<Q, Q::BITS, 0>(bits, words, chunk, valid);
    }
}

// Stores the low WIDTH (1 or 2) bits of this lane's 8 codes, given as the nibbles of `nib`: the
// lane's field is 8·WIDTH bits at its own byte or halfword of the row, so no other lane is involved.
template <int WIDTH>
static __device__ __forceinline__ void kvq_store_low_nibbles(kvq_u32 nib, kvq_u32* words, int chunk, bool valid) {
    static_assert(WIDTH == 1 || WIDTH == 2, "nibble codes carry a 1- or 2-bit low plane");
    kvq_u32 x;
    if constexpr (WIDTH == 2) {
        x = nib & 0x33333333u;
        x = (x | (x >> 2)) & 0x0F0F0F0Fu;
        x = (x | (x >> 4)) & 0x00FF00FFu;
        x = (x | (x >> 8)) & 0x0000FFFFu;
        if (valid) ((kvq_u16*)words)[chunk] = (kvq_u16)x;
    } else {
        x = nib & 0x11111111u;
        x = (x | (x >> 3)) & 0x03030303u;
        x = (x | (x >> 6)) & 0x000F000Fu;
        x = (x | (x >> 12)) & 0x000000FFu;
        if (valid) ((kvq_u8*)words)[chunk] = (kvq_u8)x;
    }
}

// The boosted channels of a page, by one warp, from the row classes' score partials (s_part[r·D + c],
// r < RS): lane l folds channels l·CPL .. l·CPL + CPL − 1 over the row classes in the reference's
// order; a bisection on the scores' bits (non-negative floats order as their bits) finds the K-th
// largest score T with warp sums only; channels above T and the first ones equal to T in channel
// order are boosted (ties to the lower channel); slots are prefix counts in channel order.
// CPL = ceil(D / 32): where D is not a multiple of 32 the last lanes' channels past D hold key 0,
// are never counted as a tie, and are never boosted.
// Writes s_map (slot, or 0xFF) and s_chan (the channel of each slot).
template <class Q>
static __device__ __forceinline__ void kvq_select_warp(const float* s_part, kvq_u8* s_map, kvq_u8* s_chan, int lane) {
    constexpr int CPL = (D + 31) / 32, K = Q::BOOST_CHANNELS, RS = KvqRegShape<Q>::RS;
    constexpr bool PAST = D % 32 != 0;  // lanes with channels past D
    kvq_u32 key[CPL];
#pragma unroll
    for (int e0 = 0; e0 < CPL; e0 += (CPL % 4 == 0 ? 4 : 1)) {
        constexpr int V = CPL % 4 == 0 ? 4 : 1;  // channels per shared-memory load
        float v[V][RS];
#pragma unroll
        for (int r = 0; r < RS; ++r) {
            const float* at = s_part + r * D + lane * CPL + e0;
            if constexpr (PAST) {
                if (lane * CPL + e0 >= D) {  // V channels past D (D is a multiple of 4)
#pragma unroll
                    for (int e = 0; e < V; ++e) v[e][r] = 0.f;
                    continue;
                }
            }
            if constexpr (V == 4) {
                const float4 q = *(const float4*)at;
                v[0][r] = q.x; v[1][r] = q.y; v[2][r] = q.z; v[3][r] = q.w;
            } else {
                v[0][r] = *at;
            }
        }
#pragma unroll
        for (int e = 0; e < V; ++e) {
            kvq_fold_halves<RS>(v[e]);
            key[e0 + e] = __float_as_uint(v[e][0]);
        }
    }
    kvq_u32 t = 0;
    for (int bit = 30; bit >= 0; --bit) {
        const kvq_u32 below = t | ((1u << bit) - 1u);  // the candidate t | 2^bit, minus one
        kvq_u32 n = 0;
#pragma unroll
        for (int e = 0; e < CPL; ++e) n += (below - key[e]) >> 31;  // key > below
        const kvq_u32 total = __reduce_add_sync(0xffffffffu, n);
        if (total >= (kvq_u32)K) {
            t = below + 1u;
            if (total == (kvq_u32)K) break;  // exactly K scores reach t: no tie at the threshold
        }
    }
    int above = 0, equal = 0;
#pragma unroll
    for (int e = 0; e < CPL; ++e) { above += key[e] > t; equal += key[e] == t && !(PAST && lane * CPL + e >= D); }
    const int need = K - (int)__reduce_add_sync(0xffffffffu, (kvq_u32)above);
    int ties = kvq_warp_exclusive_scan(equal, lane);
    kvq_u32 flags = 0;
    int count = 0;
#pragma unroll
    for (int e = 0; e < CPL; ++e) {
        const bool tie = key[e] == t && !(PAST && lane * CPL + e >= D), boosted = key[e] > t || (tie && ties < need);
        ties += tie;
        flags |= (kvq_u32)boosted << e;
        count += boosted;
    }
    int slot = kvq_warp_exclusive_scan(count, lane);
#pragma unroll
    for (int e = 0; e < CPL; ++e) {
        const int c = lane * CPL + e;
        if (PAST && c >= D) break;
        if ((flags >> e) & 1u) {
            s_map[c] = (kvq_u8)slot;
            s_chan[slot] = (kvq_u8)c;
            ++slot;
        } else {
            s_map[c] = 0xFF;
        }
    }
}

// Channel groups with Kitty's boost, in two barriers: (a) each lane folds its rows' score terms in
// registers, one partial per row class; (b) one warp folds the row classes in the reference's
// order and selects the boosted channels while the other warps compute every channel's parameters
// at both widths; (c) each lane takes its channels' parameters at their width, encodes, and
// gathers the high plane. `w`: this lane's rows; s_lo/s_hi: the warps' min/max pairs.
template <class Q, bool BF16>
static __device__ __forceinline__ void kvq_regs_boosted(const kvq_u32 (&w)[KvqRegShape<Q>::ITER][4], kvq_u8* block,
                                                       const kvq_u32 (*s_lo)[D / 2], const kvq_u32 (*s_hi)[D / 2],
                                                       kvq_u16* scales, kvq_u16* zeros) {
    using S = KvqRegShape<Q>;
    constexpr int LPR = S::LPR, RPW = S::RPW, RS = S::RS, ITER = S::ITER;
    const bool sym = Q::SYMMETRIC;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int chunk = lane % LPR, r0 = warp * RPW + lane / LPR, c0 = chunk * 8;
    const bool live = !S::IDLE || chunk < S::CHUNKS;  // this lane holds channels
    const int cr = live ? c0 : 0;                               // where it reads per-channel data
    constexpr int SEL = S::WARPS - 1;                        // the selecting warp
    constexpr int PT = (S::WARPS > 1 ? S::WARPS - 1 : 1) * 32;  // threads computing parameters
    constexpr bool VARIANCE = Q::BOOST_BY == KvqBoostBy::Variance;
    __shared__ __align__(16) float s_part[RS * D];
    __shared__ float4 s_par[2][D];  // base, boosted width: (scale, 1/scale, zero, f16 scale | f16 zero << 16)
    __shared__ __align__(8) kvq_u8 s_map[D];
    __shared__ kvq_u8 s_chan[Q::BOOST_CHANNELS];  // the channel of each slot
    __shared__ float s_mean[VARIANCE ? D : 1];
    if constexpr (VARIANCE) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float acc[ITER];
#pragma unroll
            for (int i = 0; i < ITER; ++i) acc[i] = PAGE == ITER * RS || r0 + i * RS < PAGE ? kvq_lane_value<BF16>(w[i], j) : 0.f;
            if (live) s_part[r0 * D + c0 + j] = kvq_fold_registers<ITER>(acc);
        }
        __syncthreads();
        kvq_fold_partials<RS>(s_part, s_mean, true);  // the means
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float mean = VARIANCE ? s_mean[cr + j] : 0.f;
        float acc[ITER];
#pragma unroll
        for (int i = 0; i < ITER; ++i)
            acc[i] = PAGE == ITER * RS || r0 + i * RS < PAGE ? kvq_score_term<Q>(kvq_lane_value<BF16>(w[i], j), mean) : 0.f;
        if (live) s_part[r0 * D + c0 + j] = kvq_fold_registers<ITER>(acc);
    }
    __syncthreads();
    if (warp == SEL) kvq_select_warp<Q>(s_part, s_map, s_chan, lane);
    if (S::WARPS == 1 || warp != SEL) {
        for (int c = tid; c < D; c += PT) {
            float lo = __int_as_float(0x7f800000), hi = KVQ_NEG_INF;
#pragma unroll
            for (int k = 0; k < S::WARPS; ++k) {
                lo = fminf(lo, kvq_raw_to_f32<BF16>(((const kvq_u16*)s_lo[k])[c]));
                hi = fmaxf(hi, kvq_raw_to_f32<BF16>(((const kvq_u16*)s_hi[k])[c]));
            }
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                kvq_u16 sh, zh;
                kvq_group_params<Q>(lo, hi, b ? (float)Q::BOOST_LEVELS : (float)Q::LEVELS, sym, sh, zh);
                const float sf = kvq_f16_to_f32(sh);
                s_par[b][c] = make_float4(sf, sf == 0.f ? 0.f : __frcp_rn(sf), kvq_f16_to_f32(zh),
                                          __uint_as_float((kvq_u32)sh | ((kvq_u32)zh << 16)));
            }
        }
    }
    __syncthreads();
    // This lane's channels at their width; warp 0 stores the block's slot table and its first row
    // of lanes the map, scales and zeros.
    const uint2 map8 = *(const uint2*)(s_map + cr);
    float sf[8], inv[8], zf[8], lv[8];
    kvq_u32 raw[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const bool boosted = (((j < 4 ? map8.x : map8.y) >> (8 * (j % 4))) & 0xFFu) != 0xFFu;
        const float4 q = s_par[boosted][cr + j];
        sf[j] = q.x; inv[j] = q.y; zf[j] = q.z; raw[j] = __float_as_uint(q.w);
        lv[j] = boosted ? (float)Q::BOOST_LEVELS : (float)Q::LEVELS;  // symmetric codes only
    }
    if (warp == 0)  // the slot table, written by the selecting warp before the last barrier
        for (int s = lane; s < Q::BOOST_CHANNELS; s += 32) block[Q::SLOTS_OFFSET + s] = s_chan[s];
    if (warp == 0 && lane < S::CHUNKS) {
        *(uint2*)(block + Q::MAP_OFFSET + c0) = map8;
        *(uint4*)(scales + c0) = make_uint4(__byte_perm(raw[0], raw[1], 0x5410), __byte_perm(raw[2], raw[3], 0x5410),
                                            __byte_perm(raw[4], raw[5], 0x5410), __byte_perm(raw[6], raw[7], 0x5410));
        if constexpr (!Q::SYMMETRIC)
            *(uint4*)(zeros + c0) = make_uint4(__byte_perm(raw[0], raw[1], 0x7632), __byte_perm(raw[2], raw[3], 0x7632),
                                               __byte_perm(raw[4], raw[5], 0x7632), __byte_perm(raw[6], raw[7], 0x7632));
    }
    // The high plane: lane `chunk` of a row gathers slots s = p·LPR + chunk (p < HPASS), each the
    // high field of channel s_chan[s] from the lane holding it (a shuffle), rotated to its place in
    // the row's word; the SPW lanes sharing a word OR their parts. A lane's fields: with codes of
    // at most 4 bits, its 8 codes as nibbles (also the source of the low plane), else the high
    // fields alone.
    constexpr bool NIBBLES = Q::BITS + Q::HIGH_BITS <= 4;
    constexpr int HB = Q::HIGH_BITS, PERW = 32 / HB;
    constexpr int FSTRIDE = NIBBLES ? 4 : HB, FOFF = NIBBLES ? Q::BITS : 0;
    constexpr int SPW = PERW < LPR ? PERW : LPR;      // lanes whose slots share a word in one pass
    constexpr int PPW = PERW > LPR ? PERW / LPR : 1;  // passes whose slots share a word
    constexpr int HPASS = ((Q::BOOST_CHANNELS + LPR - 1) / LPR + PPW - 1) / PPW * PPW;
    constexpr int NQ = HPASS / PPW;                   // words a lane's slots fall in, per row
    int hsrc[HPASS];
    kvq_u32 hrot[HPASS], hmsk[HPASS];
#pragma unroll
    for (int p = 0; p < HPASS; ++p) {
        const int s = p * LPR + chunk;
        const int ch = s < Q::BOOST_CHANNELS ? s_chan[s] : 0, dst = (s % PERW) * HB;
        hsrc[p] = lane - chunk + ch / 8;
        hrot[p] = (kvq_u32)(FSTRIDE * (ch % 8) + FOFF - dst) & 31u;
        hmsk[p] = s < Q::BOOST_CHANNELS ? Q::HIGH_MASK << dst : 0u;
    }
#pragma unroll
    for (int i = 0; i < ITER; ++i) {
        const int r = r0 + i * RS;
        const bool valid = PAGE == ITER * RS || r < PAGE;
        kvq_u32 bits[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) bits[j] = kvq_encode_bits(kvq_lane_value<BF16>(w[i], j), sf[j], inv[j], zf[j], lv[j], sym);
        kvq_u32* words = (kvq_u32*)(block + Q::CODES_OFFSET) + (valid ? r : 0) * Q::ROW_WORDS;
        kvq_u32 fields;
        if constexpr (NIBBLES) {
            // bits[j] = 0x4B400000 + code: their sum shifted by 4j is the codes' nibbles plus a constant.
            fields = bits[0];
#pragma unroll
            for (int j = 1; j < 8; ++j) fields += bits[j] << (4 * j);
            fields -= 0x3F400000u;  // Σ_j 0x4B400000 << 4j (mod 2^32)
            if constexpr (S::IDLE) {
                // An idle lane's byte (1-bit codes) may be the padding of the row's last word: zero.
                if (!live) fields = 0;
                kvq_store_low_nibbles<Q::BITS>(fields, words, chunk, valid && chunk * Q::BITS < 4 * Q::ROW_WORDS);
            } else {
                kvq_store_low_nibbles<Q::BITS>(fields, words, chunk, valid);
            }
        } else {
            kvq_zero_idle<S>(bits, live);
            kvq_store_field<Q, Q::BITS, 0>(bits, words, chunk, valid && live);
            fields = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) fields |= ((bits[j] >> Q::BITS) & Q::HIGH_MASK) << (HB * j);
        }
        kvq_u32* high = (kvq_u32*)(block + Q::HIGH_OFFSET) + (valid ? r : 0) * Q::HIGH_ROW_WORDS;
#pragma unroll
        for (int q = 0; q < NQ; ++q) {
            kvq_u32 acc = 0;
#pragma unroll
            for (int p = q * PPW; p < (q + 1) * PPW; ++p) {
                const kvq_u32 f = __shfl_sync(0xffffffffu, fields, hsrc[p]);
                acc |= __funnelshift_r(f, f, hrot[p]) & hmsk[p];
            }
#pragma unroll
            for (int o = 1; o < SPW; o <<= 1) acc |= __shfl_xor_sync(0xffffffffu, acc, o);
            const int word = (q * PPW * LPR + chunk) / PERW;
            if (valid && chunk % SPW == 0 && word < Q::HIGH_ROW_WORDS) high[word] = acc;
        }
    }
}

template <class Q, bool BF16, bool VEC>
static __device__ void kvq_quantize_regs(const KvqRows& src, kvq_u8* block) {
    using S = KvqRegShape<Q>;
    constexpr int LPR = S::LPR, RPW = S::RPW, RS = S::RS, ITER = S::ITER;
    constexpr bool CHANNEL = Q::AXIS == KvqAxis::Channel;
    // Kitty's K holds every row when the page is a power of two (the constant test measured
    // slower for 1-bit channel codes, so other paths keep the runtime one).
    constexpr bool FULL = Q::BOOST && CHANNEL && PAGE == ITER * RS;
    const bool sym = Q::SYMMETRIC;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int chunk = lane % LPR, r0 = warp * RPW + lane / LPR, c0 = chunk * 8;
    const bool live = !S::IDLE || chunk < S::CHUNKS;  // this lane holds channels
    // 1. The page into registers (rows past the page, and idle lanes, read as zeros and are never
    //    stored).
    kvq_u32 w[ITER][4];
#pragma unroll
    for (int i = 0; i < ITER; ++i) {
        const int r = r0 + i * RS;
        if ((FULL || r < PAGE) && live) {
            const kvq_u16* row = src.row(r) + c0;
            if (VEC) {
                const uint4 x = *(const uint4*)row;
                w[i][0] = x.x; w[i][1] = x.y; w[i][2] = x.z; w[i][3] = x.w;
            } else {
#pragma unroll
                for (int k = 0; k < 4; ++k) w[i][k] = (kvq_u32)row[2 * k] | ((kvq_u32)row[2 * k + 1] << 16);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) w[i][k] = 0;
        }
    }
    kvq_zero_padding(block, tid, S::THREADS, typename Q::PADDING{});
    kvq_u16* scales = (kvq_u16*)(block + Q::SCALES_OFFSET);
    kvq_u16* zeros = (kvq_u16*)(block + Q::ZEROS_OFFSET);  // unused for symmetric codes
    if constexpr (CHANNEL) {
        // 2. Min/max of every channel: pairs in the input format (exact), over this lane's rows, the
        //    warp's lanes of the same chunk, then the warps (shared memory).
        __shared__ kvq_u32 s_lo[S::WARPS][D / 2], s_hi[S::WARPS][D / 2];
        {
            const kvq_u32 pinf = BF16 ? 0x7F807F80u : 0x7C007C00u, ninf = BF16 ? 0xFF80FF80u : 0xFC00FC00u;
            kvq_u32 lo[4], hi[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) { lo[k] = pinf; hi[k] = ninf; }
#pragma unroll
            for (int i = 0; i < ITER; ++i)
                if (FULL || r0 + i * RS < PAGE)
#pragma unroll
                    for (int k = 0; k < 4; ++k) { lo[k] = kvq_min2<BF16>(lo[k], w[i][k]); hi[k] = kvq_max2<BF16>(hi[k], w[i][k]); }
#pragma unroll
            for (int o = LPR; o < 32; o <<= 1)
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    lo[k] = kvq_min2<BF16>(lo[k], __shfl_xor_sync(0xffffffffu, lo[k], o));
                    hi[k] = kvq_max2<BF16>(hi[k], __shfl_xor_sync(0xffffffffu, hi[k], o));
                }
            if (lane < S::CHUNKS)
#pragma unroll
                for (int k = 0; k < 4; ++k) { s_lo[warp][chunk * 4 + k] = lo[k]; s_hi[warp][chunk * 4 + k] = hi[k]; }
        }
        if constexpr (Q::BOOST) {
            kvq_regs_boosted<Q, BF16>(w, block, s_lo, s_hi, scales, zeros);
        } else {
            __shared__ float4 s_par[D];  // (scale, 1/scale, zero, unused): one 16-byte load per channel
            __syncthreads();
            // 3. Scale/zero of every channel.
            for (int c = tid; c < D; c += S::THREADS) {
                float lo = __int_as_float(0x7f800000), hi = KVQ_NEG_INF;
#pragma unroll
                for (int k = 0; k < S::WARPS; ++k) {
                    lo = fminf(lo, kvq_raw_to_f32<BF16>(((const kvq_u16*)s_lo[k])[c]));
                    hi = fmaxf(hi, kvq_raw_to_f32<BF16>(((const kvq_u16*)s_hi[k])[c]));
                }
                const float levels = (float)Q::LEVELS;
                kvq_u16 sh, zh;
                kvq_group_params<Q>(lo, hi, levels, sym, sh, zh);
                scales[c] = sh;
                if constexpr (!Q::SYMMETRIC) zeros[c] = zh;
                const float sf = kvq_f16_to_f32(sh);
                s_par[c] = make_float4(sf, sf == 0.f ? 0.f : __frcp_rn(sf), kvq_f16_to_f32(zh), 0.f);
            }
            __syncthreads();
            // 4. Encode and pack, a row at a time, parameters in registers.
            float sf[8], inv[8], zf[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float4 q = s_par[(live ? c0 : 0) + j];
                sf[j] = q.x; inv[j] = q.y; zf[j] = q.z;
            }
#pragma unroll
            for (int i = 0; i < ITER; ++i) {
                const int r = r0 + i * RS;
                kvq_u32 bits[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float levels = (float)Q::LEVELS;
                    bits[j] = kvq_encode_bits(kvq_lane_value<BF16>(w[i], j), sf[j], inv[j], zf[j], levels, sym);
                }
                kvq_zero_idle<S>(bits, live);
                kvq_store_row<Q>(block, r < PAGE ? r : 0, bits, chunk, r < PAGE && live);
            }
        }
    } else {
        // 2-4. Token groups: a group is GROUP channels of one row, i.e. GROUP / 8 neighbouring
        //      lanes (a whole row: its LPR lanes, idle ones neutral). Min/max in pairs, then
        //      shuffles; then the parameters of all the warp's groups at once, a group per lane
        //      (computing them per row would repeat the same lanes' work ITER times); then each
        //      lane fetches its group's parameters and encodes. No shared memory, no barrier.
        constexpr int GPT = Q::GROUPS_PER_TOKEN, LPG = GPT == 1 ? LPR : Q::GROUP / 8;
        static_assert(!S::IDLE || GPT == 1, "token groups below a row need rows of a power of two of chunks");
        constexpr int GPI = RPW * GPT;                 // groups of one step of a warp (divides 32)
        constexpr int PASSES = (ITER * GPI + 31) / 32;
        float lo[ITER], hi[ITER];
#pragma unroll
        for (int i = 0; i < ITER; ++i) {
            kvq_u32 lo2 = w[i][0], hi2 = w[i][0];
#pragma unroll
            for (int k = 1; k < 4; ++k) { lo2 = kvq_min2<BF16>(lo2, w[i][k]); hi2 = kvq_max2<BF16>(hi2, w[i][k]); }
            lo[i] = fminf(kvq_raw_to_f32<BF16>((kvq_u16)(lo2 & 0xFFFFu)), kvq_raw_to_f32<BF16>((kvq_u16)(lo2 >> 16)));
            hi[i] = fmaxf(kvq_raw_to_f32<BF16>((kvq_u16)(hi2 & 0xFFFFu)), kvq_raw_to_f32<BF16>((kvq_u16)(hi2 >> 16)));
            if constexpr (S::IDLE)
                if (!live) { lo[i] = __int_as_float(0x7f800000); hi[i] = KVQ_NEG_INF; }
#pragma unroll
            for (int o = 1; o < LPG; o <<= 1) {
                lo[i] = fminf(lo[i], __shfl_xor_sync(0xffffffffu, lo[i], o));
                hi[i] = fmaxf(hi[i], __shfl_xor_sync(0xffffffffu, hi[i], o));
            }
        }
        // Lane L of pass p owns group q = 32·p + L of the warp: step q / GPI, group g = q % GPI of that
        // step, whose first lane is (g / GPT)·LPR + (g % GPT)·LPG.
        float psf[PASSES], pinv[PASSES], pzf[PASSES];
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) {
            const int q = 32 * pass + lane, step = q / GPI, g = q % GPI;
            const int from = (g / GPT) * LPR + (g % GPT) * LPG;
            float glo = 0.f, ghi = 0.f;
#pragma unroll
            for (int i = 0; i < ITER; ++i) {
                const float l = __shfl_sync(0xffffffffu, lo[i], from), h = __shfl_sync(0xffffffffu, hi[i], from);
                if (i == step) { glo = l; ghi = h; }
            }
            kvq_u16 sh, zh;
            kvq_group_params<Q>(glo, ghi, (float)Q::LEVELS, sym, sh, zh);
            const int r = warp * RPW + g / GPT + step * RS;
            if (step < ITER && r < PAGE) {
                const int at = r * GPT + g % GPT;
                scales[at] = sh;
                if constexpr (!Q::SYMMETRIC) zeros[at] = zh;
            }
            psf[pass] = kvq_f16_to_f32(sh);
            pinv[pass] = psf[pass] == 0.f ? 0.f : __frcp_rn(psf[pass]);
            pzf[pass] = kvq_f16_to_f32(zh);
        }
        const int own = (lane / LPR) * GPT + chunk / LPG;  // this lane's group within a step
#pragma unroll
        for (int i = 0; i < ITER; ++i) {
            const int r = r0 + i * RS;
            const int pass = (i * GPI) / 32, holder = (i * GPI) % 32 + own;
            const float sf = __shfl_sync(0xffffffffu, psf[pass], holder);
            const float inv = __shfl_sync(0xffffffffu, pinv[pass], holder);
            const float zf = __shfl_sync(0xffffffffu, pzf[pass], holder);
            kvq_u32 bits[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) bits[j] = kvq_encode_bits(kvq_lane_value<BF16>(w[i], j), sf, inv, zf, (float)Q::LEVELS, sym);
            kvq_zero_idle<S>(bits, live);
            kvq_store_row<Q>(block, r < PAGE ? r : 0, bits, chunk, r < PAGE && live);
        }
    }
}
