#pragma once
// The split-K decode kernel's body; the unit's extern "C" entry point calls kvq_decode_kernel.
// Split-K decode: grid (num_splits + num_pieces, kv_heads, batch), block THREADS (kvq_cta_part).
// Writes, per query head and split or piece, the unnormalised output and (m, l) for the combine
// kernel; a launch of one part (one split, no pieces) given `out` also writes the output itself,
// as the combine would, so the step needs no combine launch.
// The prefetch only for codes of at most 2 bits: measured on an H100, it made 2-bit and 1-bit
// schemes faster and 4-bit and 8-bit slower (those already keep enough bytes in flight per warp).
static constexpr bool KVQ_PREFETCH = KVQ_LOW_BITS && KVQ_STAGES == 0;  // the ring supersedes it
// The body of the unit's decode entry point, whose launch bounds take MIN_CTAS (CTAs per SM the
// registers must allow: TuneParams::min_warps_per_sm). `Q` is KvqFoldQuery and `H` is HT, parameters
// so that the paths a configuration does not take are not compiled for it.
template <class Q = KvqFoldQuery, int H = HT>
static __device__ __forceinline__ void kvq_decode_kernel(
    const kvq_u16* __restrict__ q,
    const kvq_u8* __restrict__ k_pool, const kvq_u8* __restrict__ v_pool,
    const kvq_i32* __restrict__ page_table, int max_pages,
    const kvq_u16* __restrict__ k_sink, const kvq_u16* __restrict__ v_sink,
    const kvq_u16* __restrict__ k_tail, const kvq_u16* __restrict__ v_tail,
    const kvq_i32* __restrict__ seq_lens, const kvq_i32* __restrict__ seq_slots, int q_len,
    const float* __restrict__ score_range, const float* __restrict__ scores,
    int range_splits,   // gridDim.x of the range grid: the splits score_range holds per head
    float* __restrict__ part_acc, float* __restrict__ part_ml,
    int num_pieces, int piece_permille,
    kvq_u16* __restrict__ out)
{
    kvq_allow_dependent_launch();   // the combine grid may be scheduled now (it waits for our writes)
    __shared__ float s_m[WARPS][8 * H], s_l[WARPS][8 * H];   // per head: column 8t + c of tile t
    // With stored scores the kernel reads no quantized keys, so it folds no query with them.
    constexpr bool TABLE = K_INT && !KVQ_STORED;   // no integer fold: no table
    Q* table = nullptr;
    if constexpr (TABLE) {
        __shared__ __align__(16) Q s_query;
        table = &s_query;
    }
    const Q* const query = table;
    // The cp.async ring while the warps run (where there is one), the merge of their accumulators after.
    extern __shared__ __align__(128) kvq_u8 kvq_dyn[];   // aligned as the ring's sections are planned (stage_plan)
    const KvqPart cta = kvq_cta_part(num_pieces);
    const int part = cta.part, kvh = cta.kvh, seq = cta.seq;
    const int parts = gridDim.x, num_splits = parts - num_pieces, kv_heads = gridDim.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, r = lane % 4;
    const KvqSlot at = kvq_seq_slot(seq_slots, seq_lens, seq, q_len);
    const int slot = at.slot, len = at.len, seen = at.seen;
    const long head_row = UNEVEN_GROUPS ? kvq_head_row(seq, kvh, kv_heads) : ((long)seq * kv_heads + kvh) * GQA;

    float qmul[2], qadd[2] = {0.f, 0.f}, cmul[2], cadd[2];
    qmul[0] = qmul[1] = KVQ_LOG2E * rsqrtf((float)D);
    if constexpr (!CALIBRATE) kvq_calibration(score_range, seq, kvh, kv_heads, range_splits, g, r, cmul, cadd);
    // Per head tile t (H: more than one only for FP16 K and V); quantized kernels take one, named without t.
    KvqFold folds[H];
    KvqFold& fold = folds[0];
    if constexpr (!K_QUANT)
#pragma unroll
        for (int t = 0; t < H; ++t) kvq_query_pairs<16>(q, head_row, g, r, folds[t].qh, 8 * t);
    int folded_page = -1;
    int v_page = -1;   // channel-axis V: the page whose parameters vs2/vz2 (or vu/vzq) hold
    kvq_u32 vs2[NT], vz2[NT];
    float vu[NT], vzq[NT];   // V_CHANNEL_SUB: the accumulators' units and the page's z/u per channel
#pragma unroll
    for (int j = 0; j < NT; ++j) { vu[j] = 1.f; vzq[j] = 0.f; }
    KvqSoftmax sts[H];
    KvqSoftmax& st = sts[0];
#pragma unroll
    for (int t = 0; t < H; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) { sts[t].m[e] = 0.f; sts[t].l[e] = 0.f; sts[t].zs[e] = 0.f; }
#pragma unroll
        for (int j = 0; j < 4; ++j) sts[t].ps[j] = 0.f;
        sts[t].top = KVQ_NEG_INF;
    }
    float accs[H][MT][4];
    float (&acc)[MT][4] = accs[0];
#pragma unroll
    for (int t = 0; t < H; ++t)
#pragma unroll
        for (int i = 0; i < MT; ++i) accs[t][i][0] = accs[t][i][1] = accs[t][i][2] = accs[t][i][3] = 0.f;

    int w_begin, w_end;
    kvq_share_range(len, seen, part * WARPS + warp, num_splits * WARPS, KVQ_RUNS_PIECES ? num_pieces * WARPS : 0, piece_permille,
                    w_begin, w_end);
    float smul[2];   // KVQ_STORED: the calibration's multipliers for natural-unit scores
    if constexpr (KVQ_STAGES > 0) {
    // The cp.async ring: chunk i computes from stage i % KVQ_STAGES while the next ones copy into the others.
    kvq_u8* const ring = kvq_dyn + warp * (KVQ_STAGES * ST_BYTES);
    const unsigned ring_s = kvq_smem_u32(ring);
    KvqRingPos pos = kvq_ring_start<true>(w_begin, len);
    if constexpr (KVQ_STORED) {
        // The first stages copy stored scores: the range grid must have written them (and the ranges).
        kvq_ring_warm(pos, w_end, len, slot, kvh, kv_heads, v_pool, page_table, max_pages, lane);
        kvq_calibration_after_range_grid(score_range, seq, kvh, kv_heads, range_splits, g, r, cmul, cadd);
        smul[0] = cmul[0] * sqrtf((float)D); smul[1] = cmul[1] * sqrtf((float)D);
    }
    kvq_u32 qraw[KvqIntQuery::RAW], rawq[KvqIntQuery::RAW_WORDS];
    if constexpr (TABLE) {
        if (warp == 0) KvqIntQuery::fetch(q, head_row, g, r, qraw);   // in flight with the first copy
        KvqIntQuery::fetch_raw(q, head_row, rawq);
    }
#pragma unroll
    for (int s = 0; s + 1 < KVQ_STAGES; ++s)
        kvq_stage_next<true>(ring + s * ST_BYTES, ring_s + s * ST_BYTES, pos, w_end, len, slot, seq, kvh, kv_heads, k_pool, v_pool, page_table,
                             max_pages, k_sink, v_sink, k_tail, v_tail, scores, lane);
    if constexpr (TABLE) {
        kvq_stage_query(*table, qraw, rawq);   // while the first chunk copies
        __syncthreads();
    }
    // Only now the score ranges: the first chunk's copy is in flight while the range grid ends.
    if constexpr (CALIBRATE && !KVQ_STORED)
        kvq_calibration_after_range_grid(score_range, seq, kvh, kv_heads, range_splits, g, r, cmul, cadd);
    for (int stage = 0, fill = KVQ_STAGES - 1;; stage = kvq_next_stage(stage), fill = kvq_next_stage(fill)) {
        kvq_stage_next<true>(ring + fill * ST_BYTES, ring_s + fill * ST_BYTES, pos, w_end, len, slot, seq, kvh, kv_heads, k_pool, v_pool, page_table,
                       max_pages, k_sink, v_sink, k_tail, v_tail, scores, lane);
        kvq_wait_stage();
        const kvq_u8* const buf = ring + stage * ST_BYTES;
        const KvqChunk c = *(const KvqChunk*)(buf + ST_HDR);
        if (c.n == 0) break;
        // The 2-bit V's centring, every other K page (every 2·PAGE / TILE chunks) rather than
        // every chunk (32 FFMA a chunk of kivi2): kivi2 ×1.014 at B=16 L=32K on an H100. Once for
        // a warp's whole range, the uncentred sums lost precision (B=16 L=128K errors 1.0e-3 ->
        // 1.6e-3); every other page, 7.4e-4. Without quantized K there are no K pages to count:
        // such kernels centre every chunk (below).
        if constexpr (K_QUANT)
            if (c.k_page != folded_page && (c.k_page & 1) == 0) kvq_centre_flush(acc, st.ps);
        float sc[H][NSUB][4];
        if constexpr (KVQ_STORED) {
        if (c.k_page >= 0) {
            kvq_stored_scores<false>((const float*)(buf + ST_K + c.k_skew), c.n, g, r, smul, cadd, st.m, sc[0]);
            folded_page = c.k_page;   // as if folded, for the V centring's page count above
        } else {
            kvq_scores<false>(false, buf + ST_K, buf + ST_KH, buf + ST_KP, c.k_page, c.k, c.n, g, r, q, head_row, query, folds,
                              folded_page, qmul, qadd, cmul, cadd, sts, sc);
        }
        } else {
        kvq_scores<false>(c.k_page >= 0, buf + ST_K + c.k_skew, buf + ST_KH + c.kh_skew, buf + ST_KP, c.k_page, c.k, c.n, g, r, q,
                          head_row, query, folds, folded_page, qmul, qadd, cmul, cadd, sts, sc);
        }
        kvq_u32 pb[H][NSUB][2];
        kvq_softmax(st, acc, sc[0], c.v_page >= 0, buf + ST_VS + c.vs_skew, buf + ST_VZ + c.vz_skew, c.n, g, r, pb[0]);
        if (c.v_page >= 0) {
            if constexpr (V_TOKEN_FOLD) {
                kvq_chunk_pv<VBITS, V_OFF, V_SUBNORMAL ? 2 : 0, false>(buf + ST_V + c.v_skew, c.n, g, r, pb, vs2, vz2, accs, kvq_one(st.ps));
                if constexpr (!K_QUANT) kvq_centre_flush(acc, st.ps);   // every chunk: no K pages to count (above)
            } else if constexpr (V_CHANNEL_SUB) {
                if (c.v_page != v_page) {
                    kvq_v_channel_units(KVQ_STAGE_VP ? buf + ST_KP : c.v + VTensor::SCALES_OFFSET, g, vu, vzq, acc);
                    v_page = c.v_page;
                }
                kvq_chunk_pv_channel_sub<false>(buf + ST_V + c.v_skew, c.n, g, r, pb[0], vzq, acc);
            } else {
                if (c.v_page != v_page) { kvq_v_channel_params(c.v + VTensor::SCALES_OFFSET, g, vs2, vz2); v_page = c.v_page; }
                kvq_chunk_pv<VBITS, V_OFF, 1, false>(buf + ST_V + c.v_skew, c.n, g, r, pb, vs2, vz2, accs, kvq_one(st.ps));
            }
        } else {
            kvq_v_units_to_values(vu, acc, v_page);
            kvq_chunk_pv_lean(c.v, c.n, g, r, pb[0], acc, st.ps);
        }
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
    if constexpr (CALIBRATE) kvq_calibration_after_range_grid(score_range, seq, kvh, kv_heads, range_splits, g, r, cmul, cadd);
    if constexpr (KVQ_STORED) { smul[0] = cmul[0] * sqrtf((float)D); smul[1] = cmul[1] * sqrtf((float)D); }
    int pf = w_begin;   // start of the first chunk not yet prefetched
    for (int t0 = w_begin; t0 < w_end;) {
        const int t1 = kvq_chunk_end(t0, w_end, len);
        const int n = t1 - t0;
        if (pf < t1) pf = t1;
        while (KVQ_PREFETCH && pf < w_end && pf < t1 + 2 * TILE) {
            const int pe = kvq_chunk_end(pf, w_end, len);
            if (!KVQ_STORED) k_prefetch(k_source(pf, len, slot, kvh, kv_heads, k_pool, page_table, max_pages, k_sink, k_tail), pe - pf, lane);
            v_prefetch(v_source(pf, len, slot, kvh, kv_heads, v_pool, page_table, max_pages, v_sink, v_tail), pe - pf, lane);
            pf = pe;
        }
        const KvqSrc ks = k_source(t0, len, slot, kvh, kv_heads, k_pool, page_table, max_pages, k_sink, k_tail);
        const KvqSrc vs = v_source(t0, len, slot, kvh, kv_heads, v_pool, page_table, max_pages, v_sink, v_tail);
        float sc[H][NSUB][4];
        if constexpr (KVQ_STORED) {
        if (ks.quant)
            kvq_stored_scores<true>(kvq_score_row((float*)scores, seq, kvh, kv_heads, max_pages, t0 - min(SINK, len)), n, g, r, smul, cadd,
                                    st.m, sc[0]);
        else
            kvq_scores<true>(false, ks.rows, ks.high, ks.block, ks.page, ks.rows, n, g, r, q, head_row, query, folds, folded_page, qmul,
                             qadd, cmul, cadd, sts, sc);
        } else {
        kvq_scores<true>(ks.quant, ks.rows, ks.high, ks.block + KTensor::SCALES_OFFSET, ks.page, ks.rows, n, g, r, q, head_row, query, folds,
                         folded_page, qmul, qadd, cmul, cadd, sts, sc);
        }
        kvq_u32 pb[H][NSUB][2];
#pragma unroll
        for (int t = 0; t < H; ++t) kvq_softmax(sts[t], accs[t], sc[t], vs.quant, vs.scales, vs.zeros, n, g, r, pb[t]);
        if constexpr (V_QUANT) {
        if (vs.quant) {
            if constexpr (V_TOKEN_FOLD) {
                kvq_chunk_pv<VBITS, V_OFF, V_SUBNORMAL ? 2 : 0, true>(vs.rows, n, g, r, pb, vs2, vz2, accs, kvq_one(st.ps));
                kvq_centre_flush(acc, st.ps);   // every chunk on this rare path
            } else if constexpr (V_CHANNEL_SUB) {
                if (vs.page != v_page) { kvq_v_channel_units(vs.block + VTensor::SCALES_OFFSET, g, vu, vzq, acc); v_page = vs.page; }
                kvq_chunk_pv_channel_sub<true>(vs.rows, n, g, r, pb[0], vzq, acc);
            } else {
                if (vs.page != v_page) { kvq_v_channel_params(vs.block + VTensor::SCALES_OFFSET, g, vs2, vz2); v_page = vs.page; }
                kvq_chunk_pv<VBITS, V_OFF, 1, true>(vs.rows, n, g, r, pb, vs2, vz2, accs, kvq_one(st.ps));
            }
        } else {
            kvq_v_units_to_values(vu, acc, v_page);
            kvq_chunk_pv_lean(vs.rows, n, g, r, pb[0], acc, st.ps);
        }
        } else {
        float untouched[H][4];   // MODE 0 sums no Σ p'
        kvq_chunk_pv<16, 0, 0, true>(vs.rows, n, g, r, pb, vs2, vz2, accs, untouched);
        }
        t0 = t1;
    }
    }

    kvq_v_units_to_values(vu, acc, v_page);   // channel-axis subnormal V: values from here on

#pragma unroll
    for (int t = 0; t < H; ++t) kvq_centre_flush(accs[t], sts[t].ps);
    // Warp totals: l and Σ p·z over the warp's tokens (threads with the same r share heads; with
    // KVQ_PACK, threads r and r ^ 2 too).
#pragma unroll
    for (int t = 0; t < H; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int o = KVQ_PACK ? 2 : 4; o < 32; o <<= 1) {
                sts[t].l[e] += __shfl_xor_sync(0xffffffffu, sts[t].l[e], o);
                sts[t].zs[e] += __shfl_xor_sync(0xffffffffu, sts[t].zs[e], o);
            }
    if (g == 0)
#pragma unroll
        for (int t = 0; t < H; ++t)
#pragma unroll
            for (int e = 0; e < 2; ++e) { s_m[warp][8 * t + 2 * r + e] = sts[t].max_of(e); s_l[warp][8 * t + 2 * r + e] = sts[t].l[e]; }
    __syncthreads();
    // Merge the warps: weight each by 2^(m_w − M), summed in warp order (deterministic). Each warp
    // leaves its accumulators in register order (MERGE_ROW words per (i, j), one per lane: the
    // padding keeps stores and row reads free of bank conflicts), then each thread sums whole
    // output channels over the warps (the ring is free: every warp waited for its copies).
    float wgt[H][2];
#pragma unroll
    for (int t = 0; t < H; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int h = 8 * t + min(2 * r + e, 7);
            float mm = KVQ_NEG_INF;
            for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, s_m[w][h]);
            wgt[t][e] = sts[t].top == KVQ_NEG_INF ? 0.f : kvq_exp2(sts[t].m[e] - mm);
        }
    // Tile t's rows follow tile t − 1's.
    constexpr int MERGE_ROW = 33, MERGE_TILE = MT * 4 * MERGE_ROW, MERGE_WARP = H * MERGE_TILE;
    static_assert(WARPS * MERGE_WARP * 4 <= KVQ_MERGE_BYTES, "the merge fits the dynamic shared memory declared for it");
    float* const merged = (float*)kvq_dyn;
    // With KVQ_PACK, lanes r >= 2 leave heads 0..3's sums over the odd subtiles as heads 4..7, which
    // the sum below adds to heads 0..3 (the warp's Σ p·z once, with the even ones').
#pragma unroll
    for (int t = 0; t < H; ++t) {
        const float zs_once[2] = {KVQ_PACK && r >= 2 ? 0.f : sts[t].zs[0], KVQ_PACK && r >= 2 ? 0.f : sts[t].zs[1]};
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                merged[warp * MERGE_WARP + t * MERGE_TILE + (i * 4 + j) * MERGE_ROW + lane] =
                    (V_SUBNORMAL ? fmaf(accs[t][i][j], kvq_v_pair_units<VBITS>(2 * i + (j >> 1)), zs_once[j & 1])
                                 : accs[t][i][j] + zs_once[j & 1]) * wgt[t][j & 1];
    }
    if (threadIdx.x < GQA) {
        const int h = threadIdx.x;
        float mm = KVQ_NEG_INF;
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, s_m[w][h]);
        float l = 0.f;
        for (int w = 0; w < WARPS; ++w)
            if (s_m[w][h] != KVQ_NEG_INF) l += s_l[w][h] * kvq_exp2(s_m[w][h] - mm);
        if (!UNEVEN_GROUPS || h >= kvq_heads_shared(kvh)) {   // the row before writes the heads this row shares with it
            part_ml[((head_row + h) * parts + part) * 2] = mm == KVQ_NEG_INF ? KVQ_NEG_INF : mm * 0.6931471805599453f;
            part_ml[((head_row + h) * parts + part) * 2 + 1] = l;
        }
        s_l[0][h] = l;   // the head's denominator, for the output (only this thread reads column h)
    }
    __syncthreads();
    const bool direct = parts == 1 && out != nullptr;   // the whole output is this CTA's
    // Not unrolled: unrolled, ptxas compiled KIVI-4's main loop differently (with as many registers)
    // and it ran ×0.95–×0.97 at B ≥ 4 on the H100.
#pragma unroll 1
    for (int e = (UNEVEN_GROUPS ? kvq_heads_shared(kvh) * D : 0) + threadIdx.x; e < GQA * D; e += THREADS) {
        // Output (h, c) sits in tile h / 8; there, for column hc = h % 8, in lane 4·grp + hc / 2,
        // register (i, j) = (rem / 2, 2·(rem % 2) + hc % 2).
        // Channel c is block-order channel `rem` of lane group `grp` (c / NT, c % NT with one slab).
        const int h = e / D, c = e % D;
        int grp, rem;
        kvq_v_owner(c, grp, rem);
        const int tile = H == 1 ? 0 : h >> 3, hc = H == 1 ? h : h & 7;
        const int at = tile * MERGE_TILE + ((rem >> 1) * 4 + ((rem & 1) << 1) + (hc & 1)) * MERGE_ROW + grp * 4 + (hc >> 1);
        float x = merged[at];
        for (int w = 1; w < WARPS; ++w) x += merged[w * MERGE_WARP + at];
        if constexpr (KVQ_PACK)   // head h + 4: lane + 2, same register
            for (int w = 0; w < WARPS; ++w) x += merged[w * MERGE_WARP + at + 2];
        part_acc[((head_row + h) * parts + part) * D + c] = x;
        if (direct) out[(head_row + h) * D + c] = kvq_output_value(x, s_l[0][h]);
    }
}
