#pragma once
// Head sizes that are not a power of two: a row's channels read as slabs (docs/LAYOUT.md §9).
//
// The kernel's thread layout is written for a row of a power-of-two size S: quad lane r takes the
// contiguous quarter [r·S/4, (r + 1)·S/4) of a row's K channels, lane group g the eighth
// [g·S/8, (g + 1)·S/8) of its V channels. Other head sizes are read as slabs of such sizes,
// largest first (KVQ_SLAB0..3, set by the unit; `slabs` in kvq-codegen's decode.rs): a lane's
// block of a row is its share of each slab in turn, so everything after the loads (code
// conversion, the fold, the mma chains, the softmax) runs over DV channels in this "block order"
// as it runs over a power-of-two row. Only what touches memory maps block order to channels:
// the loads of rows, queries and per-channel parameters, and the output. The last slab may reach
// past the row (DV > D): its channels there load as zeros (a zero query and zero scales make
// their scores and outputs nothing), and loads that would cross the row's end are skipped.
// At D = 64, 128 and 256 there is one slab and every loader below is the plain load it was.
static constexpr int KVQ_SLABS = (KVQ_SLAB0 > 0) + (KVQ_SLAB1 > 0) + (KVQ_SLAB2 > 0) + (KVQ_SLAB3 > 0);
static __host__ __device__ constexpr int kvq_slab_size(int i) {
    return i == 0 ? KVQ_SLAB0 : i == 1 ? KVQ_SLAB1 : i == 2 ? KVQ_SLAB2 : i == 3 ? KVQ_SLAB3 : 0;
}
static __host__ __device__ constexpr int kvq_slab_start(int i) { return i <= 0 ? 0 : kvq_slab_start(i - 1) + kvq_slab_size(i - 1); }
// One slab: a row read as it always was.
static constexpr bool KVQ_ONE_SLAB = KVQ_SLABS == 1 && DV == D;
static_assert(KVQ_SLABS >= 1 && kvq_slab_start(KVQ_SLABS) == DV && DV >= D && DV - D < D, "the slabs cover the row");

// Slab I as types, for loads whose widths are template arguments (each loader below recurses over
// I: NVRTC's JIT mode takes no lambdas in device code).
template <int I>
struct KvqSlab {
    static constexpr int S = kvq_slab_size(I), C0 = kvq_slab_start(I);
    static constexpr bool WHOLE = C0 + S <= D;   // every channel inside the row
};
// Largest power of two, at most 16, dividing `bytes` (16 for 0): the alignment an offset keeps.
static __host__ __device__ constexpr int kvq_align_of(int bytes) {
    return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : bytes % 2 == 0 ? 2 : 1;
}
// Loads BYTES (a multiple of 4) from an address aligned to ALIGN into words, in the widest
// vectors both allow.
template <int BYTES, int ALIGN>
static __device__ __forceinline__ void kvq_load_words(const kvq_u8* p, kvq_u32* w) {
    constexpr int V = kvq_align_of(BYTES) < ALIGN ? kvq_align_of(BYTES) : ALIGN;
    static_assert(BYTES % 4 == 0 && V >= 4, "whole, aligned words");
#pragma unroll
    for (int i = 0; i < BYTES / V; ++i) kvq_load<V>(p + i * V, w + i * (V / 4));
}

// Channel of block-order channel `v` of quad lane r's K block.
static __device__ __forceinline__ int kvq_k_channel(int v, int r) {
    int c = 0;
#pragma unroll
    for (int i = 0; i < KVQ_SLABS; ++i)
        if (v >= kvq_slab_start(i) / 4 && v < kvq_slab_start(i + 1) / 4)
            c = kvq_slab_start(i) + r * (kvq_slab_size(i) / 4) + (v - kvq_slab_start(i) / 4);
    return c;
}
// Channel of block-order channel `j` of lane group g's V block.
static __device__ __forceinline__ int kvq_v_channel(int j, int g) {
    int c = 0;
#pragma unroll
    for (int i = 0; i < KVQ_SLABS; ++i)
        if (j >= kvq_slab_start(i) / 8 && j < kvq_slab_start(i + 1) / 8)
            c = kvq_slab_start(i) + g * (kvq_slab_size(i) / 8) + (j - kvq_slab_start(i) / 8);
    return c;
}
// Where V channel c sits: lane group `grp`, block-order channel `j` there.
static __device__ __forceinline__ void kvq_v_owner(int c, int& grp, int& j) {
    if constexpr (KVQ_ONE_SLAB) {
        grp = c / (D / 8); j = c % (D / 8);
    } else {
#pragma unroll
        for (int i = 0; i < KVQ_SLABS; ++i)
            if (c >= kvq_slab_start(i) && c < kvq_slab_start(i + 1)) {
                grp = (c - kvq_slab_start(i)) / (kvq_slab_size(i) / 8);
                j = kvq_slab_start(i) / 8 + (c - kvq_slab_start(i)) % (kvq_slab_size(i) / 8);
            }
    }
}

// Quad lane r's K block of a row whose channel c starts at bit c·BITS (BITS = 16: f16 rows,
// queries, per-channel scales), rows ROW_ALIGN-aligned: its share of each slab into its words.
// A share is whole words (decode.rs keeps slabs at least that large); words past the row load
// as zeros. With one slab, the plain load of D·BITS/32 bytes at r·D·BITS/32.
template <int BITS, int ROW_ALIGN, int I = 0>
static __device__ __forceinline__ void kvq_load_k_block(const kvq_u8* row, int r, kvq_u32* w) {
    if constexpr (KVQ_ONE_SLAB) {
        kvq_load<D * BITS / 32>(row + r * (D * BITS / 32), w);
    } else if constexpr (I < KVQ_SLABS) {
        using L = KvqSlab<I>;
        constexpr int SB = L::S / 4 * BITS / 8;       // bytes of the lane's share
        constexpr int W0 = L::C0 / 4 * BITS / 32;     // its first word in the block
        constexpr int CW = 32 / BITS;                 // channels a word holds
        static_assert(SB % 4 == 0, "a lane's share of a slab is whole words");
        constexpr int A = kvq_align_of(SB) < ROW_ALIGN ? kvq_align_of(SB) : ROW_ALIGN;
        const kvq_u8* at = row + L::C0 * BITS / 8 + r * SB;
        if constexpr (L::WHOLE) {
            kvq_load_words<SB, A>(at, w + W0);
        } else {
            // Word by word: a word starting inside the row is inside its padded words.
#pragma unroll
            for (int i = 0; i < SB / 4; ++i)
                w[W0 + i] = L::C0 + r * (L::S / 4) + i * CW < D ? ((const kvq_u32*)at)[i] : 0u;
        }
        kvq_load_k_block<BITS, ROW_ALIGN, I + 1>(row, r, w);
    }
}

// Lane group g's V block of a row (channel c at bit c·BITS), rows ROW_ALIGN-aligned, into its
// 16-bit halves (pairs of halves in words, low half first). A share is whole halves; halves
// past the row load as zeros.
template <int BITS, int ROW_ALIGN, int I = 0>
static __device__ __forceinline__ void kvq_load_v_block(const kvq_u8* row, int g, kvq_u32* w) {
    if constexpr (KVQ_ONE_SLAB) {
        kvq_load<D * BITS / 64>(row + g * (D * BITS / 64), w);
    } else if constexpr (I < KVQ_SLABS) {
        using L = KvqSlab<I>;
        constexpr int SB = L::S / 8 * BITS / 8;       // bytes of the group's share
        constexpr int H0 = L::C0 / 8 * BITS / 16;     // its first half in the block
        constexpr int CH = 16 / BITS;                 // channels a half holds
        static_assert(SB % 2 == 0, "a group's share of a slab is whole halves");
        const kvq_u8* at = row + L::C0 * BITS / 8 + g * SB;
        if constexpr (SB % 4 == 0 && H0 % 2 == 0) {
            constexpr int A = kvq_align_of(SB) < ROW_ALIGN ? kvq_align_of(SB) : ROW_ALIGN;
            if constexpr (L::WHOLE) {
                kvq_load_words<SB, A>(at, w + H0 / 2);
            } else {
#pragma unroll
                for (int i = 0; i < SB / 4; ++i)
                    w[H0 / 2 + i] = L::C0 + g * (L::S / 8) + 2 * i * CH < D ? ((const kvq_u32*)at)[i] : 0u;
            }
        } else {
#pragma unroll
            for (int i = 0; i < SB / 2; ++i) {
                const kvq_u32 h = L::WHOLE || L::C0 + g * (L::S / 8) + i * CH < D ? (kvq_u32)((const kvq_u16*)at)[i] : 0u;
                if ((H0 + i) % 2 == 0) w[(H0 + i) / 2] = h;
                else w[(H0 + i) / 2] |= h << 16;
            }
        }
        kvq_load_v_block<BITS, ROW_ALIGN, I + 1>(row, g, w);
    }
}

// Block-order channels [V0, V0 + N) of quad lane r's K block of an f16 array (queries,
// per-channel scales and zeros; channel c at byte 2c, the array 16-byte aligned) into N / 2
// words, channels past the row as zeros. With one slab, the plain load.
template <int V0, int N, int I = 0>
static __device__ __forceinline__ void kvq_load_k_f16(const kvq_u8* base, int r, kvq_u32* w) {
    if constexpr (KVQ_ONE_SLAB) {
        kvq_load<N * 2>(base + r * (D / 4) * 2 + V0 * 2, w);
    } else if constexpr (I < KVQ_SLABS) {
        using L = KvqSlab<I>;
        constexpr int B0 = L::C0 / 4, B1 = (L::C0 + L::S) / 4;     // the slab's share in block order
        constexpr int LO = B0 > V0 ? B0 : V0, HI = B1 < V0 + N ? B1 : V0 + N;
        if constexpr (LO < HI) {
            constexpr int BYTES = (HI - LO) * 2;
            constexpr int OFF = (L::C0 + LO - B0) * 2;    // bytes past the lane's share's start, r = 0
            constexpr int A = kvq_align_of(OFF) < kvq_align_of(L::S / 2) ? kvq_align_of(OFF) : kvq_align_of(L::S / 2);
            const kvq_u8* at = base + OFF + r * (L::S / 2);
            if constexpr (L::WHOLE) {
                kvq_load_words<BYTES, A>(at, w + (LO - V0) / 2);
            } else {
#pragma unroll
                for (int i = 0; i < BYTES / 4; ++i)
                    w[(LO - V0) / 2 + i] = L::C0 + r * (L::S / 4) + (LO - B0) + 2 * i < D ? ((const kvq_u32*)at)[i] : 0u;
            }
        }
        kvq_load_k_f16<V0, N, I + 1>(base, r, w);
    }
}

// Lane group g's V block of an f16 array (channel-axis V scales and zeros) into DV / 16 words.
static __device__ __forceinline__ void kvq_load_v_f16(const kvq_u8* base, int g, kvq_u32* w) {
    kvq_load_v_block<16, 16>(base, g, w);
}
