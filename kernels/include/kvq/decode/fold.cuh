#pragma once
// The query table and the per-page fold of the dequantisation into the query.
// Declared in every configuration: KvqFold holds every path's members (a register struct, so the
// members a scheme never touches cost nothing), and the fold is a template, so a path's code is
// only instantiated where the unit's traits (K_QUANT, K_INT, K_HIGH_INT, K_SUB, …) take it.

// T where B, else F.
template <bool B, class T, class F> struct KvqPick { typedef T type; };
template <class T, class F> struct KvqPick<false, T, F> { typedef F type; };

// The query table of the decode kernel's fold and of the range pass's: the integer fold's. The f16
// fold (4- and 8-bit keys, CalibQuant-1's 1-bit keys) loads its query pairs from global memory:
// staged in a table of its own, KIVI-4 ran ×1.007, INT8 ×1.014 (mostly from B=1 and the 4K shapes,
// where FP16's own runs differed more) and CalibQuant-1 ×0.997 over the grid in one call on an
// H100, so it was left out. FP16 keys keep their query pairs in registers.
struct KvqNoQuery;   // no integer fold, no table: only null pointers to it
typedef KvqPick<K_INT, KvqIntQuery, KvqNoQuery>::type KvqFoldQuery;
typedef KvqPick<KVQ_RANGE_INT, KvqIntQuery, KvqFoldQuery>::type KvqRangeQuery;
// Fills a CTA's query table: warp 0 writes each lane's words from the block it fetched
// (KvqIntQuery::fetch, before the first copies), every thread the share of the raw query it
// fetched then too (fetch_raw); the caller's __syncthreads() publishes it. On an H100, loading the
// query here, after the first copy, had cost short contexts (kivi2 and CalibQuant-2 ×0.97 at B=16
// L=4K, Kitty-Pro ×0.96 at B=1 L=4K); fetched before it, B=1 and B=4 at L=4K gained ×1.01–×1.05
// for every scheme with a table, but kivi2 at B=16 L=4K lost ×0.95 more, for a reason not found.
// A table per warp ran as this one; filling it at a warp's first fold slowed most shapes
// (×0.97–×0.99 a scheme over the grid: its code sat in the main loop). Issuing every stage's copy
// before the barrier (the ring refilled at the end of each chunk instead of the start of the
// next) lost ×0.92–×0.95 for kivi2, Kitty and Kitty-Pro at several shapes.
template <class T>
static __device__ __forceinline__ void kvq_stage_query(T& t, const kvq_u32 (&qraw)[T::RAW], const kvq_u32 (&rawq)[T::RAW_WORDS]) {
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x, g = lane / 4;
        kvq_u32 w[T::WORDS];
        T::words(qraw, g, w);
#pragma unroll
        for (int i = 0; i < T::WORDS / 4; ++i) *(uint4*)&t.w[i][lane][0] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    }
    if constexpr (K_BOOST) {
#pragma unroll
        for (int i = 0; i < T::RAW_WORDS; ++i)
            if (threadIdx.x + i * THREADS < GQA * D / 2) ((kvq_u32*)t.raw)[threadIdx.x + i * THREADS] = rawq[i];
    }
}
// Folded query of one K page. Integer keys (K_INT): the B fragments of this thread's (head g,
// block r) query limbs (bh, bl; bf with K_FINE), and per head 2r, 2r+1 (the score fragment's
// columns) 1/up, the centring term and the bias. f16 keys: qh + ql = q⊙s (f16 hi + lo) and the
// bias q·z of heads 2r, 2r+1 (symmetric codes had their offset removed). FP16 keys use qh for the
// query's f16 pairs.
struct KvqFold {
    kvq_u32 bh[KSTEPS][2], bl[KSTEPS][2];
    float mul[2];
    int osum[2];
    kvq_u32 bf[KSTEPS][2];
    int osumf[2];
    kvq_u32 qh[KPAIRS], ql[KPAIRS];
    kvq_u32 qk[KPAIRS];   // the query's pairs, loaded once (the range pass; MmaCtx::range_query_kept)
    float unit[2];        // the sums' unit for heads 2r, 2r + 1 (kvq_fold_subnormal_keys)
    float bias[2];
    kvq_u32 hbh[KHSTEPS][2], hbl[KHSTEPS][2];   // the boosted slots' query limbs (K_HIGH_INT)
    kvq_u32 hh[K_HIGH_WORDS > 0 ? K_HIGH_WORDS : 1][2], hl[K_HIGH_WORDS > 0 ? K_HIGH_WORDS : 1][2];   // f16 path
};
// Channel of a boosted slot from a page's slot table, kept inside the head so that a corrupt table
// cannot send the gather past the query.
static __device__ __forceinline__ int kvq_slot_channel(const kvq_u8* slot_channel, int slot) {
    const int c = slot_channel[slot];
    if constexpr ((D & (D - 1)) == 0) return c & (D - 1);
    else return c < D ? c : 0;
}
static __device__ __forceinline__ kvq_u32 kvq_h2_max(kvq_u32 a, kvq_u32 b) {
    kvq_u32 d;
    asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
// Keys as subnormals (K_SUB): pair p's codes arrive as 2^(pos − 24)·code (pos = kvq_pair_pos<1>(p)),
// so its query halves take 2^(24 − pos)·f, with f = 2^(−10 − e) per head and 2^e <= max|q⊙s| <
// 2^(e + 1) over the head's channels (e >= −1): every scaled half stays below 2^15. Powers of two,
// so exact, but for halves pushed below f16's normal range (low halves of channels under 2^−10 of
// the head's largest), which round to multiples of 2^−24, at most 2^−29 of the head's largest half
// at the same bit position. The sums come out times f; `unit` takes 1/f for heads 2r, 2r + 1, the
// score fragment's columns (heads 2(r & 1), 2(r & 1) + 1 with KVQ_RANGE_PACKED, whose lanes r >= 2
// hold the same heads' low halves' sums).
template <class F>
static __device__ __forceinline__ void kvq_fold_subnormal_keys(F& f, int g, int r) {
    kvq_u32 m = 0u;
#pragma unroll
    for (int p = 0; p < KPAIRS; ++p) m = kvq_h2_max(m, f.qh[p] & 0x7fff7fffu);
    // Non-negative f16 values order as their bits: the head's largest exponent field over its four threads.
    int ebits = (int)(max(m & 0xffffu, m >> 16) >> 10);
    ebits = max(ebits, __shfl_xor_sync(0xffffffffu, ebits, 1));
    ebits = max(ebits, __shfl_xor_sync(0xffffffffu, ebits, 2));
    const int e = max(ebits - 15, -1);
    // f16 exponent field of 2^(24 − pos)·f = 2^(14 − e − pos): 29 − e − pos, within [4, 30].
    const kvq_u32 base = (kvq_u32)(29 - e) * 0x04000400u;
#pragma unroll
    for (int p = 0; p < KPAIRS; ++p) {
        const kvq_u32 s2 = base - (kvq_u32)kvq_k_pair_pos<1>(p) * 0x04000400u;
        f.qh[p] = kvq_h2_mul(f.qh[p], s2);
        f.ql[p] = kvq_h2_mul(f.ql[p], s2);
    }
    // 1/f = 2^(10 + e) of the columns' two heads, whose e lanes 8·pair and 8·pair + 4 hold.
    const int pair = KVQ_RANGE_PACKED ? (r & 1) : r;
    f.unit[0] = __int_as_float((137 + __shfl_sync(0xffffffffu, e, 8 * pair)) << 23);
    f.unit[1] = __int_as_float((137 + __shfl_sync(0xffffffffu, e, 8 * pair + 4)) << 23);
}
// `params` is the K page's parameter section (scales, zeros, map, slot table: the block from its scales on),
// in global memory or staged with the chunk. For quantized keys only (K_QUANT); `Q` is KvqFoldQuery.
template <class F, class Q>
static __device__ __forceinline__ void kvq_fold_page(F& f, const kvq_u8* params, const Q* qt,
                                                     const kvq_u16* q, long head_row, int g, int r)
{
    float up = 0.f;   // the integer fold's multiplier, for the boosted slots' limbs (K_HIGH_INT)
    if constexpr (K_INT) {
        up = kvq_fold_int<true, K_FINE>(f, params, *qt, g, r);
    } else {
        kvq_u32 loaded[KPAIRS];
        if constexpr (!KVQ_RANGE_QUERY_KEPT) kvq_query_pairs<KBITS>(q, head_row, KVQ_RANGE_PACKED ? (g & 3) : g, r, loaded);
        const kvq_u32 (&qk)[KPAIRS] = KVQ_RANGE_QUERY_KEPT ? f.qk : loaded;
        kvq_u32 sw[DVK / 8];
        kvq_load_share<4, 16, 16>(params, r, sw);
#pragma unroll
        for (int p = 0; p < KPAIRS; ++p) {
            const kvq_u32 s2 = kvq_half_pair(sw, kvq_pair_lo<KBITS>(p), kvq_pair_hi<KBITS>(p));
            f.qh[p] = kvq_h2_mul(qk[p], s2);
            f.ql[p] = kvq_h2_fma(qk[p], s2, f.qh[p] ^ 0x80008000u);
        }
        if constexpr (K_SUB) kvq_fold_subnormal_keys(f, g, r);
        if constexpr (KVQ_RANGE_PACKED) {
            // This thread's B column: head g's high halves (g < 4) or head g − 4's low halves.
#pragma unroll
            for (int p = 0; p < KPAIRS; ++p) f.qh[p] = g < 4 ? f.qh[p] : f.ql[p];
        }
        if constexpr (KTensor::SYMMETRIC) {
            f.bias[0] = 0.f; f.bias[1] = 0.f;
        } else {
            // Bias q·z on the tensor cores: every A row is the zeros, so every C row is the bias.
            kvq_u32 zw[DVK / 8];
            kvq_load_share<4, 16, 16>(params + (KTensor::ZEROS_OFFSET - KTensor::SCALES_OFFSET), r, zw);
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < DVK / 16; ++kk) {
                const kvq_u32 z0 = kvq_half_pair(zw, kvq_pair_lo<KBITS>(2 * kk), kvq_pair_hi<KBITS>(2 * kk));
                const kvq_u32 z1 = kvq_half_pair(zw, kvq_pair_lo<KBITS>(2 * kk + 1), kvq_pair_hi<KBITS>(2 * kk + 1));
                kvq_mma(c, z0, z0, z1, z1, qk[2 * kk], qk[2 * kk + 1]);
            }
            f.bias[0] = c[0]; f.bias[1] = c[1];
        }
    }
    if constexpr (K_BOOST) {
        // The boosted channels of this page from its slot table, then 4·(q⊙s) of each slot. (Each
        // warp had inverted the page's channel map in shared memory here: a quarter of Kitty's fold,
        // ×0.96 at B=16 L=32K on the H100.)
        const kvq_u8* const slot_channel = params + (KTensor::SLOTS_OFFSET - KTensor::SCALES_OFFSET);
        const kvq_u16* sc16 = (const kvq_u16*)params;
        const int head = kvq_col_head(g);
        if constexpr (K_HIGH_INT) {
            // Integer limbs of X = round(q⊙s·up) for the boosted slots, as the low plane's (kvq_fold_int):
            // byte i of k-step t's first half is slot 16·2t + 4i + r, of its second half slot
            // 16·(2t + 1) + 4i + r, matching the bytes kvq_chunk_scores_int cuts from the high words.
#pragma unroll
            for (int t = 0; t < KHSTEPS; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    kvq_u32 b[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int slot = 16 * (2 * t + h) + 4 * i + r;
                        float x = 0.f;
                        if (slot < KTensor::BOOST_CHANNELS) {   // branch-free over the heads: past GQA fold zeros
                            const int c = kvq_slot_channel(slot_channel, slot);
                            x = kvq_io_to_f32(qt->raw[(head < GQA ? head : 0) * D + c]) * kvq_f16_to_f32(sc16[c]);
                        }
                        if (head >= GQA) x = 0.f;
                        b[i] = __float_as_uint(fmaf(x, up, 12583040.f));
                    }
                    f.hbh[t][h] = kvq_prmt(kvq_prmt(b[0], b[1], 0x51u), kvq_prmt(b[2], b[3], 0x51u), 0x5410u);
                    f.hbl[t][h] = kvq_prmt(kvq_prmt(b[0], b[1], 0x40u), kvq_prmt(b[2], b[3], 0x40u), 0x5410u) ^ 0x80808080u;
                }
        } else {
            const kvq_u32 four = kvq_h2_pow2(KBITS, false);  // high bits sit above the KBITS low bits
#pragma unroll
            for (int w = 0; w < K_HIGH_WORDS; ++w)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    // b0b1 = slots (r, r+8), b2b3 = slots (r+4, r+12) of word w.
                    kvq_u32 qv = 0u, sv = 0u;
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int slot = w * 16 + r + 4 * j + 8 * e;
                        if (slot < KTensor::BOOST_CHANNELS && head < GQA) {
                            const int c = kvq_slot_channel(slot_channel, slot);
                            if constexpr (K_INT) qv |= (kvq_u32)qt->raw[head * D + c] << (16 * e);
                            else qv |= (kvq_u32)q[(head_row + head) * D + c] << (16 * e);
                            sv |= (kvq_u32)sc16[c] << (16 * e);
                        }
                    }
                    if constexpr (IO == KvqDtype::Bf16) qv = kvq_h2_pack(__uint_as_float(qv << 16), __uint_as_float(qv & 0xffff0000u));
                    const kvq_u32 hi = kvq_h2_mul(qv, sv);
                    const kvq_u32 lo = kvq_h2_fma(qv, sv, hi ^ 0x80008000u);
                    f.hh[w][j] = kvq_h2_mul(hi, four);
                    f.hl[w][j] = kvq_h2_mul(lo, four);
                }
        }
    }
}
