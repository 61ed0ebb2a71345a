#pragma once
// CalibQuant: the score-range pass and stored scores. Declared in every configuration; the range
// pass's body is a template, instantiated only by the unit's range entry point (calibrated schemes).
// The calibration constants, once the range grid's results are visible: the decode grid may be
// launched overlapping the range grid (launch.rs), so it waits here first.
static __device__ __forceinline__ void kvq_calibration_after_range_grid(const float* score_range, int seq, int kvh,
    int kv_heads, int range_splits, int g, int r, float (&cmul)[2], float (&cadd)[2])
{
    kvq_wait_for_previous_grid();
    kvq_calibration(score_range, seq, kvh, kv_heads, range_splits, g, r, cmul, cadd);
}

// Folds a chunk's scores (masked tokens are −inf) into the running range of heads 2r, 2r+1. A whole
// chunk (nearly all of them) has no masked token to skip.
static __device__ __forceinline__ void kvq_range_update(float (&lo)[2], float (&hi)[2], const float (&sc)[NSUB][4], int n) {
    if (n == TILE) {
#pragma unroll
        for (int s = 0; s < NSUB; ++s)
#pragma unroll
            for (int i = 0; i < 4; ++i) { lo[i & 1] = fminf(lo[i & 1], sc[s][i]); hi[i & 1] = fmaxf(hi[i & 1], sc[s][i]); }
        return;
    }
#pragma unroll
    for (int s = 0; s < NSUB; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (sc[s][i] != KVQ_NEG_INF) { lo[i & 1] = fminf(lo[i & 1], sc[s][i]); hi[i & 1] = fmaxf(hi[i & 1], sc[s][i]); }
}

// Stores the scores of a quantized chunk's n tokens (natural units) from `rows`, the chunk's first
// row of `scores` (kvq_score_row): thread (g, r) holds heads 2r, 2r+1 of tokens s·16 + g (+ 8).
static __device__ __forceinline__ void kvq_store_scores(float* rows, int n, int g, int r, const float (&sc)[NSUB][4]) {
#pragma unroll
    for (int s = 0; s < NSUB; ++s)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int tok = s * 16 + g + 8 * j;
            if (tok >= n || 2 * r >= GQA) continue;
            float* const row = rows + tok * GQA + 2 * r;
            if constexpr (GQA % 2 == 0) {
                *(float2*)row = make_float2(sc[s][2 * j], sc[s][2 * j + 1]);
            } else {   // rows of odd length: no 8-byte alignment, and the last pair is a single head
                row[0] = sc[s][2 * j];
                if (2 * r + 1 < GQA) row[1] = sc[s][2 * j + 1];
            }
        }
}

// A quantized chunk's scores from the range pass's (`rows`: its first row, in the stage or in
// global memory with GUARD), calibrated into log2 units less the running max: one fma each, no
// keys read. Columns past GQA take the last head's scores (computed, never used); tokens past n
// are masked.
template <bool GUARD>
static __device__ __forceinline__ void kvq_stored_scores(const float* rows, int n, int g, int r, const float (&smul)[2],
    const float (&cadd)[2], const float (&mref)[2], float (&sc)[NSUB][4])
{
    const float add[2] = {cadd[0] - mref[0], cadd[1] - mref[1]};
#pragma unroll
    for (int s = 0; s < NSUB; ++s)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int tok = s * 16 + g + 8 * j;
            const float* const row = rows + kvq_row<GUARD>(tok, n) * GQA;
            float x0, x1;
            if constexpr (GQA % 2 == 0) {
                const float2 x = *(const float2*)(row + min(2 * r, GQA - 2));
                x0 = x.x; x1 = x.y;
            } else {
                x0 = row[min(2 * r, GQA - 1)]; x1 = row[min(2 * r + 1, GQA - 1)];
            }
            sc[s][2 * j] = fmaf(x0, smul[0], add[0]);
            sc[s][2 * j + 1] = fmaf(x1, smul[1], add[1]);
        }
    if (n == TILE) return;
#pragma unroll
    for (int s = 0; s < NSUB; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (s * 16 + g + (i >> 1) * 8 >= n) sc[s][i] = KVQ_NEG_INF;
}

// Scores of a quantized chunk in natural units (q·k/√D), folded into the running range of heads
// 2r, 2r+1 (and, with stored scores, stored at `srows`, the chunk's first row).
// With KVQ_RANGE_INT, 1- and 2-bit keys on the integer tensor cores with two limbs, where the
// decode kernel keeps the f16 path or adds a fine limb: the range sets only the calibration's
// constants, so an integer score's rounding moves them by about one score's error rather than
// entering every softmax weight (MmaCtx::range_int). `F` is KvqRangeFold, `Q` KvqRangeQuery.
typedef KvqPick<KVQ_RANGE_INT, KvqIntFold, KvqFold>::type KvqRangeFold;
template <bool GUARD, class F, class Q>
static __device__ __forceinline__ void kvq_range_chunk(const kvq_u8* rows, const kvq_u8* high, const kvq_u8* params, int page,
    int n, int g, int r, const kvq_u16* q, long head_row, const Q* qt, F& fold, int& folded_page,
    float (&lo)[2], float (&hi)[2], float* srows)
{
    const float scale = rsqrtf((float)D);
    float sc[NSUB][4];
    if constexpr (KVQ_RANGE_INT) {
    if (page != folded_page) {
        kvq_fold_int<false, false>(fold, params, *qt, g, r);
        folded_page = page;
    }
    // Not the decode kernel's single fma with the bias: in this pass (with the fold's single bias
    // chain) CalibQuant-2 lost ×0.97 on the H100. Without ADD, `add` is unused.
    kvq_chunk_scores_int<GUARD, false, false>(rows, n, g, r, fold.bh, fold.bl, fold.osum, fold.bh, fold.osum, fold.mul, fold.mul, sc);
#pragma unroll
    for (int s = 0; s < NSUB; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int tok = s * 16 + g + (i >> 1) * 8;
            sc[s][i] = tok < n ? (sc[s][i] + fold.bias[i & 1]) * scale : KVQ_NEG_INF;
        }
    } else {
    const float one[2] = {scale, scale}, zero[2] = {0.f, 0.f};
    KvqSoftmax unshifted;   // scores less 0: only m is read
    unshifted.m[0] = unshifted.m[1] = 0.f;
    kvq_scores<GUARD>(true, rows, high, params, page, rows, n, g, r, q, head_row, qt, kvq_one(fold), folded_page, one, zero, one, zero,
                      kvq_one(unshifted), kvq_one(sc));
    }
    kvq_range_update(lo, hi, sc, n);
    if constexpr (KVQ_STORED) kvq_store_scores(srows, n, g, r, sc);
}

// CalibQuant's calibration needs each query head's score range over quantized keys before the softmax:
// this pass computes it per split (natural units: q·k/√D), the decode kernel reduces the splits.
// With stored scores it also leaves every quantized key's scores for the decode kernel. The body
// of the unit's range entry point (calibrated schemes only); `Q` and `F` are KvqRangeQuery and
// KvqRangeFold.
template <class Q = KvqRangeQuery, class F = KvqRangeFold>
static __device__ __forceinline__ void kvq_range_kernel(
    const kvq_u16* __restrict__ q,
    const kvq_u8* __restrict__ k_pool,
    const kvq_i32* __restrict__ page_table, int max_pages,
    const kvq_u16* __restrict__ k_sink, const kvq_u16* __restrict__ k_tail,
    const kvq_i32* __restrict__ seq_lens, const kvq_i32* __restrict__ seq_slots, int q_len,
    float* __restrict__ score_range, float* __restrict__ scores)
{
    kvq_allow_dependent_launch();   // the decode grid may be scheduled now (it waits for our ranges)
    __shared__ float s_lo[WARPS][8], s_hi[WARPS][8];
    constexpr bool TABLE = K_INT || KVQ_RANGE_INT;   // no integer fold: no table
    Q* table = nullptr;
    if constexpr (TABLE) {
        __shared__ __align__(16) Q s_query;
        table = &s_query;
    }
    const Q* const query = table;
    const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
    const int range_splits = gridDim.x, kv_heads = gridDim.y;   // its own count, which decode is given
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, r = lane % 4;
    const KvqSlot at = kvq_seq_slot(seq_slots, seq_lens, seq, q_len);
    const int slot = at.slot, len = at.len, seen = at.seen;
    const long head_row = UNEVEN_GROUPS ? kvq_head_row(seq, kvh, kv_heads) : ((long)seq * kv_heads + kvh) * GQA;
    F fold;
    if constexpr (KVQ_RANGE_QUERY_KEPT) kvq_query_pairs<KBITS>(q, head_row, KVQ_RANGE_PACKED ? (g & 3) : g, r, fold.qk);
    int folded_page = -1;
    float lo[2] = {__int_as_float(0x7f800000), __int_as_float(0x7f800000)}, hi[2] = {KVQ_NEG_INF, KVQ_NEG_INF};
    int w_begin, w_end;
    kvq_warp_range(len, seen, split, range_splits, warp, w_begin, w_end);
    if constexpr (KVQ_STAGES > 0) {
    // K alone through the decode kernel's ring (same stage layout, V sections unused); chunks of
    // FP16 rows are not calibrated and stage nothing.
    extern __shared__ __align__(128) kvq_u8 kvq_ring[];   // sections at their planned alignment (stage_plan)
    kvq_u8* const ring = kvq_ring + warp * (KVQ_STAGES * ST_BYTES);
    const unsigned ring_s = kvq_smem_u32(ring);
    KvqRingPos pos = kvq_ring_start<false>(w_begin, len);
    kvq_u32 qraw[KvqIntQuery::RAW], rawq[KvqIntQuery::RAW_WORDS];
    if constexpr (TABLE) {
        if (warp == 0) KvqIntQuery::fetch(q, head_row, g, r, qraw);   // in flight with the first copy
        KvqIntQuery::fetch_raw(q, head_row, rawq);
    }
#pragma unroll
    for (int s = 0; s + 1 < KVQ_STAGES; ++s)
        kvq_stage_next<false>(ring + s * ST_BYTES, ring_s + s * ST_BYTES, pos, w_end, len, slot, seq, kvh, kv_heads, k_pool, 0, page_table,
                              max_pages, k_sink, 0, k_tail, 0, scores, lane);
    if constexpr (TABLE) {
        kvq_stage_query(*table, qraw, rawq);   // while the first chunk copies
        __syncthreads();
    }
    for (int stage = 0, fill = KVQ_STAGES - 1;; stage = kvq_next_stage(stage), fill = kvq_next_stage(fill)) {
        kvq_stage_next<false>(ring + fill * ST_BYTES, ring_s + fill * ST_BYTES, pos, w_end, len, slot, seq, kvh,
                              kv_heads, k_pool, 0, page_table, max_pages, k_sink, 0, k_tail, 0, scores, lane);
        kvq_wait_stage();
        const kvq_u8* const buf = ring + stage * ST_BYTES;
        const KvqChunk c = *(const KvqChunk*)(buf + ST_HDR);
        if (c.n == 0) break;
        if (c.k_page >= 0)
            kvq_range_chunk<false>(buf + ST_K + c.k_skew, buf + ST_KH + c.kh_skew, buf + ST_KP, c.k_page, c.n, g, r, q, head_row,
                                   query, fold, folded_page, lo, hi,
                                   KVQ_STORED ? kvq_score_row(scores, seq, kvh, kv_heads, max_pages, c.t0 - min(SINK, len)) : nullptr);
        __syncwarp();  // every lane is done with this stage before it is refilled
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    } else {
    if constexpr (TABLE) {
        kvq_u32 qraw[KvqIntQuery::RAW], rawq[KvqIntQuery::RAW_WORDS];
        if (warp == 0) KvqIntQuery::fetch(q, head_row, g, r, qraw);
        KvqIntQuery::fetch_raw(q, head_row, rawq);
        kvq_stage_query(*table, qraw, rawq);
        __syncthreads();
    }
    int pf = w_begin;
    for (int t0 = w_begin; t0 < w_end;) {
        const int t1 = kvq_chunk_end(t0, w_end, len);
        if (pf < t1) pf = t1;
        while (pf < w_end && pf < t1 + 2 * TILE) {
            const int pe = kvq_chunk_end(pf, w_end, len);
            const KvqSrc ns = k_source(pf, len, slot, kvh, kv_heads, k_pool, page_table, max_pages, k_sink, k_tail);
            if (ns.quant) k_prefetch(ns, pe - pf, lane);
            pf = pe;
        }
        const KvqSrc ks = k_source(t0, len, slot, kvh, kv_heads, k_pool, page_table, max_pages, k_sink, k_tail);
        if (ks.quant)
            kvq_range_chunk<true>(ks.rows, ks.high, ks.block + KTensor::SCALES_OFFSET, ks.page, t1 - t0, g, r, q, head_row,
                                  query, fold, folded_page, lo, hi,
                                  KVQ_STORED ? kvq_score_row(scores, seq, kvh, kv_heads, max_pages, t0 - min(SINK, len)) : nullptr);
        t0 = t1;
    }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            lo[e] = fminf(lo[e], __shfl_xor_sync(0xffffffffu, lo[e], o));
            hi[e] = fmaxf(hi[e], __shfl_xor_sync(0xffffffffu, hi[e], o));
        }
    if (g == 0)
#pragma unroll
        for (int e = 0; e < 2; ++e) { s_lo[warp][2 * r + e] = lo[e]; s_hi[warp][2 * r + e] = hi[e]; }
    __syncthreads();
    if (threadIdx.x < GQA) {
        const int h = threadIdx.x;
        float l = s_lo[0][h], u = s_hi[0][h];
        for (int w = 1; w < WARPS; ++w) { l = fminf(l, s_lo[w][h]); u = fmaxf(u, s_hi[w][h]); }
        if constexpr (UNEVEN_GROUPS) {
            // Indexed by query head; the row before writes the heads this row shares with it.
            float* out = score_range + (head_row + h) * range_splits * 2 + split * 2;
            if (h >= kvq_heads_shared(kvh)) { out[0] = l; out[1] = u; }
        } else {
            float* out = score_range + (((long)seq * kv_heads + kvh) * GQA + h) * range_splits * 2 + split * 2;
            out[0] = l; out[1] = u;
        }
    }
}
