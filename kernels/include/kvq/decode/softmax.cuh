#pragma once
// A chunk's scores, then the online softmax and its probabilities. Declared in every
// configuration; `if constexpr` on the unit's traits picks each scheme's key path.
// Per-warp online-softmax state for heads 2r, 2r+1, in log2 units. Scores arrive already less m, a
// finite reference (0 until the first score): kvq_scores folds it into the additive term it has
// anyway, so a probability is one exp2 with no subtraction. `top` is the running max less m: −inf
// until a score has arrived, 0 after (one for both heads: a token is masked for all or none).
// l and Σ p·z are this thread's partial sums over its tokens, reduced over the warp at the end.
struct KvqSoftmax {
    float m[2], top, l[2], zs[2];
    float ps[4];   // Σ p' of centred subnormal V chunks not yet taken off acc (kvq_centre_flush)
    // The running max itself (−inf while there is none), for the merge.
    __device__ __forceinline__ float max_of(int e) const { return top == KVQ_NEG_INF ? KVQ_NEG_INF : m[e]; }
};

// Scores of one chunk (log2 units, calibrated where CalibQuant says so; masked tokens -inf), less
// each head's running max `st[t].m`. A quantized K reads `qrows`/`qhigh` (its page's code rows,
// staged or not) and folds the query per `page` from `params` (the page's parameter section);
// FP16 K reads `frows`. Separate pointers, so a staged chunk's shared-memory reads stay
// shared-memory instructions. Every head tile t (HT of them: more than one only for FP16 K) scores into
// sc[t] with its query in fold[t], all from one read of the keys.
template <bool GUARD>
static __device__ __forceinline__ void kvq_scores(
    bool quant, const kvq_u8* qrows, const kvq_u8* qhigh, const kvq_u8* params, int page, const kvq_u8* frows,
    int n, int g, int r, const kvq_u16* q, long head_row, const KvqFoldQuery* qt,
    KvqFold (&folds)[HT], int& folded_page,
    const float (&qmul)[2], const float (&qadd)[2], const float (&cmul)[2], const float (&cadd)[2], const KvqSoftmax (&st)[HT],
    float (&scores)[HT][NSUB][4])
{
    KvqFold& fold = folds[0];   // quantized keys: one tile
    const float (&mref)[2] = st[0].m;
    float (&sc)[NSUB][4] = scores[0];
    if constexpr (K_QUANT) {
        if (quant) {
            if (page != folded_page) {
                kvq_fold_page(fold, params, qt, q, head_row, g, r);
                folded_page = page;
            }
            if constexpr (K_INT && (!K_BOOST || K_HIGH_INT)) {
                // No high plane to add in real units (none, or Kitty's summed with the low plane's
                // integers): the integer sums go straight to log2 units, x·(mul·cmul) + (bias·cmul + cadd),
                // one fma each; a partial chunk is masked after.
                const float mc[2] = {fold.mul[0] * cmul[0], fold.mul[1] * cmul[1]};
                const float badd[2] = {fmaf(fold.bias[0], cmul[0], cadd[0] - mref[0]), fmaf(fold.bias[1], cmul[1], cadd[1] - mref[1])};
                if constexpr (K_HIGH_INT)
                    kvq_chunk_scores_int<GUARD, true, false, true>(qrows, n, g, r, fold.bh, fold.bl, fold.osum, fold.bh, fold.osum, mc, badd, sc,
                                                                   qhigh, fold.hbh, fold.hbl);
                else if constexpr (K_FINE)
                    kvq_chunk_scores_int<GUARD, true, K_FINE>(qrows, n, g, r, fold.bh, fold.bl, fold.osum, fold.bf, fold.osumf, mc, badd, sc);
                else
                    kvq_chunk_scores_int<GUARD, true, K_FINE>(qrows, n, g, r, fold.bh, fold.bl, fold.osum, fold.bh, fold.osum, mc, badd, sc);
                if (n == TILE) return;
#pragma unroll
                for (int s = 0; s < NPS; ++s)   // packed (KVQ_PACK): fragment s is the lane's subtile of pair s
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        if ((KVQ_PACK ? 2 * s + (r >> 1) : s) * 16 + g + (i >> 1) * 8 >= n) sc[s][i] = KVQ_NEG_INF;
                return;
            } else {
                if constexpr (K_INT) {
                    // Real units, the page bias added after the high plane's scores (an fma with zero: a
                    // plain product schedules differently, and slower).
                    const float zero[2] = {0.f, 0.f};
                    if constexpr (K_FINE)
                        kvq_chunk_scores_int<GUARD, true, K_FINE>(qrows, n, g, r, fold.bh, fold.bl, fold.osum, fold.bf, fold.osumf, fold.mul, zero, sc);
                    else
                        kvq_chunk_scores_int<GUARD, true, K_FINE>(qrows, n, g, r, fold.bh, fold.bl, fold.osum, fold.bh, fold.osum, fold.mul, zero, sc);
                } else if constexpr (KVQ_RANGE_PACKED) {
                    // One mma a k-step for both halves (columns 4..7 the low ones), then lane r ^ 2's sums added.
                    kvq_chunk_scores<KBITS, K_OFF, false, GUARD, K_SUB>(qrows, n, g, r, kvq_one(fold), kvq_one(sc));
#pragma unroll
                    for (int s = 0; s < NSUB; ++s)
#pragma unroll
                        for (int i = 0; i < 4; ++i) sc[s][i] += __shfl_xor_sync(0xffffffffu, sc[s][i], 2);
                } else {
                    kvq_chunk_scores<KBITS, K_OFF, true, GUARD, K_SUB>(qrows, n, g, r, kvq_one(fold), kvq_one(sc));
                }
                // With K_SUB the sums are in the fold's units.
                const float kmul[2] = {K_SUB ? cmul[0] * fold.unit[0] : cmul[0], K_SUB ? cmul[1] * fold.unit[1] : cmul[1]};
                if constexpr (K_BOOST) kvq_chunk_high_scores<GUARD>(qhigh, n, g, r, fold.hh, fold.hl, sc);
                // Low bits: (x + bias)·cmul + cadd as one fma, and whole chunks (nearly all) need no mask
                // (on an H100: Kitty-Pro ×1.024, CalibQuant-1 ×1.019, kivi2 ×1.009, Kitty ×1.007,
                // CalibQuant-2 ×0.995 from 16 bytes of spills; INT8 took 4 more registers and ×0.997).
                if constexpr (KVQ_LOW_BITS) {
                    const float badd[2] = {fmaf(fold.bias[0], cmul[0], cadd[0] - mref[0]), fmaf(fold.bias[1], cmul[1], cadd[1] - mref[1])};
                    if (n == TILE) {
#pragma unroll
                        for (int s = 0; s < NSUB; ++s)
#pragma unroll
                            for (int i = 0; i < 4; ++i) sc[s][i] = fmaf(sc[s][i], kmul[i & 1], badd[i & 1]);
                        return;
                    }
#pragma unroll
                    for (int s = 0; s < NSUB; ++s)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int tok = s * 16 + g + (i >> 1) * 8;
                            sc[s][i] = tok < n ? fmaf(sc[s][i], kmul[i & 1], badd[i & 1]) : KVQ_NEG_INF;
                        }
                    return;
                }
#pragma unroll
                for (int s = 0; s < NSUB; ++s)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int tok = s * 16 + g + (i >> 1) * 8;
                        sc[s][i] = tok < n ? (K_SUB ? fmaf(sc[s][i], fold.unit[i & 1], fold.bias[i & 1]) : sc[s][i] + fold.bias[i & 1]) * cmul[i & 1] + (cadd[i & 1] - mref[i & 1]) : KVQ_NEG_INF;
                    }
                return;
            }
        }
        kvq_chunk_scores_lean(frows, n, g, r, q, head_row, sc);
    } else {
        kvq_chunk_scores<16, 0, false, true>(frows, n, g, r, folds, scores);
    }
#pragma unroll
    for (int t = 0; t < HT; ++t)
#pragma unroll
        for (int s = 0; s < NSUB; ++s)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int tok = s * 16 + g + (i >> 1) * 8;
                scores[t][s][i] = tok < n ? scores[t][s][i] * qmul[i & 1] + (qadd[i & 1] - st[t].m[i & 1]) : KVQ_NEG_INF;
            }
    // Packed as the integer path packs: fragment s becomes the lane's subtile of pair s (in place:
    // step s reads fragments 2s and 2s + 1, which no earlier step wrote).
    if constexpr (KVQ_PACK)
#pragma unroll
        for (int s = 0; s < NPS; ++s)
#pragma unroll
            for (int i = 0; i < 4; ++i) sc[s][i] = r >= 2 ? sc[2 * s + 1][i] : sc[2 * s][i];   // a select, as above
}

// Probabilities of one chunk against the updated max, summed into l, as P^T fragments for P·V.
// Token-axis V: each takes its token's scale (p·s), and Σ p·(s·V_OFF + z) gathers the zeros. FULL:
// all TILE rows are the chunk's, so rows need no clamp (with a clamp, each row's address was
// worked out apart: about 12 instructions a subtile of kivi2). Otherwise rows past n are clamped
// to the last one (their p is 0). `sc` holds the lane's fragments (kvq_softmax); `odd`: with
// KVQ_PACK, the lane's columns are the odd subtiles' (r >= 2).
template <bool FULL>
static __device__ __forceinline__ void kvq_probabilities(KvqSoftmax& st, float (&sc)[NPS][4], bool v_quant, const kvq_u8* v_scales,
    const kvq_u8* v_zeros, int n, int g, bool odd, kvq_u32 (&pb)[NSUB][2])
{
    const kvq_u16* vsc = (const kvq_u16*)v_scales;
    const kvq_u16* vzr = (const kvq_u16*)v_zeros;
#pragma unroll
    for (int s = 0; s < NPS; ++s) {
        const int sub = KVQ_PACK ? 2 * s + (odd ? 1 : 0) : s;   // the subtile of this lane's tokens
        float p[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            p[i] = kvq_exp2(sc[s][i]);
            st.l[i & 1] += p[i];
        }
        if constexpr (V_TOKEN_FOLD) {
            if (FULL || (v_quant && sub * 16 < n)) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int row = FULL ? sub * 16 + g + 8 * j : min(sub * 16 + g + 8 * j, n - 1);
                    const float sv = kvq_f16_to_f32(vsc[row]);
                    if constexpr (!VTensor::SYMMETRIC) {
                        // Codes arrive centred (c − V_OFF), so the zero term carries s·V_OFF.
                        const float zv = fmaf(sv, (float)V_OFF, kvq_f16_to_f32(vzr[row]));
                        st.zs[0] += p[2 * j] * zv; st.zs[1] += p[2 * j + 1] * zv;
                    }
                    p[2 * j] *= sv; p[2 * j + 1] *= sv;
                }
            }
        }
        const kvq_u32 t0 = kvq_trans8x8(kvq_h2_pack(p[0], p[1])), t1 = kvq_trans8x8(kvq_h2_pack(p[2], p[3]));
        if constexpr (KVQ_PACK) {
            // Transposed, lane (g, r) holds column g: heads 0..3 of subtile 2s for g < 4, of
            // subtile 2s + 1 for g >= 4. Each subtile's P^T keeps its own columns, zeros elsewhere.
            const bool upper = g >= 4;
            pb[2 * s][0] = upper ? 0u : t0; pb[2 * s][1] = upper ? 0u : t1;
            pb[2 * s + 1][0] = upper ? t0 : 0u; pb[2 * s + 1][1] = upper ? t1 : 0u;
        } else {
            pb[s][0] = t0; pb[s][1] = t1;
        }
    }
}

// Softmax step of one chunk: updates (m, l), rescales the accumulator when a max grew, and returns the
// P^T fragments for P·V (token-axis V: p·s, and Σ p·z on the side). Whether a max grew is one vote
// on each lane's own scores; only then do the lanes agree on the new max (three shuffles a head),
// which should be rare after a sequence's first chunks (a new max among n scores is about 1/n likely
// for exchangeable scores; not counted): the shuffles' latency left the common path.
// With KVQ_PACK, lanes r < 2 keep subtile 2i's columns 0..3 and lanes r >= 2 subtile 2i + 1's
// columns 4..7 (heads 0..3 again), so lanes r and r ^ 2 share heads and agree on their max.
static __device__ __forceinline__ void kvq_softmax(KvqSoftmax& st, float (&acc)[MT][4], float (&scores)[NSUB][4],
    bool v_quant, const kvq_u8* v_scales, const kvq_u8* v_zeros, int n, int g, int r, kvq_u32 (&pb)[NSUB][2])
{
    // kvq_scores left the lane's NPS fragments first (with KVQ_PACK, its subtile of each pair).
    const bool odd = KVQ_PACK && r >= 2;
    float (&sc)[NPS][4] = *reinterpret_cast<float (*)[NPS][4]>(&scores);
    float mx[2] = {KVQ_NEG_INF, KVQ_NEG_INF};
#pragma unroll
    for (int s = 0; s < NPS; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) mx[i & 1] = fmaxf(mx[i & 1], sc[s][i]);
    if (__any_sync(0xffffffffu, mx[0] > st.top || mx[1] > st.top)) {
        float alpha[2], shift[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float m = mx[e];
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
            if constexpr (KVQ_PACK) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            const float grown = fmaxf(st.top, m);   // the new max less m
            alpha[e] = st.top == KVQ_NEG_INF ? 0.f : kvq_exp2(-grown);
            shift[e] = grown;
            st.l[e] *= alpha[e];
            st.zs[e] *= alpha[e];
            st.m[e] += shift[e];
        }
        st.top = 0.f;
#pragma unroll
        for (int s = 0; s < NPS; ++s)
#pragma unroll
            for (int i = 0; i < 4; ++i) sc[s][i] -= shift[i & 1];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            acc[i][0] *= alpha[0]; acc[i][1] *= alpha[1];
            acc[i][2] *= alpha[0]; acc[i][3] *= alpha[1];
        }
        if constexpr (V_SUBNORMAL && V_OFF != 0)
#pragma unroll
            for (int j = 0; j < 4; ++j) st.ps[j] *= alpha[j & 1];
    }
    // Whole chunks of quantized V (nearly all) take their rows unclamped, at constant offsets: for
    // 1- and 2-bit codes; KIVI-4 lost ×0.97–×0.99 at B >= 4 with it on an H100.
    if constexpr (V_TOKEN_FOLD) {
        if (KVQ_LOW_BITS && v_quant && n == TILE) kvq_probabilities<true>(st, sc, true, v_scales, v_zeros, n, g, odd, pb);
        else kvq_probabilities<false>(st, sc, v_quant, v_scales, v_zeros, n, g, odd, pb);
    } else {
        kvq_probabilities<false>(st, sc, v_quant, v_scales, v_zeros, n, g, odd, pb);
    }
}
