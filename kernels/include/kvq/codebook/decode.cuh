#pragma once
// Split-K decode attention over a paged CommVQ cache, straight from the codes (docs/CODEBOOKS.md
// §2.2, the device layout of kvq_reference::commvq::device). Grid (num_splits, kv_heads, rows),
// block THREADS; writes each split's unnormalised output and (m, l) for kvq/combine.cuh, or with
// one split and `out` the output itself.
//
// The including unit defines (kvq/common.cuh, kvq/io.cuh and kvq/codebook/side.cuh first):
//   IO, D, GQA (a KV head's query heads, all in one CTA), THREADS, WARPS, TILE, PAGE, SINK,
//   KVQ_CB_SMEM_BOOK (the CTA copies its KV head's key codebook into dynamic shared memory first
//   and gathers from there), and KSide, VSide: one struct each of KvqSide's members (side.cuh).
//
// Keys coded by a RoPE-commutative codebook are never decoded into memory: a warp takes a token,
// lane l the pairs p = l + 32·k of the head, sums the codebook entries its codes select round by
// round (Σ c_a and Σ c_b, f32), forms k̂_p = Σc_a + i·Σc_b, rotates it by RoPE at the token's
// position and dots it with the query pair (q_p, q_{p+D/2}) of every query head: the pre-RoPE key
// is rebuilt once per KV head and shared by its GQA query heads. Values coded by a binary additive
// codebook are never decoded at all: Σ_t p_t v̂_t = (Σ_t p_t)·μ + (Σ_t p_t w_t s_t)·(C ⊙ σ), so a
// split sums p·w into one accumulator per code row and multiplies by the codebook once at its end.
// FP16 tokens (sink, tail, FP16 sides) are read as rows in the same launch.
#include "kvq/decode_common.cuh"

static_assert(KSide::KIND != KvqCbKind::Rope || (KSide::PAIRS % 32 == 0 && D / 2 % KSide::PAIRS == 0),
              "RoPE-commutative codes on the GPU: pairs_per_code a multiple of 32 dividing head_dim / 2");
static_assert(VSide::KIND != KvqCbKind::Rope, "values take no RoPE-commutative codebook");
static_assert(D % 2 == 0 && D <= 256, "head_dim: even, at most 256");

static constexpr int KVQ_CB_PPL = (D / 2 + 31) / 32;   // RoPE pairs a lane holds (pair 32·k + lane)
// Code rows a thread owns in the value accumulator (row t + THREADS·k).
static constexpr int KVQ_CB_VROWS = VSide::KIND == KvqCbKind::Additive ? (VSide::ROWS + THREADS - 1) / THREADS : 1;
static constexpr int KVQ_CB_KROWS = KSide::KIND == KvqCbKind::Additive ? KSide::ROWS : 1;
static constexpr int KIND_CODED = 1;   // a token in a coded page (KvqCbLoc::kind), else an f16 row

// Where one token of one side lives: an f16 row (sink, tail ring or FP16 page) or a coded page's row.
struct KvqCbLoc { int kind; const kvq_u16* f16; const kvq_u8* block; int row; };

template <class S>
static __device__ __forceinline__ KvqCbLoc kvq_cb_locate(int tok, int len, int slot, int kvh, int kv_heads, const kvq_u8* pool,
                                                         const kvq_i32* page_table, int max_pages, const kvq_u16* sink, const kvq_u16* tail) {
    KvqCbLoc l;
    l.block = 0; l.row = 0; l.f16 = 0; l.kind = 0;
    if constexpr (S::KIND == KvqCbKind::Fp16) {
        const long phys = page_table[(long)slot * max_pages + tok / PAGE];
        l.f16 = (const kvq_u16*)(pool + (phys * kv_heads + kvh) * (long)S::BLOCK_BYTES) + (tok % PAGE) * D;
    } else {
        const int sink_end = min(SINK, len);
        const int qend = kvq_quant_end(len, sink_end, S::LOCAL);
        if (tok < sink_end) {
            l.f16 = sink + (((long)slot * kv_heads + kvh) * SINK + tok) * D;
        } else if (tok < qend) {
            l.kind = KIND_CODED;
            l.row = (tok - sink_end) % PAGE;
            const long phys = page_table[(long)slot * max_pages + (tok - sink_end) / PAGE];
            l.block = pool + (phys * kv_heads + kvh) * (long)S::BLOCK_BYTES;
        } else {
            l.f16 = tail + (((long)slot * kv_heads + kvh) * S::TAIL_CAP + (tok - sink_end) % S::TAIL_CAP) * D;
        }
    }
    return l;
}

// End of the tile starting at t0: tiles never straddle a region or page boundary of either side, so
// a tile's tokens share their kind and, where coded, their page block.
template <class S>
static __device__ __forceinline__ void kvq_cb_tile_end_of(int t0, int len, int& t1) {
    if constexpr (S::KIND == KvqCbKind::Fp16) {
        t1 = min(t1, (t0 / PAGE + 1) * PAGE);
    } else {
        const int sink_end = min(SINK, len);
        const int qend = kvq_quant_end(len, sink_end, S::LOCAL);
        if (t0 < sink_end) t1 = min(t1, sink_end);
        else if (t0 < qend) t1 = min(t1, min(qend, sink_end + ((t0 - sink_end) / PAGE + 1) * PAGE));
    }
}

// A coded tile's codes and per-token scales or factors, staged in shared memory before the
// tile is scored: one round trip a tile instead of one a token. RoPE codes: each (group, round)
// stream's words from the one holding the tile's first code (TILE·CODE_BITS/32 + 2 a stream, one
// more than the codes need, for the pair load of a code's second word); additive codes: [word][token].
template <class S>
static __host__ __device__ constexpr int kvq_cb_stage_words() {
    return S::KIND == KvqCbKind::Rope ? S::GROUPS * S::RESIDUALS * (TILE * S::CODE_BITS / 32 + 2)
         : S::KIND == KvqCbKind::Additive ? S::ROWS / 32 * TILE : 1;
}
template <class S>
static __device__ __forceinline__ void kvq_cb_stage(const KvqCbLoc& first, int n, kvq_u32* s_codes, float* s_scale) {
    const kvq_u32* codes = (const kvq_u32*)(first.block + S::CODES_OFFSET);
    const kvq_u16* scales = (const kvq_u16*)(first.block + S::SCALES_OFFSET);
    if constexpr (S::KIND == KvqCbKind::Rope) {
        constexpr int KW = TILE * S::CODE_BITS / 32 + 2;
        const int w0 = first.row * S::CODE_BITS / 32;
        const int words = ((first.row + n) * S::CODE_BITS + 31) / 32 - w0 + 1;
        // A stream's word past its end is the next stream's first or the scales': inside the block.
        for (int i = threadIdx.x; i < S::GROUPS * S::RESIDUALS * KW; i += THREADS) {
            const int st = i / KW, w = i % KW;
            if (w < words) s_codes[i] = codes[st * S::STREAM_WORDS + w0 + w];
        }
    } else if constexpr (S::KIND == KvqCbKind::Additive) {
        for (int i = threadIdx.x; i < S::ROWS / 32 * n; i += THREADS) {
            const int m = i / n, t = i - m * n;
            s_codes[m * TILE + t] = codes[m * PAGE + first.row + t];
        }
    }
    for (int t = threadIdx.x; t < n; t += THREADS) s_scale[t] = kvq_f16_to_f32(scales[first.row + t]);
}

// This lane's query pairs of every head (q_p, q_{p+D/2} for p = 32·k + lane; zeros past D/2),
// pre-scaled by 1/sqrt(D).
struct KvqCbQuery { float re[GQA][KVQ_CB_PPL], im[GQA][KVQ_CB_PPL]; };
static __device__ __forceinline__ void kvq_cb_load_query(const kvq_u16* q, long head_row, KvqCbQuery& qp) {
    const int lane = threadIdx.x % 32;
    const float scale = rsqrtf((float)D);
#pragma unroll
    for (int h = 0; h < GQA; ++h)
#pragma unroll
        for (int k = 0; k < KVQ_CB_PPL; ++k) {
            const int p = 32 * k + lane;
            const bool in = p < D / 2;
            qp.re[h][k] = in ? kvq_io_to_f32(q[(head_row + h) * D + p]) * scale : 0.f;
            qp.im[h][k] = in ? kvq_io_to_f32(q[(head_row + h) * D + p + D / 2]) * scale : 0.f;
        }
}

// Turns per token of this lane's RoPE pairs, θ_p / 2π with θ_p = theta^(−2p/D), in double: a
// position times it, reduced to a fraction of a turn before the f32 sincos, keeps the angle exact
// to ~1e-7 at any position (the f32 product alone is off by 2e-3 rad at 32K tokens).
static __device__ __forceinline__ void kvq_cb_rope_turns(double theta, double (&turns)[KVQ_CB_PPL]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int k = 0; k < KVQ_CB_PPL; ++k)
        turns[k] = pow(theta, -2.0 * (double)(32 * k + lane) / (double)D) * 0.15915494309189533577;
}

// Partial scores (one lane's share, before the warp sum) of an f16 key row: keys are stored after RoPE.
static __device__ __forceinline__ void kvq_cb_row_scores(const kvq_u16* k, const KvqCbQuery& qp, float (&part)[GQA]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int k2 = 0; k2 < KVQ_CB_PPL; ++k2) {
        const int p = 32 * k2 + lane;
        if (p >= D / 2) break;
        const float kr = kvq_f16_to_f32(k[p]), ki = kvq_f16_to_f32(k[p + D / 2]);
#pragma unroll
        for (int h = 0; h < GQA; ++h) part[h] = fmaf(qp.re[h][k2], kr, fmaf(qp.im[h][k2], ki, part[h]));
    }
}

// Partial scores of a RoPE-coded key at position `tok`, without its per-token scale; `codes` the
// tile's staged streams (kvq_cb_stage), `bit` the key's first code bit in each. Lanes fetch a
// group's round codes (lane r: round r0 + r) and pass each round's code to the warp, which gathers
// the two selected entries of its pairs.
template <class S = KSide>
static __device__ __forceinline__ void kvq_cb_rope_scores(const kvq_u32* codes, int bit, int tok, const kvq_u32* book_head,
                                                          const double (&turns)[KVQ_CB_PPL], const KvqCbQuery& qp, float (&part)[GQA]) {
    const int lane = threadIdx.x % 32;
    constexpr int KW = TILE * S::CODE_BITS / 32 + 2;
    constexpr int HALF = S::CODE_BITS / 2;
    constexpr kvq_u32 MASK = (1u << S::CODE_BITS) - 1u, HALF_MASK = (1u << HALF) - 1u;
    float2 sa[KVQ_CB_PPL], sb[KVQ_CB_PPL];
#pragma unroll
    for (int k = 0; k < KVQ_CB_PPL; ++k) { sa[k] = make_float2(0.f, 0.f); sb[k] = make_float2(0.f, 0.f); }
#pragma unroll
    for (int grp = 0; grp < S::GROUPS; ++grp) {
#pragma unroll
        for (int r0 = 0; r0 < S::RESIDUALS; r0 += 32) {
            kvq_u32 mine = 0u;
            if (r0 + lane < S::RESIDUALS) {
                const kvq_u32* w = codes + (grp * S::RESIDUALS + r0 + lane) * KW + bit / 32;
                mine = __funnelshift_r(w[0], w[1], bit % 32) & MASK;
            }
#pragma unroll
            for (int rr = 0; rr < 32; ++rr) {
                if (r0 + rr >= S::RESIDUALS) break;
                const kvq_u32 c = __shfl_sync(0xffffffffu, mine, rr);
                const kvq_u32* entries = book_head + (long)((grp * S::RESIDUALS + r0 + rr) * S::LEVELS) * S::PAIRS;
                const kvq_u32* ea = entries + (c >> HALF) * S::PAIRS;
                const kvq_u32* eb = entries + (c & HALF_MASK) * S::PAIRS;
#pragma unroll
                for (int k = 0; k < KVQ_CB_PPL; ++k) {
                    if ((32 * k) / S::PAIRS != grp) continue;   // this slot's pairs belong to another group
                    const int j = (32 * k) % S::PAIRS + lane;
                    const kvq_u32 a = ea[j], b = eb[j];   // (re, im) as the low and high f16 halves
                    sa[k].x += kvq_f16_to_f32((kvq_u16)a); sa[k].y += kvq_f16_to_f32((kvq_u16)(a >> 16));
                    sb[k].x += kvq_f16_to_f32((kvq_u16)b); sb[k].y += kvq_f16_to_f32((kvq_u16)(b >> 16));
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < KVQ_CB_PPL; ++k) {
        if (32 * k + lane >= D / 2) break;
        // k̂ = Σc_a + i·Σc_b, rotated to the token's position.
        const float kre = sa[k].x - sb[k].y, kim = sa[k].y + sb[k].x;
        const double t = (double)tok * turns[k];
        float s, c;
        sincospif(2.f * (float)(t - rint(t)), &s, &c);
        const float kr = kre * c - kim * s, ki = kre * s + kim * c;
#pragma unroll
        for (int h = 0; h < GQA; ++h) part[h] = fmaf(qp.re[h][k], kr, fmaf(qp.im[h][k], ki, part[h]));
    }
}

// Partial scores of an additively coded key (after RoPE) without its factor: Σ_{j∈s} (C_j⊙σ)·q, a
// lane taking rows lane + 32·m of the per-head table `s_qc` [GQA][ROWS]; `codes` the tile's staged
// [word][token] codes, `i` the key's token in the tile.
template <class S = KSide>
static __device__ __forceinline__ void kvq_cb_additive_scores(const kvq_u32* codes, int i, const float* s_qc, float (&part)[GQA]) {
    const int lane = threadIdx.x % 32;
#pragma unroll 4
    for (int m = 0; m < S::ROWS / 32; ++m) {
        const bool on = (codes[m * TILE + i] >> lane) & 1u;
#pragma unroll
        for (int h = 0; h < GQA; ++h) part[h] += on ? s_qc[h * S::ROWS + m * 32 + lane] : 0.f;
    }
}

template <int UNUSED = 0>
static __device__ __forceinline__ void kvq_codebook_decode(
    const kvq_u16* __restrict__ q,
    const kvq_u8* __restrict__ k_pool, const kvq_u8* __restrict__ v_pool,
    const kvq_i32* __restrict__ page_table, int max_pages,
    const kvq_u16* __restrict__ k_sink, const kvq_u16* __restrict__ v_sink,
    const kvq_u16* __restrict__ k_tail, const kvq_u16* __restrict__ v_tail,
    const kvq_i32* __restrict__ seq_lens, const kvq_i32* __restrict__ seq_slots, int q_len,
    const kvq_u32* __restrict__ k_book, const float* __restrict__ k_rows, const float* __restrict__ k_mean,
    const float* __restrict__ v_rows, const float* __restrict__ v_mean, double rope_theta,
    float* __restrict__ part_acc, float* __restrict__ part_ml, kvq_u16* __restrict__ out)
{
    kvq_allow_dependent_launch();   // the combine grid may be scheduled now (it waits for our writes)
    __shared__ float s_scores[GQA * TILE];
    __shared__ float s_m[GQA], s_l[GQA], s_alpha[GQA], s_mass[GQA];
    __shared__ float s_qc[KSide::KIND == KvqCbKind::Additive ? GQA * KVQ_CB_KROWS : 1];
    __shared__ float s_qmu[GQA];
    __shared__ float s_va[VSide::KIND == KvqCbKind::Additive ? GQA * VSide::ROWS : 1];
    __shared__ float s_out[GQA * D];
    __shared__ kvq_u32 s_kcodes[kvq_cb_stage_words<KSide>()], s_vcodes[kvq_cb_stage_words<VSide>()];
    __shared__ float s_kscale[TILE], s_vfac[TILE];
    static_assert(sizeof(float) * (GQA * (TILE + 5 + D) + (KSide::KIND == KvqCbKind::Additive ? GQA * KVQ_CB_KROWS : 1) +
                                   (VSide::KIND == KvqCbKind::Additive ? GQA * VSide::ROWS : 1) + kvq_cb_stage_words<KSide>() +
                                   kvq_cb_stage_words<VSide>() + 2 * TILE) <= 48 * 1024,
                  "the CTA's tables fit 48 KiB of static shared memory (kvq-codegen refuses larger shapes)");
    const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
    const int num_splits = gridDim.x, kv_heads = gridDim.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const KvqSlot at = kvq_seq_slot(seq_slots, seq_lens, seq, q_len);
    const int slot = at.slot, len = at.len, seen = at.seen;
    const long head_row = ((long)seq * kv_heads + kvh) * GQA;
    KvqCbQuery qp;
    kvq_cb_load_query(q, head_row, qp);
    double turns[KVQ_CB_PPL];
    if constexpr (KSide::KIND == KvqCbKind::Rope) kvq_cb_rope_turns(rope_theta, turns);
    constexpr int BOOK_WORDS = KSide::GROUPS * KSide::RESIDUALS * KSide::LEVELS * KSide::PAIRS;
    const kvq_u32* book_head = k_book + (long)kvh * BOOK_WORDS;
    if constexpr (KVQ_CB_SMEM_BOOK) {
        // Every token gathers 2·R·g entries of the head's codebook: from shared memory, not L2.
        extern __shared__ __align__(16) kvq_u32 s_book[];
        static_assert(BOOK_WORDS % 4 == 0, "the codebook copies in 16-byte pieces");
        for (int i = threadIdx.x; i < BOOK_WORDS / 4; i += THREADS)
            ((uint4*)s_book)[i] = ((const uint4*)book_head)[i];
        book_head = s_book;
    }
    if (threadIdx.x < GQA) {
        s_m[threadIdx.x] = KVQ_NEG_INF; s_l[threadIdx.x] = 0.f; s_alpha[threadIdx.x] = 1.f; s_mass[threadIdx.x] = 0.f;
    }
    if constexpr (KSide::KIND == KvqCbKind::Additive) {
        // The per-head tables of additive keys: (C_j ⊙ σ)·q for every row j, and μ·q.
        const float scale = rsqrtf((float)D);
        for (int i = threadIdx.x; i < GQA * (KSide::ROWS + 1); i += THREADS) {
            const int h = i / (KSide::ROWS + 1), j = i % (KSide::ROWS + 1);
            const float* w = j < KSide::ROWS ? k_rows + ((long)kvh * KSide::ROWS + j) * D : k_mean + (long)kvh * D;
            float sum = 0.f;
            for (int c = 0; c < D; ++c) sum = fmaf(w[c], kvq_io_to_f32(q[(head_row + h) * D + c]) * scale, sum);
            if (j < KSide::ROWS) s_qc[h * KSide::ROWS + j] = sum;
            else s_qmu[h] = sum;
        }
    }
    // FP16 rows' P·V: thread -> (token group, channels), as the generic kernel.
    const int tgroup = threadIdx.x / (D < THREADS ? D : THREADS);
    const int c0 = threadIdx.x % (D < THREADS ? D : THREADS);
    const bool pv_active = tgroup < TGROUPS;
    float acc[GQA][CPT], va[GQA][KVQ_CB_VROWS];
#pragma unroll
    for (int h = 0; h < GQA; ++h) {
#pragma unroll
        for (int j = 0; j < CPT; ++j) acc[h][j] = 0.f;
#pragma unroll
        for (int j = 0; j < KVQ_CB_VROWS; ++j) va[h][j] = 0.f;
    }
    __syncthreads();

    int t_begin, t_end;
    kvq_split_range(seen, split, num_splits, t_begin, t_end);
    for (int t0 = t_begin; t0 < t_end;) {
        int t1 = min(t_end, t0 + TILE);
        kvq_cb_tile_end_of<KSide>(t0, len, t1);
        kvq_cb_tile_end_of<VSide>(t0, len, t1);
        const int n = t1 - t0;
        const KvqCbLoc k0 = kvq_cb_locate<KSide>(t0, len, slot, kvh, kv_heads, k_pool, page_table, max_pages, k_sink, k_tail);
        const KvqCbLoc v0 = kvq_cb_locate<VSide>(t0, len, slot, kvh, kv_heads, v_pool, page_table, max_pages, v_sink, v_tail);
        if (k0.kind == KIND_CODED) kvq_cb_stage<KSide>(k0, n, s_kcodes, s_kscale);
        if (v0.kind == KIND_CODED) kvq_cb_stage<VSide>(v0, n, s_vcodes, s_vfac);
        __syncthreads();
        // 1. Scores: a warp a token.
        for (int i = warp; i < n; i += WARPS) {
            const int tok = t0 + i;
            // A coded tile's rows are contiguous in one block: no page-table read a token.
            KvqCbLoc l = k0;
            if (k0.kind == KIND_CODED) l.row = k0.row + i;
            else l = kvq_cb_locate<KSide>(tok, len, slot, kvh, kv_heads, k_pool, page_table, max_pages, k_sink, k_tail);
            float part[GQA];
#pragma unroll
            for (int h = 0; h < GQA; ++h) part[h] = 0.f;
            float mul = 1.f, add[GQA];
#pragma unroll
            for (int h = 0; h < GQA; ++h) add[h] = 0.f;
            if (l.kind != KIND_CODED) {
                kvq_cb_row_scores(l.f16, qp, part);
            } else if constexpr (KSide::KIND == KvqCbKind::Rope) {
                kvq_cb_rope_scores(s_kcodes, l.row * KSide::CODE_BITS - k0.row * KSide::CODE_BITS / 32 * 32, tok, book_head, turns, qp, part);
                mul = s_kscale[i];
            } else if constexpr (KSide::KIND == KvqCbKind::Additive) {
                kvq_cb_additive_scores(s_kcodes, i, s_qc, part);
                mul = s_kscale[i];
#pragma unroll
                for (int h = 0; h < GQA; ++h) add[h] = s_qmu[h];
            }
#pragma unroll
            for (int h = 0; h < GQA; ++h) {
                const float s = fmaf(kvq_warp_sum(part[h]), mul, add[h]);
                if (lane == 0) s_scores[h * TILE + i] = s;
            }
        }
        __syncthreads();
        // 2. Online softmax: warp w takes heads w, w + WARPS, ...
        for (int h = warp; h < GQA; h += WARPS) {
            float mx = KVQ_NEG_INF;
            for (int i = lane; i < n; i += 32) mx = fmaxf(mx, s_scores[h * TILE + i]);
            mx = kvq_warp_max(mx);
            const float m_old = s_m[h], m_new = fmaxf(m_old, mx);
            float sum = 0.f;
            for (int i = lane; i < n; i += 32) {
                const float p = expf(s_scores[h * TILE + i] - m_new);
                s_scores[h * TILE + i] = p;
                sum += p;
            }
            sum = kvq_warp_sum(sum);
            if (lane == 0) {
                const float alpha = m_old == KVQ_NEG_INF ? 0.f : expf(m_old - m_new);
                s_alpha[h] = alpha;
                s_l[h] = s_l[h] * alpha + sum;
                s_m[h] = m_new;
            }
        }
        __syncthreads();
        // 3. Values.
#pragma unroll
        for (int h = 0; h < GQA; ++h) {
            const float a = s_alpha[h];
#pragma unroll
            for (int j = 0; j < CPT; ++j) acc[h][j] *= a;
#pragma unroll
            for (int j = 0; j < KVQ_CB_VROWS; ++j) va[h][j] *= a;
        }
        if (v0.kind == KIND_CODED) {
            if constexpr (VSide::KIND == KvqCbKind::Additive) {
                // Σ p·w into each code row's accumulator; the probability mass for μ.
#pragma unroll 4
                for (int i = 0; i < n; ++i) {
                    const float w = s_vfac[i];
                    float pw[GQA];
#pragma unroll
                    for (int h = 0; h < GQA; ++h) pw[h] = s_scores[h * TILE + i] * w;
#pragma unroll
                    for (int j = 0; j < KVQ_CB_VROWS; ++j) {
                        const int r = threadIdx.x + j * THREADS;
                        if (r < VSide::ROWS) {
                            const bool on = (s_vcodes[(r / 32) * TILE + i] >> (r % 32)) & 1u;
#pragma unroll
                            for (int h = 0; h < GQA; ++h) va[h][j] += on ? pw[h] : 0.f;
                        }
                    }
                }
                if (threadIdx.x < GQA) {
                    float mass = 0.f;
                    for (int i = 0; i < n; ++i) mass += s_scores[threadIdx.x * TILE + i];
                    s_mass[threadIdx.x] = s_mass[threadIdx.x] * s_alpha[threadIdx.x] + mass;
                }
            }
        } else {
            if (threadIdx.x < GQA) s_mass[threadIdx.x] *= s_alpha[threadIdx.x];
            if (pv_active) {
                for (int i = tgroup; i < n; i += TGROUPS) {
                    const KvqCbLoc l = kvq_cb_locate<VSide>(t0 + i, len, slot, kvh, kv_heads, v_pool, page_table, max_pages, v_sink, v_tail);
#pragma unroll
                    for (int j = 0; j < CPT; ++j) {
                        const int c = c0 + j * THREADS;
                        if (c < D) {
                            const float x = kvq_f16_to_f32(l.f16[c]);
#pragma unroll
                            for (int h = 0; h < GQA; ++h) acc[h][j] = fmaf(s_scores[h * TILE + i], x, acc[h][j]);
                        }
                    }
                }
            }
        }
        __syncthreads();
        t0 = t1;
    }

    // The split's output: FP16 rows' sums (token groups reduced through shared memory), plus
    // (Σp)·μ + A·(C⊙σ) for additive values, A the code rows' accumulators.
    for (int i = threadIdx.x; i < GQA * D; i += THREADS) s_out[i] = 0.f;
    if constexpr (VSide::KIND == KvqCbKind::Additive) {
#pragma unroll
        for (int j = 0; j < KVQ_CB_VROWS; ++j) {
            const int r = threadIdx.x + j * THREADS;
            if (r < VSide::ROWS)
#pragma unroll
                for (int h = 0; h < GQA; ++h) s_va[h * VSide::ROWS + r] = va[h][j];
        }
    }
    __syncthreads();
    for (int g = 0; g < TGROUPS; ++g) {
        if (pv_active && tgroup == g)
#pragma unroll
            for (int h = 0; h < GQA; ++h)
#pragma unroll
                for (int j = 0; j < CPT; ++j) {
                    const int c = c0 + j * THREADS;
                    if (c < D) s_out[h * D + c] += acc[h][j];
                }
        __syncthreads();
    }
    const bool direct = num_splits == 1 && out != nullptr;
    for (int i = threadIdx.x; i < GQA * D; i += THREADS) {
        const int h = i / D, c = i % D;
        float sum = s_out[i];
        if constexpr (VSide::KIND == KvqCbKind::Additive) {
            const float* rows = v_rows + (long)kvh * VSide::ROWS * D + c;
            float coded = 0.f;
            for (int r = 0; r < VSide::ROWS; ++r) coded = fmaf(s_va[h * VSide::ROWS + r], rows[(long)r * D], coded);
            sum += fmaf(s_mass[h], v_mean[(long)kvh * D + c], coded);
        }
        part_acc[((head_row + h) * num_splits + split) * D + c] = sum;
        if (direct) out[(head_row + h) * D + c] = kvq_output_value(sum, s_l[h]);
    }
    if (threadIdx.x < GQA) {
        const int h = threadIdx.x;
        part_ml[((head_row + h) * num_splits + split) * 2] = s_m[h];
        part_ml[((head_row + h) * num_splits + split) * 2 + 1] = s_l[h];
    }
}
