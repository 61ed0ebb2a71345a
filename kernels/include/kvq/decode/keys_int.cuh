#pragma once
// 1- and 2-bit keys on the integer tensor cores: byte planes against the folded query's s8 limbs.
// Declared in every configuration (the decode kernels use it where MmaCtx::k_int or range_int);
// templates and `if constexpr` keep what a scheme without integer keys cannot compile out of reach.
// ---- Integer keys. Codes become bytes (at most one shift and one AND per byte plane of a word: 4 codes)
// and meet the folded query on the integer tensor cores, mma m16n8k32 u8 × s8 with s32
// accumulators, where the products are exact. The query q⊙s of each head and page is an integer
// X ≈ q⊙s·up with |X| <= 32512 (up = 32512 / max|q⊙s|), held as two s8 limbs, X = 256·hi + lo.
static constexpr int KSTEPS = KVQ_K_INT_STEPS;   // k-steps of 32 slots (kvq/decode/slabs.cuh)
static constexpr int KREGS = 2 * KSTEPS;         // byte registers of one row a thread holds (2 per k-step)
static constexpr int K_CENTRE = K_OFF != 0 ? K_OFF : (1 << (KBITS - 1));  // codes are summed about it
// Calibrated schemes' decode kernels on this path (2-bit keys; K_FINE, MmaCtx::k_fine) add a third,
// fine limb F ≈ (q⊙s·up − X)·KVQ_FINE_STEPS, |F| <= 127, so the query carries about 24 bits instead
// of 16: calibration multiplies score errors by |1 + (τ1 − τ2)/(δ − γ)|, unbounded as a head's score
// range narrows, and 16 bits missed the decode tolerance there where the f16 path's 22 did not.
static constexpr float KVQ_FINE_STEPS = 254.f;   // |residual| <= 1/2, so |F| <= 127
// D += A·B, m16n8k32, u8 A (codes), s8 B (query limbs), s32 accumulators.
static __device__ __forceinline__ void kvq_imma(int (&c)[4], kvq_u32 a0, kvq_u32 a1, kvq_u32 a2, kvq_u32 a3,
                                                kvq_u32 b0, kvq_u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 { %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Scores of a chunk of quantized keys, S^T fragments as in kvq_chunk_scores: the integer sums
// times `mul` (heads 2r, 2r+1), real units before the page bias; with ADD, plus `add` in the same
// fma, so a caller with no high plane to add passes its final scale and offset (1/up times the
// score scale, the page bias in those units). `bh`/`bl` are the B fragments of the query limbs
// per k-step; `osum` (K_CENTRE·ΣX) centres the codes exactly, in the integers. FINE: a third chain
// over the fine limb `bf`, centred by `osumf`, adds its sums in units of 1/KVQ_FINE_STEPS.
template <bool GUARD, bool ADD, bool FINE, bool HIGH>
static __device__ __forceinline__ void kvq_chunk_scores_int(const kvq_u8* rows, int n, int g, int r,
    const kvq_u32 (&bh)[KSTEPS][2], const kvq_u32 (&bl)[KSTEPS][2], const int (&osum)[2],
    const kvq_u32 (&bf)[KSTEPS][2], const int (&osumf)[2], const float (&mul)[2], const float (&add)[2], float (&sc)[NSUB][4],
    const kvq_u8* high_rows, const kvq_u32 (&hbh)[KHSTEPS][2], const kvq_u32 (&hbl)[KHSTEPS][2])
{
    constexpr int KW = (kvq_block_halves<4, KBITS>() + 1) / 2;   // words of a thread's block of one row
    constexpr int PRE = kvq_preload_subtiles(KW);
    static_assert(!(KVQ_PACK && FINE), "packed heads take no fine limb (uncalibrated kernels only)");
    // With KVQ_PACK: every subtile's integer sums (until the select below), and whether this lane
    // keeps the odd subtiles' columns. sc then holds NPS fragments.
    kvq_u32 xs[KVQ_PACK ? NSUB : 1][4];
    const bool odd = KVQ_PACK && r >= 2;
#pragma unroll
    for (int s0 = 0; s0 < NSUB; s0 += PRE) {
        kvq_u32 raw[PRE][2][KW];
        kvq_load_subtiles<KBITS, KW, K_ROW_BYTES, PRE, GUARD>(rows, s0, n, g, r, raw);
#pragma unroll
        for (int s = 0; s < PRE; ++s) {
            if (kvq_subtile_live<GUARD>(s0 + s, n)) {
                kvq_u32 kb[2][KREGS];
#pragma unroll
                for (int t = 0; t < 2; ++t)
                    kvq_int_key_regs(raw[s][t], kb[t]);
                // Two independent chains, high and low limbs; the low one starts at −K_CENTRE·ΣX.
                int ch[4] = {0, 0, 0, 0}, cl[4] = {-osum[0], -osum[1], -osum[0], -osum[1]};
                int cf[4] = {-osumf[0], -osumf[1], -osumf[0], -osumf[1]};
#pragma unroll
                for (int kk = 0; kk < KSTEPS; ++kk) {
                    kvq_imma(ch, kb[0][2 * kk], kb[1][2 * kk], kb[0][2 * kk + 1], kb[1][2 * kk + 1], bh[kk][0], bh[kk][1]);
                    kvq_imma(cl, kb[0][2 * kk], kb[1][2 * kk], kb[0][2 * kk + 1], kb[1][2 * kk + 1], bl[kk][0], bl[kk][1]);
                    if constexpr (FINE)
                        kvq_imma(cf, kb[0][2 * kk], kb[1][2 * kk], kb[0][2 * kk + 1], kb[1][2 * kk + 1], bf[kk][0], bf[kk][1]);
                }
                if constexpr (HIGH) {
                    // The boosted plane: 4·(high code) as bytes (slots 4i + r of a word in byte i,
                    // matching the fold's k-order), words 2t and 2t + 1 as k-step t's two halves.
                    // Bits 2r, 2r + 1 of each byte move to bits 2, 3 by one rotation by 2 − 2r
                    // (mod 32): the bits it wraps around fall outside the mask (a shift right, a
                    // shift left and the AND took three instructions a word).
                    const kvq_u32* high = (const kvq_u32*)high_rows;
                    const int ta = kvq_row<GUARD>((s0 + s) * 16 + g, n), tb = kvq_row<GUARD>((s0 + s) * 16 + g + 8, n);
                    const int rot = (34 - 2 * r) & 31;
#pragma unroll
                    for (int t = 0; t < KHSTEPS; ++t) {
                        kvq_u32 a[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            if (2 * t + h < K_HIGH_WORDS) {
                                const kvq_u32 wa = high[ta * K_HIGH_WORDS + 2 * t + h], wb = high[tb * K_HIGH_WORDS + 2 * t + h];
                                a[2 * h] = __funnelshift_l(wa, wa, rot) & 0x0c0c0c0cu;
                                a[2 * h + 1] = __funnelshift_l(wb, wb, rot) & 0x0c0c0c0cu;
                            }
                        kvq_imma(ch, a[0], a[1], a[2], a[3], hbh[t][0], hbh[t][1]);
                        kvq_imma(cl, a[0], a[1], a[2], a[3], hbl[t][0], hbl[t][1]);
                    }
                }
#pragma unroll
                // Σ(code − K_CENTRE)·X fits an int; the partial sums may wrap, so add them unsigned.
                for (int i = 0; i < 4; ++i) {
                    const kvq_u32 xi = (kvq_u32)ch[i] * 256u + (kvq_u32)cl[i];
                    if constexpr (KVQ_PACK) {
                        xs[s0 + s][i] = xi;
                        continue;
                    }
                    float x = (float)(int)xi;
                    if constexpr (FINE) x = fmaf((float)cf[i], 1.f / KVQ_FINE_STEPS, x);
                    sc[s0 + s][i] = ADD ? fmaf(x, mul[i & 1], add[i & 1]) : x * mul[i & 1];
                }
            } else if constexpr (KVQ_PACK) {
#pragma unroll
                for (int i = 0; i < 4; ++i) xs[s0 + s][i] = 0u;   // past n: masked by the caller
            }
        }
    }
    if constexpr (KVQ_PACK) {
        // The lane's own subtile of each pair (2i for r < 2, 2i + 1 for r >= 2), selected while
        // still an integer: half the conversions and fmas of converting both.
#pragma unroll
        for (int s = 0; s < NPS; ++s)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                // A select, not an index computed from r: a run-time index puts xs in local memory.
                const float x = (float)(int)(odd ? xs[2 * s + 1][i] : xs[2 * s][i]);
                sc[s][i] = ADD ? fmaf(x, mul[i & 1], add[i & 1]) : x * mul[i & 1];
            }
    }
}

// The same without a boosted plane to add.
template <bool GUARD, bool ADD, bool FINE>
static __device__ __forceinline__ void kvq_chunk_scores_int(const kvq_u8* rows, int n, int g, int r,
    const kvq_u32 (&bh)[KSTEPS][2], const kvq_u32 (&bl)[KSTEPS][2], const int (&osum)[2],
    const kvq_u32 (&bf)[KSTEPS][2], const int (&osumf)[2], const float (&mul)[2], const float (&add)[2], float (&sc)[NSUB][4])
{
    const kvq_u32 none[KHSTEPS][2] = {};
    kvq_chunk_scores_int<GUARD, ADD, FINE, false>(rows, n, g, r, bh, bl, osum, bf, osumf, mul, add, sc, rows, none, none);
}

// At GQA <= 4 the lanes of head columns 4..7 of the integer fold would fold zero queries: each takes
// the upper half of its block for head g - 4 instead, and its partner (lane ^ 16) the lower half.
// That needs the upper half's limbs to be the lower half's k-steps plus KSTEPS / 2 (a channel shift
// of DVK / 8), true where KSTEPS is a multiple of the byte planes.
// (Declared for every KBITS: wider codes than a byte never take this path.)
static constexpr bool KVQ_FOLD_SPLIT = GQA <= 4 && KBITS <= 8 && KVQ_K_INT_UNITS == 0 && KSTEPS % (KBITS <= 8 ? 8 / KBITS : 1) == 0;
static constexpr int KVQ_FOLD_XC = KVQ_FOLD_SPLIT ? DVK / 8 : DVK / 4;  // channels whose q⊙s a thread works out

// The query as the integer fold reads it, staged once per CTA (kvq_stage_query): lane (g, r) finds
// in words [0, KVQ_FOLD_XC) its channels of q for x = q⊙s as f32, in the next DVK / 8 the f16 pairs
// of its block r of head g for the bias mma (bf16 queries converted). Each fold of a K page loaded
// these from global memory, selected and converted them: on an H100, ncu put 15% of kivi2's stall
// samples in the fold, its most-sampled instruction waiting on that load.
// The members live in KvqIntQueryData, whose specialisations hold the raw queries only for boosted
// keys (K_BOOST), in the same order and layout as one struct would.
template <int WORDS, bool RAW>
struct KvqIntQueryData {
    kvq_u32 w[WORDS / 4][32][4];   // [word / 4][lane][word % 4]: a warp's 16-byte reads hit every bank once
    static constexpr int RAW_WORDS = 1;
};
template <int WORDS>
struct KvqIntQueryData<WORDS, true> {
    kvq_u32 w[WORDS / 4][32][4];
    kvq_u16 raw[GQA * D];          // the heads' queries as given, for the boosted slots' gather
    static constexpr int RAW_WORDS = (GQA * D / 2 + THREADS - 1) / THREADS;   // a thread's share of them
};
// Each section padded to whole 16-byte groups (head_dims whose blocks are not multiples of 16
// channels: the pad words are zeros, never read as channels).
static constexpr int KVQ_FOLD_XC_WORDS = (KVQ_FOLD_XC + 3) / 4 * 4;
static constexpr int KVQ_FOLD_Q_WORDS = (DVK / 8 + 3) / 4 * 4;
struct KvqIntQuery : KvqIntQueryData<KVQ_FOLD_XC_WORDS + KVQ_FOLD_Q_WORDS, K_BOOST> {
    static constexpr int WORDS = KVQ_FOLD_XC_WORDS + KVQ_FOLD_Q_WORDS;
    static constexpr int RAW = DVK / 8;   // words of lane (g, r)'s block of its head's query, as stored
    // This thread's share of the raw queries (boosted keys): loads only, before the first copies
    // like the lane's block, so the barrier after them does not wait for a load issued after the
    // page table's.
    static __device__ __forceinline__ void fetch_raw(const kvq_u16* q, long head_row, kvq_u32 (&rw)[RAW_WORDS]) {
        if constexpr (K_BOOST) {
#pragma unroll
            for (int i = 0; i < RAW_WORDS; ++i) {
                const int at = threadIdx.x + i * THREADS;
                rw[i] = at < GQA * D / 2 ? ((const kvq_u32*)(q + head_row * D))[at] : 0u;
            }
        } else {
            rw[0] = 0u;
        }
    }
    // Lane (g, r)'s block of the query from global memory: loads only, issued before the first
    // chunks' copies so that their latency overlaps them.
    static __device__ __forceinline__ void fetch(const kvq_u16* q, long head_row, int g, int r, kvq_u32 (&qw)[RAW]) {
        constexpr int CB = DVK / 4;
        const int head = KVQ_FOLD_SPLIT ? (g & 3) : kvq_col_head(g);
        if (head < GQA) {
            kvq_load_share<4, 16, 16>((const kvq_u8*)(q + (head_row + head) * D), r, qw);
        } else {
#pragma unroll
            for (int i = 0; i < RAW; ++i) qw[i] = 0u;  // heads past GQA fold a zero query
        }
    }
    // Lane (g, r)'s words from its fetched block.
    static __device__ __forceinline__ void words(const kvq_u32 (&qw)[RAW], int g, kvq_u32 (&w)[WORDS]) {
        constexpr int CB = DVK / 4;
        const bool upper = KVQ_FOLD_SPLIT && g >= 4;
#pragma unroll
        for (int c = 0; c < KVQ_FOLD_XC; ++c) {
            const kvq_u32 pair = upper ? qw[KVQ_FOLD_XC / 2 + c / 2] : qw[c / 2];   // no dynamic index: registers, not local memory
            w[c] = __float_as_uint(kvq_io_to_f32((kvq_u16)(pair >> (16 * (c % 2)))));
        }
#pragma unroll
        for (int c = KVQ_FOLD_XC; c < KVQ_FOLD_XC_WORDS; ++c) w[c] = 0u;
#pragma unroll
        for (int i = 0; i < CB / 2; ++i) {
            if constexpr (IO == KvqDtype::Bf16)
                w[KVQ_FOLD_XC_WORDS + i] = kvq_h2_pack(__uint_as_float(qw[i] << 16), __uint_as_float(qw[i] & 0xffff0000u));
            else
                w[KVQ_FOLD_XC_WORDS + i] = qw[i];
        }
#pragma unroll
        for (int i = CB / 2; i < KVQ_FOLD_Q_WORDS; ++i) w[KVQ_FOLD_XC_WORDS + i] = 0u;
    }
};
// c += K_CENTRE bytes (in each register's plane units, as its codes) times k-step kk's limbs `b0`, `b1`.
static __device__ __forceinline__ void kvq_imma_centre(int (&c)[4], int kk, kvq_u32 b0, kvq_u32 b1) {
    constexpr kvq_u32 CENTRE4 = (kvq_u32)K_CENTRE * 0x01010101u;
    const kvq_u32 c0 = CENTRE4 * kvq_plane_scale<KBITS>(2 * kk), c1 = CENTRE4 * kvq_plane_scale<KBITS>(2 * kk + 1);
    kvq_imma(c, c0, c0, c1, c1, b0, b1);
}
// Folded query of one K page for the integer path: the B fragments of this thread's (head g, block r)
// query limbs, and per head 2r, 2r+1 (the score fragment's columns) 1/up, the centring term and the
// bias. `F` is the decode kernel's KvqFold or, for a range pass on the integer path, KvqIntFold.
struct KvqIntFold {
    kvq_u32 bh[KSTEPS][2], bl[KSTEPS][2];
    float mul[2];
    int osum[2];
    float bias[2];
};
// ONE_CHAIN (the decode kernels): the bias's two sums in one mma chain; the range pass keeps two
// chains (see kvq_range_chunk). FINE: also the fine limb `bf` and its centring term `osumf`.
// Returns the multiplier `up` of lane (g, r)'s head (0 for a zero query), for the boosted slots' limbs.
// BITS is KBITS, a parameter so that the checks below wait for a scheme that folds integer keys.
template <bool ONE_CHAIN, bool FINE, class F, int BITS = KBITS>
static __device__ __forceinline__ float kvq_fold_int(F& f, const kvq_u8* params, const KvqIntQuery& qt, int g, int r)
{
    constexpr int CB = DVK / 4;  // channels of the thread's block
    constexpr bool SPLIT = KVQ_FOLD_SPLIT;
    constexpr int XC = KVQ_FOLD_XC;
    const bool upper = SPLIT && g >= 4;
    const int lane = 4 * g + r;
    // x = q⊙s in f32 (exact: a product of two 16-bit floats) and the head's max |x|; the scales
    // of just the channels this thread works out.
    kvq_u32 qx[KVQ_FOLD_XC_WORDS], sx[XC / 2];
    kvq_query_read<0, KVQ_FOLD_XC_WORDS>(qt, lane, qx);
    if constexpr (KVQ_K_ONE_SLAB) kvq_load<XC * 2>(params + r * CB * 2 + (upper ? XC * 2 : 0), sx);
    else if (upper) kvq_load_share<4, 16, 16, XC, XC>(params, r, sx);
    else kvq_load_share<4, 16, 16, 0, XC>(params, r, sx);
    float x[XC];
    float mx = 0.f;
#pragma unroll
    for (int c = 0; c < XC; ++c) {
        x[c] = __uint_as_float(qx[c]) * kvq_f16_to_f32((kvq_u16)(sx[c / 2] >> (16 * (c % 2))));
        mx = fmaxf(mx, fabsf(x[c]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if constexpr (SPLIT) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    // X = round(x·up) with up = 32512 / max|x|: |X| <= 32512, so hi = (X + 128) >> 8 is in
    // [-127, 127] and lo = X − 256·hi in [-128, 127] (a head with a zero query folds to zeros).
    const bool live = mx > 1e-30f;
    const float up = live ? __fdividef(32512.f, mx) : 0.f, down = mx * (1.f / 32512.f);
    // fma(x, up, 1.5·2^23 + 128) rounds x·up to the nearest integer X and adds 128 in the low
    // bits of the result (its ulp is 1): byte 1 of those bits is hi, byte 0 is lo ^ 0x80.
    constexpr int XSTEPS = SPLIT ? KSTEPS / 2 : KSTEPS;
    static_assert(kvq_byte_channel<BITS>(2 * XSTEPS - 1, 3) < XC, "the limbs worked out here need only this thread's channels");
#pragma unroll
    for (int kk = 0; kk < XSTEPS; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            kvq_u32 b[4], fb[4];
            // The plane's bytes are worth `scale` codes (KvqBytes), so its limbs hold x·up / scale
            // (a power of two: exact), rounded to the nearest integer as every other plane's.
            const float up_plane = up * (1.f / kvq_plane_scale<BITS>(2 * kk + h));
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                constexpr int NONE = -1;
                const int ch = kvq_byte_channel<BITS>(2 * kk + h, i);
                const float xc = ch == NONE ? 0.f : x[ch];   // a slot no channel holds folds a zero
                const float v = fmaf(xc, up_plane, 12583040.f);
                b[i] = __float_as_uint(v);
                // The residual x·up − X (exact to well below the fine step) in steps of
                // 1/KVQ_FINE_STEPS; 1.5·2^23 + F holds F in its low byte as an s8.
                if constexpr (FINE) fb[i] = __float_as_uint(fmaf(fmaf(xc, up_plane, 12583040.f - v), KVQ_FINE_STEPS, 12582912.f));
            }
            f.bh[kk][h] = kvq_prmt(kvq_prmt(b[0], b[1], 0x51u), kvq_prmt(b[2], b[3], 0x51u), 0x5410u);
            f.bl[kk][h] = kvq_prmt(kvq_prmt(b[0], b[1], 0x40u), kvq_prmt(b[2], b[3], 0x40u), 0x5410u) ^ 0x80808080u;
            if constexpr (FINE) f.bf[kk][h] = kvq_prmt(kvq_prmt(fb[0], fb[1], 0x40u), kvq_prmt(fb[2], fb[3], 0x40u), 0x5410u);
        }
    // The lower half's lanes take their partner's limbs as their upper k-steps. Without packed
    // heads the partners' own fragments belong to head columns past GQA, whose scores are not
    // read; with them (KVQ_PACK) a partner's column scores head g − 4 too, so it keeps its own
    // limbs as the upper k-steps and takes the lower half's as its lower ones.
    if constexpr (SPLIT) {
        const bool swap = KVQ_PACK && upper;
#pragma unroll
        for (int kk = 0; kk < XSTEPS; ++kk)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const kvq_u32 oh = __shfl_xor_sync(0xffffffffu, f.bh[kk][h], 16);
                const kvq_u32 ol = __shfl_xor_sync(0xffffffffu, f.bl[kk][h], 16);
                f.bh[kk + XSTEPS][h] = swap ? f.bh[kk][h] : oh;
                f.bl[kk + XSTEPS][h] = swap ? f.bl[kk][h] : ol;
                f.bh[kk][h] = swap ? oh : f.bh[kk][h];
                f.bl[kk][h] = swap ? ol : f.bl[kk][h];
                if constexpr (FINE) {
                    const kvq_u32 of = __shfl_xor_sync(0xffffffffu, f.bf[kk][h], 16);
                    f.bf[kk + XSTEPS][h] = swap ? f.bf[kk][h] : of;
                    f.bf[kk][h] = swap ? of : f.bf[kk][h];
                }
            }
    }
    // Per-head terms land in the score fragment's columns (heads 2r, 2r+1) through the tensor
    // cores: every A row is the same, so every C row is the sum over channels.
#pragma unroll
    for (int j = 0; j < 2; ++j) f.mul[j] = __shfl_sync(0xffffffffu, down, 4 * (2 * r + j));
    // Codes are centred on K_CENTRE: the scores sum (code − K_CENTRE)·X, so the rounding of X is
    // weighted by codes about zero rather than by codes up to 2^b − 1. K_CENTRE·ΣX, exact, with A
    // rows of K_CENTRE bytes (times each plane's scale, as its codes).
    int oh[4] = {0, 0, 0, 0}, ol[4] = {0, 0, 0, 0};
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        kvq_imma_centre(oh, kk, f.bh[kk][0], f.bh[kk][1]);
        kvq_imma_centre(ol, kk, f.bl[kk][0], f.bl[kk][1]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) f.osum[j] = (int)((kvq_u32)oh[j] * 256u + (kvq_u32)ol[j]);
    if constexpr (FINE) {
        int of[4] = {0, 0, 0, 0};
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) kvq_imma_centre(of, kk, f.bf[kk][0], f.bf[kk][1]);
#pragma unroll
        for (int j = 0; j < 2; ++j) f.osumf[j] = of[j];
    }
    if constexpr (KTensor::SYMMETRIC) {
#pragma unroll
        for (int j = 0; j < 2; ++j) f.bias[j] = 0.f;  // symmetric codes: K_CENTRE is their offset
    } else {
        // Bias q·z + K_CENTRE·(q·s) with A rows of zeros and of scales (f16 products, exact, in f32).
        kvq_u32 zw[CB / 2], sw[CB / 2], qw[KVQ_FOLD_Q_WORDS];
        kvq_load_share<4, 16, 16>(params + (KTensor::ZEROS_OFFSET - KTensor::SCALES_OFFSET), r, zw);
        kvq_load_share<4, 16, 16>(params, r, sw);
        kvq_query_read<KVQ_FOLD_XC_WORDS, KVQ_FOLD_Q_WORDS>(qt, lane, qw);
        if constexpr (ONE_CHAIN) {
            // A rows g are the zeros and rows g + 8 the scales, so one mma chain gives q·z in c[0..1]
            // and q·s in c[2..3] (each row's products and order as in a chain of its own): half the
            // mma, and no A fragments of repeated registers to build.
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < DVK / 16; ++kk) kvq_mma(c, zw[2 * kk], sw[2 * kk], zw[2 * kk + 1], sw[2 * kk + 1], qw[2 * kk], qw[2 * kk + 1]);
#pragma unroll
            for (int j = 0; j < 2; ++j) f.bias[j] = fmaf((float)K_CENTRE, c[2 + j], c[j]);
        } else {
            float cz[4] = {0.f, 0.f, 0.f, 0.f}, cs[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < DVK / 16; ++kk) {
                kvq_mma(cz, zw[2 * kk], zw[2 * kk], zw[2 * kk + 1], zw[2 * kk + 1], qw[2 * kk], qw[2 * kk + 1]);
                kvq_mma(cs, sw[2 * kk], sw[2 * kk], sw[2 * kk + 1], sw[2 * kk + 1], qw[2 * kk], qw[2 * kk + 1]);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) f.bias[j] = fmaf((float)K_CENTRE, cs[j], cz[j]);
        }
    }
    return up;
}
