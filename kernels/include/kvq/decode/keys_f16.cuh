#pragma once
// Keys on the f16 tensor cores: query pairs and a chunk's raw scores.

// Row t of a chunk of n tokens: clamped to the last one where the chunk's rows end there (global
// memory, GUARD); a staged chunk reads its stage's TILE rows as they are (rows past n hold finite
// codes whose scores are masked, so they add nothing).
template <bool GUARD>
static __device__ __forceinline__ int kvq_row(int t, int n) {
    return GUARD ? min(t, n - 1) : t;
}

// Query pairs of column g's head (zero past GQA) over this thread's K block r, in the pair order of
// a BITS-bit row (f16; bf16 queries are converted, exact in range). `first`: the head of column 0
// (8t for head tile t).
template <int BITS>
static __device__ __forceinline__ void kvq_query_pairs(const kvq_u16* q, long head_row, int g, int r, kvq_u32 (&out)[KPAIRS],
                                                       int first = 0) {
    kvq_u32 w[DVK / 8];
    const int head = first + kvq_col_head(g);
    if (head < GQA) {
        kvq_load_share<4, 16, 16>((const kvq_u8*)(q + (head_row + head) * D), r, w);
        if constexpr (IO == KvqDtype::Bf16) {
#pragma unroll
        for (int i = 0; i < DVK / 8; ++i)
            w[i] = kvq_h2_pack(__uint_as_float(w[i] << 16), __uint_as_float(w[i] & 0xffff0000u));
        }
    } else {
#pragma unroll
        for (int i = 0; i < DVK / 8; ++i) w[i] = 0u;
    }
#pragma unroll
    for (int p = 0; p < KPAIRS; ++p) out[p] = kvq_half_pair(w, kvq_pair_lo<BITS>(p), kvq_pair_hi<BITS>(p));
}

// K rows as thread (g, r) feeds them to mma: per 16-token subtile, tokens g and g+8 of channel
// block r (KW words each, rows ROW bytes apart; the block's slabs' shares, kvq/decode/slabs.cuh). Subtiles are loaded PRE at a time ahead of their
// use, as many as keep the loaded words at 32 or fewer.
static __host__ __device__ constexpr int kvq_preload_subtiles(int kw) {
    return (2 * kw * NSUB <= 32) ? NSUB : ((32 / (2 * kw)) > 0 ? (32 / (2 * kw)) : 1);
}
// Whether subtile s of a chunk of n tokens is read (all are, unguarded: see kvq_row).
template <bool GUARD>
static __device__ __forceinline__ bool kvq_subtile_live(int s, int n) {
    return s < NSUB && (!GUARD || s * 16 < n);
}
template <int BITS, int KW, int ROW, int PRE, bool GUARD>
static __device__ __forceinline__ void kvq_load_subtiles(const kvq_u8* rows, int s0, int n, int g, int r, kvq_u32 (&raw)[PRE][2][KW]) {
#pragma unroll
    for (int s = 0; s < PRE; ++s) {
        if (kvq_subtile_live<GUARD>(s0 + s, n)) {
            const int ta = kvq_row<GUARD>((s0 + s) * 16 + g, n), tb = kvq_row<GUARD>((s0 + s) * 16 + g + 8, n);
            constexpr int N = DVK / 4;
            kvq_load_share<4, BITS, kvq_align_of(ROW), 0, N, 0, BITS < 16>(rows + (long)ta * ROW, r, raw[s][0]);
            kvq_load_share<4, BITS, kvq_align_of(ROW), 0, N, 0, BITS < 16>(rows + (long)tb * ROW, r, raw[s][1]);
        }
    }
}

// The pairs of a K block's spread halves (kvq_pair_lo): the odd last whole half, spread by bytes,
// and the shares smaller than a half, each spread by its codes.
template <int BITS, int OFF, bool SUB, int S = 0>
static __device__ __forceinline__ void kvq_spread_pairs(const kvq_u32* w, kvq_u32* kp) {
    if constexpr (S < 3) {
        constexpr int N = kvq_kf_spread_codes<BITS>(S);
        if constexpr (N > 0) {
            static_assert(BITS <= 8, "spread halves hold codes of a byte or less");
            KvqPairs<BITS, OFF>::template get<SUB, N / 2>(kvq_spread_word<BITS, S>(w), kp + kvq_kf_spread_pair0<BITS>(S));
        }
        kvq_spread_pairs<BITS, OFF, SUB, S + 1>(w, kp);
    }
}

// Raw scores (q·k, unscaled) of a chunk: sc[t][s] = S^T fragment of subtile s for head tile t —
// (token g, heads 2r, 2r+1), (token g+8, heads 2r, 2r+1) of the tile. K rows are read directly into
// mma A fragments (thread (g, r): tokens g and g+8, channel block r), once for every tile: tile t
// takes the query pairs of folds[t] (`qh`, and `ql`, the low halves of a split query, with LO).
// SUB: codes as f16 subnormals (K_SUB), the sums then in the fold's units (KvqFold::unit).
template <int BITS, int OFF, bool LO, bool GUARD, bool SUB = false, int TILES, class Fold>
static __device__ __forceinline__ void kvq_chunk_scores(const kvq_u8* rows, int n, int g, int r,
    const Fold (&folds)[TILES], float (&sc)[TILES][NSUB][4])
{
    constexpr int KW = (kvq_block_halves<4, BITS>() + 1) / 2;   // words of a thread's block of one row
    constexpr int WORDS = kvq_kf_whole<BITS>() / 2;               // whole words of pairs (kvq_pair_lo)
    constexpr int PRE = kvq_preload_subtiles(KW);
#pragma unroll
    for (int s0 = 0; s0 < NSUB; s0 += PRE) {
        kvq_u32 raw[PRE][2][KW];
        kvq_load_subtiles<BITS, KW, BITS == 16 ? D * 2 : K_ROW_BYTES, PRE, GUARD>(rows, s0, n, g, r, raw);
#pragma unroll
        for (int s = 0; s < PRE; ++s) {
            if (kvq_subtile_live<GUARD>(s0 + s, n)) {
                kvq_u32 kp[2][KPAIRS];
#pragma unroll
                for (int t = 0; t < 2; ++t) {
#pragma unroll
                    for (int w = 0; w < WORDS; ++w) KvqPairs<BITS, OFF>::template get<SUB>(raw[s][t][w], &kp[t][w * KvqPairs<BITS, OFF>::PER_WORD]);
                    kvq_spread_pairs<BITS, OFF, SUB>(raw[s][t], kp[t]);
                }
#pragma unroll
                for (int t = 0; t < TILES; ++t) {
                    const kvq_u32 (&qh)[KPAIRS] = folds[t].qh;
                    const kvq_u32 (&ql)[KPAIRS] = folds[t].ql;
                    // Two independent accumulator chains (even/odd k-steps, or high/low query halves).
                    float c[4] = {0.f, 0.f, 0.f, 0.f}, c2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int kk = 0; kk < DVK / 16; ++kk) {
                        if (LO) {
                            kvq_mma(c, kp[0][2 * kk], kp[1][2 * kk], kp[0][2 * kk + 1], kp[1][2 * kk + 1], qh[2 * kk], qh[2 * kk + 1]);
                            kvq_mma(c2, kp[0][2 * kk], kp[1][2 * kk], kp[0][2 * kk + 1], kp[1][2 * kk + 1], ql[2 * kk], ql[2 * kk + 1]);
                        } else {
                            kvq_mma((kk & 1) ? c2 : c, kp[0][2 * kk], kp[1][2 * kk], kp[0][2 * kk + 1], kp[1][2 * kk + 1], qh[2 * kk], qh[2 * kk + 1]);
                        }
                    }
#pragma unroll
                    for (int i = 0; i < 4; ++i) sc[t][s0 + s][i] = c[i] + c2[i];
                }
            }
        }
    }
}
