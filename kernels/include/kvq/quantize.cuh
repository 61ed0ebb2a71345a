// kvq/quantize.cuh — quantize-and-pack of one page of one KV head into its block (docs/LAYOUT.md),
// bit-exact with kvq_reference::int: every step is one IEEE f32 operation or a directed f32→f16
// conversion. This header holds what every page quantizer form shares (the row sources, a group's
// parameters, the division-free encoder, Kitty's boost selection) and the naive and tiled forms;
// kvq/quantize_regs.cuh holds the coarsened and vectorized ones.
//
// The including unit defines D (head_dim) and PAGE (tokens a page) first. A quantizer is a
// template on its tensor's quantizer traits `Q`: the tensor's layout (kvq/tensor.cuh lists it)
// and
//   FORM (KvqForm), THREADS and MIN_BLOCKS (the kernel's block and __launch_bounds__),
//   REG_ITER (register forms: rows a thread), FOLD_ROWS and FOLD_ITER (naive/tiled: row classes
//   and rows a class of Kitty's score fold), TOKEN_WARP_REDUCE and LANES_PER_GROUP (token groups
//   reduced with shuffles, so many lanes a group), FAST_PACK (a warp packs a row: each lane's
//   D / 32 codes form a field that never straddles a word), NEEDS_CODE_BUFFER (every code kept
//   in shared memory: the generic packer, or the boost high plane), PADDING (a KvqGaps of the
//   block's alignment gaps, zeroed).
#pragma once
#include "kvq/common.cuh"

// How a page quantizer kernel is organised (kvq-codegen's QuantizerForm). One CTA quantizes one
// page of one KV head in every form; all write the same bytes.
enum class KvqForm { Naive, Tiled, Coarsened, Vectorized };

// A byte range [OFFSET, OFFSET + LEN) of a block that no section covers, and a list of them.
template <int OFFSET, int LEN> struct KvqGap {};
template <class... Gaps> struct KvqGaps {};
template <int OFFSET, int LEN>
static __device__ __forceinline__ void kvq_zero_gap(kvq_u8* block, int tid, int stride, KvqGap<OFFSET, LEN>) {
    for (int i = tid; i < LEN; i += stride) block[OFFSET + i] = 0;  // alignment padding
}
// Zeroes every gap, in order, threads `tid` of `stride` sharing each.
template <class... Gaps>
static __device__ __forceinline__ void kvq_zero_padding(kvq_u8* block, int tid, int stride, KvqGaps<Gaps...>) {
    (kvq_zero_gap(block, tid, stride, Gaps{}), ...);
}

// A page's rows staged in shared memory (the tiled quantizer form).
struct KvqSmemRows {
    const kvq_u16* p;
    __device__ __forceinline__ kvq_u16 at(int r, int c) const { return p[r * D + c]; }
};
// A page's rows in global memory: a prefill's input (row stride kv_heads·D) or a tail ring (`cap`
// rows, page row r at ring row (first + r) % cap).
struct KvqRows {
    const kvq_u16* base;
    long stride;
    int first, cap;
    __device__ __forceinline__ const kvq_u16* row(int r) const {
        return base + (cap > 0 ? (long)((first + r) % cap) : (long)r) * stride;
    }
    __device__ __forceinline__ kvq_u16 at(int r, int c) const { return row(r)[c]; }
};
template <bool BF16>
static __device__ __forceinline__ float kvq_raw_to_f32(kvq_u16 h) {
    return BF16 ? kvq_bf16_to_f32(h) : kvq_f16_to_f32(h);
}
// Exact elementwise min/max of two pairs of 16-bit floats (sm_80+).
template <bool BF16>
static __device__ __forceinline__ kvq_u32 kvq_min2(kvq_u32 a, kvq_u32 b) {
    kvq_u32 d;
    if (BF16) asm("min.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    else asm("min.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
template <bool BF16>
static __device__ __forceinline__ kvq_u32 kvq_max2(kvq_u32 a, kvq_u32 b) {
    kvq_u32 d;
    if (BF16) asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    else asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
// Folds v[0..N) in halves, level by level (v[k] += v[k + N/2], then N/2, …; the reference's score
// order, docs/LAYOUT.md §3.4): a compile-time recursion, so every index stays a register.
template <int N, int M>
static __device__ __forceinline__ void kvq_fold_halves(float (&v)[M]) {
    if constexpr (N > 1) {
#pragma unroll
        for (int k = 0; k < N / 2; ++k) v[k] = __fadd_rn(v[k], v[k + N / 2]);
        kvq_fold_halves<N / 2>(v);
    }
}
// Exclusive prefix sum of x over the lanes of a warp.
static __device__ __forceinline__ int kvq_warp_exclusive_scan(int x, int lane) {
    int sum = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, sum, o);
        if (lane >= o) sum += y;
    }
    return sum - x;
}

// Scale/zero of a group, as kvq_reference::int::Quantizer::params: zero rounded down, scale rounded
// up and widened until fma(scale, L, zero) reaches the top.
template <class Q>
static __device__ __forceinline__ void kvq_group_params(float lo, float hi, float levels, bool symmetric,
                                                        kvq_u16& scale_h, kvq_u16& zero_h) {
    // RN(1/L) of the base and the boosted width, folded by the compiler.
    constexpr float QINV = 1.0f / (float)Q::LEVELS;
    constexpr float BOOST_INV = 1.0f / (float)(Q::BOOST ? Q::BOOST_LEVELS : 1);
    float zf, top;
    if (symmetric) { zero_h = 0; zf = 0.f; top = fmaxf(fabsf(lo), fabsf(hi)); }
    else { zero_h = kvq_f32_to_f16_rd(lo); zf = kvq_f16_to_f32(zero_h); top = hi; }
    if (top == zf) { scale_h = 0; return; }
    // (top − zero) / L correctly rounded: by the reciprocal and one exact residual (Markstein, as in
    // the encoder below) unless the span is too extreme for that to hold.
    float inv_levels;
    if constexpr (Q::BOOST) inv_levels = levels == (float)Q::BOOST_LEVELS ? BOOST_INV : QINV;
    else inv_levels = QINV;
    const float span = __fsub_rn(top, zf);
    float quotient;
    if (span < 1e-30f || span > 1e30f) quotient = __fdiv_rn(span, levels);
    else {
        const float q0 = __fmul_rn(span, inv_levels);
        quotient = __fmaf_rn(__fmaf_rn(-q0, levels, span), inv_levels, q0);
    }
    kvq_u16 s = kvq_f32_to_f16_ru(quotient);
    for (int i = 0; i < 8; ++i) {
        if ((s & 0x7fff) >= 0x7c00) break;
        if (__fmaf_rn(kvq_f16_to_f32(s), levels, zf) >= top) break;
        s = kvq_f16_next_up(s);
    }
    scale_h = s;
}

// Code of x in a group, exactly as Quantizer::encode (IEEE division, round half to even) without a
// division: with inv = RN(1/s) (0 for s = 0), q0 = d·inv, the exact residual r = fma(−q0, s, d) and
// q = fma(r, inv, q0) is the correctly rounded d/s (Markstein; kvq_reference's
// `encode_by_reciprocal` checks it on every f16 scale). Adding 1.5·2^23 (+ the symmetric offset)
// rounds half to even and leaves the code in the low bits. Returns those bits: code = result & 0xFF,
// and the bits above it are those of 1.5·2^23 (0x4B400000 + code). Only the lower clamp is applied: the
// scale's widening keeps q below L + 1/2 for every finite scale (|x| ≤ fma(s, L, zero) up to one f32
// rounding, far below s/2 for f16/bf16 values), and it turns the NaN of an infinite scale into 0 as
// the full clamp did.
static __device__ __forceinline__ kvq_u32 kvq_encode_bits(float x, float s, float inv, float zf, float levels, bool symmetric) {
    const float d = symmetric ? x : __fsub_rn(x, zf);
    const float q0 = __fmul_rn(d, inv);
    const float q = __fmaf_rn(__fmaf_rn(-q0, s, d), inv, q0);
    const float c = fmaxf(q, symmetric ? -levels : 0.f);
    return __float_as_uint(__fadd_rn(c, symmetric ? 12582912.f + (levels + 1.f) : 12582912.f));
}
static __device__ __forceinline__ kvq_u32 kvq_encode(float x, float s, float inv, float zf, float levels, bool symmetric) {
    return kvq_encode_bits(x, s, inv, zf, levels, symmetric) & 0xFFu;
}

// Packs this lane's CPL codes of one row into the row's words: each lane's codes fill a
// contiguous field of CPL·width bits (low plane first); lanes whose fields share a word OR them
// together with shuffles, and one lane per word stores it. Fields never straddle words (checked by
// kvq-codegen before choosing this path).
template <int CPL, int WIDTH, int SHIFT>
static __device__ __forceinline__ void kvq_pack_fields(const kvq_u32 (&codes)[CPL], kvq_u32* row_words, int lane) {
    constexpr int F = CPL * WIDTH;
    unsigned long long field = 0;
#pragma unroll
    for (int j = 0; j < CPL; ++j) field |= (unsigned long long)((codes[j] >> SHIFT) & ((1u << WIDTH) - 1u)) << (j * WIDTH);
    if constexpr (F >= 32) {
#pragma unroll
        for (int m = 0; m < F / 32; ++m) row_words[lane * (F / 32) + m] = (kvq_u32)(field >> (32 * m));
    } else {
        constexpr int L = 32 / F;
        kvq_u32 w = (kvq_u32)field << ((lane % L) * F);
#pragma unroll
        for (int o = 1; o < L; o <<= 1) w |= __shfl_xor_sync(0xffffffffu, w, o);
        if (lane % L == 0) row_words[lane / L] = w;
    }
}

// ---- Kitty's boost: scores in the reference's halving-fold order and the selection of the
// boosted channels (docs/LAYOUT.md §3.4). Shared by every quantizer form.

// Folds the FS per-row-class partials of each channel (s_part[r0 * D + c], r0 < FS) in halves: the
// last FS levels of the reference's fold. `divide`: store fold / PAGE (the variance's mean).
template <int FS>
static __device__ __forceinline__ void kvq_fold_partials(const float* s_part, float* s_out, bool divide) {
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float v[FS];
#pragma unroll
        for (int k = 0; k < FS; ++k) v[k] = s_part[k * D + c];
        kvq_fold_halves<FS>(v);
        s_out[c] = divide ? __fdiv_rn(v[0], (float)PAGE) : v[0];
    }
}

// Folds FI register values in halves (rows r, r + FI/2·stride, … of one thread).
template <int FI>
static __device__ __forceinline__ float kvq_fold_registers(float (&acc)[FI]) {
    kvq_fold_halves<FI>(acc);
    return acc[0];
}

// The score term of one value (rows past the page contribute +0, so they pad the fold exactly).
template <class Q>
static __device__ __forceinline__ float kvq_score_term(float x, float mean) {
    if constexpr (Q::BOOST_BY == KvqBoostBy::Variance) {
        const float d = __fsub_rn(x, mean);
        return __fmul_rn(d, d);
    } else {
        return fabsf(x);
    }
}

// Scores of every channel into s_score for a source of rows (tiled and naive forms): task (c, r0)
// folds rows r0, r0 + FS, … in registers, then one thread per channel folds the FS partials.
// s_part: FS·D floats.
template <class Q, bool BF16, class Src>
static __device__ void kvq_fold_scores(const Src& src, float* s_part, float* s_score) {
    constexpr int FS = Q::FOLD_ROWS, FI = Q::FOLD_ITER;
    constexpr bool VARIANCE = Q::BOOST_BY == KvqBoostBy::Variance;
    if constexpr (VARIANCE) {
        for (int task = threadIdx.x; task < FS * D; task += blockDim.x) {
            const int c = task % D, r0 = task / D;
            float acc[FI];
#pragma unroll
            for (int i = 0; i < FI; ++i) {
                const int r = r0 + i * FS;
                acc[i] = r < PAGE ? kvq_raw_to_f32<BF16>(src.at(r, c)) : 0.f;
            }
            s_part[r0 * D + c] = kvq_fold_registers<FI>(acc);
        }
        __syncthreads();
        kvq_fold_partials<FS>(s_part, s_score, true);  // the means
        __syncthreads();
    }
    for (int task = threadIdx.x; task < FS * D; task += blockDim.x) {
        const int c = task % D, r0 = task / D;
        const float mean = VARIANCE ? s_score[c] : 0.f;
        float acc[FI];
#pragma unroll
        for (int i = 0; i < FI; ++i) {
            const int r = r0 + i * FS;
            acc[i] = r < PAGE ? kvq_score_term<Q>(kvq_raw_to_f32<BF16>(src.at(r, c)), mean) : 0.f;
        }
        s_part[r0 * D + c] = kvq_fold_registers<FI>(acc);
    }
    __syncthreads();
    kvq_fold_partials<FS>(s_part, s_score, false);
    __syncthreads();
}

// Parts the rank comparisons of one channel are split into (so 256 threads share the work): the
// largest power of two p with p·D ≤ 256, which divides D (a multiple of 16).
static __host__ __device__ constexpr int kvq_rank_parts() {
    int p = 1;
    while (2 * p * D <= 256) p *= 2;
    return p;
}
static constexpr int KVQ_RANK_PARTS = kvq_rank_parts();

// The Q::BOOST_CHANNELS channels with the largest scores (ties to the lower channel) and each
// one's slot (its rank in channel order) into s_map (0xFF: not boosted). Every thread of the CTA: a
// channel's rank is the number of channels that beat it (a higher score, or the same score and a
// lower index), counted in KVQ_RANK_PARTS slices; slots are prefix counts of the boosted flags.
// Scratch: s_rank (KVQ_RANK_PARTS · D ints), s_bits (ceil(D / 32) words).
template <class Q>
static __device__ void kvq_select_boosted(const float* s_score, int* s_rank, kvq_u32* s_bits, kvq_u8* s_map) {
    constexpr int PARTS = KVQ_RANK_PARTS, SPAN = D / PARTS, K = Q::BOOST_CHANNELS;
    static_assert(SPAN * PARTS == D, "rank parts that miss channels");
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid % 32;
    for (int w = tid; w < PARTS * D; w += nt) {
        const int c = w % D, part = w / D;
        const float sc = s_score[c];
        int beats = 0;
#pragma unroll 8
        for (int o = part * SPAN; o < (part + 1) * SPAN; ++o) {
            const float so = s_score[o];
            beats += (so > sc) || (so == sc && o < c);
        }
        s_rank[w] = beats;
    }
    __syncthreads();
    if constexpr (D % 32 == 0) {
        for (int c = tid; c < D; c += nt) {  // whole warps: D and nt are multiples of 32
            int rank = 0;
#pragma unroll
            for (int part = 0; part < PARTS; ++part) rank += s_rank[part * D + c];
            const kvq_u32 word = __ballot_sync(0xffffffffu, rank < K);
            if (lane == 0) s_bits[c / 32] = word;
        }
    } else {
        // Whole warps over ceil(D / 32) words: lanes past D vote "not boosted".
        for (int c = tid; c < (D + 31) / 32 * 32; c += nt) {
            int rank = K;
            if (c < D) {
                rank = 0;
#pragma unroll
                for (int part = 0; part < PARTS; ++part) rank += s_rank[part * D + c];
            }
            const kvq_u32 word = __ballot_sync(0xffffffffu, rank < K);
            if (lane == 0) s_bits[c / 32] = word;
        }
    }
    __syncthreads();
    for (int c = tid; c < D; c += nt) {
        const kvq_u32 word = s_bits[c / 32];
        int slot = __popc(word & ((1u << lane) - 1u));
        for (int k = 0; k < c / 32; ++k) slot += __popc(s_bits[k]);
        s_map[c] = (word >> lane) & 1u ? (kvq_u8)slot : (kvq_u8)0xFF;
    }
}

// ---- The naive and tiled forms: one CTA per page, phases separated by barriers, values read
// through a row source (shared memory for tiled, global memory for naive).

// Quantizes a page of raw 16-bit values (`BF16`: bfloat16, else IEEE half) read through `src` — rows
// staged in shared memory (tiled form) or straight from global memory (naive form) — into the block.
// Shared scratch: s_scale/s_zero (scale-count entries), s_codes [PAGE][D] bytes (also the boost
// fold's partials), s_lo/s_hi (blockDim floats each), s_score (D floats), s_map (D bytes).
template <class Q, bool BF16, class Src>
static __device__ void kvq_quantize_page(const Src& src, kvq_u8* block,
                                         kvq_u16* s_scale, kvq_u16* s_zero, kvq_u8* s_codes,
                                         float* s_lo, float* s_hi, float* s_score,
                                         kvq_u8* s_map, float* s_group, int* s_rank) {
    constexpr bool CHANNEL = Q::AXIS == KvqAxis::Channel;
    constexpr int GPT = Q::GROUPS_PER_TOKEN, GROUP = Q::GROUP;
    const int tid = threadIdx.x, nt = blockDim.x;
    const bool sym = Q::SYMMETRIC;
    // A task: one channel over the page's tokens, or one (token, group).
    constexpr int TASKS = CHANNEL ? D : PAGE * GPT, SPAN = CHANNEL ? PAGE : GROUP;
    // 1. Min/max of every group (exact: min and max are associative, so any split gives the
    //    reference's values).
    const int split = TASKS >= nt ? 1 : nt / TASKS;
    constexpr bool SPLIT_PARTIALS = !(!CHANNEL && Q::TOKEN_WARP_REDUCE);
    if constexpr (!SPLIT_PARTIALS) {
        // A warp per token row: lanes read neighbouring channels (no bank conflicts) and reduce
        // over the LANES_PER_GROUP lanes that share a group with shuffles.
        constexpr int CPL = D / 32, LPG = Q::LANES_PER_GROUP;
        const int lane = tid % 32;
        for (int r = tid / 32; r < PAGE; r += nt / 32) {
            float lo = __int_as_float(0x7f800000), hi = KVQ_NEG_INF;
#pragma unroll
            for (int j = 0; j < CPL; ++j) {
                const float x = kvq_raw_to_f32<BF16>(src.at(r, lane * CPL + j));
                lo = fminf(lo, x);
                hi = fmaxf(hi, x);
            }
#pragma unroll
            for (int o = 1; o < LPG; o <<= 1) {
                lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
                hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
            }
            if (lane % LPG == 0) {
                const int task = r * GPT + (lane * CPL) / GROUP;
                s_lo[task] = lo;
                s_hi[task] = hi;
            }
        }
    } else {
        for (int w = tid; w < TASKS * split; w += nt) {
            const int task = w % TASKS, part = w / TASKS;
            const int chunk = (SPAN + split - 1) / split;
            const int from = part * chunk, to = min(SPAN, from + chunk);
            float lo = __int_as_float(0x7f800000), hi = KVQ_NEG_INF;
            for (int e = from; e < to; ++e) {
                float x;
                if constexpr (CHANNEL) x = kvq_raw_to_f32<BF16>(src.at(e, task));
                else x = kvq_raw_to_f32<BF16>(src.at(task / GPT, (task % GPT) * GROUP + e));
                lo = fminf(lo, x);
                hi = fmaxf(hi, x);
            }
            s_lo[w] = lo;
            s_hi[w] = hi;
        }
    }
    if constexpr (Q::BOOST) {
        // Kitty: scores in the reference's fold order, then the boosted channels and their slots.
        __syncthreads();
        kvq_fold_scores<Q, BF16>(src, (float*)s_codes, s_score);
        kvq_select_boosted<Q>(s_score, s_rank, (kvq_u32*)(s_rank + KVQ_RANK_PARTS * D), s_map);
    }
    __syncthreads();
    // 2. Scale/zero of every group.
    for (int task = tid; task < TASKS; task += nt) {
        float lo = s_lo[task], hi = s_hi[task];
        if (SPLIT_PARTIALS)
            for (int part = 1; part < split; ++part) { lo = fminf(lo, s_lo[part * TASKS + task]); hi = fmaxf(hi, s_hi[part * TASKS + task]); }
        float levels;
        if constexpr (Q::BOOST) levels = s_map[task] != 0xFF ? (float)Q::BOOST_LEVELS : (float)Q::LEVELS;
        else levels = (float)Q::LEVELS;
        kvq_group_params<Q>(lo, hi, levels, sym, s_scale[task], s_zero[task]);
        // f32 scale, reciprocal and zero for the encoder.
        const float sf = kvq_f16_to_f32(s_scale[task]);
        s_group[3 * task] = sf;
        s_group[3 * task + 1] = sf == 0.f ? 0.f : __frcp_rn(sf);
        s_group[3 * task + 2] = kvq_f16_to_f32(s_zero[task]);
    }
    __syncthreads();
    if constexpr (Q::FAST_PACK) {
        // 3+4. A warp per token row; lane owns channels lane·CPL ..; parameters in registers.
        constexpr int CPL = D / 32;
        const int lane = tid % 32;
        float sf[CPL], inv[CPL], zf[CPL], lv[CPL];  // channel groups: this lane's channels
        if constexpr (CHANNEL) {
#pragma unroll
            for (int j = 0; j < CPL; ++j) {
                const int c = lane * CPL + j;
                sf[j] = s_group[3 * c]; inv[j] = s_group[3 * c + 1]; zf[j] = s_group[3 * c + 2];
                if constexpr (Q::BOOST) lv[j] = s_map[c] != 0xFF ? (float)Q::BOOST_LEVELS : (float)Q::LEVELS;
                else lv[j] = (float)Q::LEVELS;
            }
        }
        for (int r = tid / 32; r < PAGE; r += nt / 32) {
            kvq_u32 codes[CPL];
            float x[CPL];
#pragma unroll
            for (int j = 0; j < CPL; ++j) x[j] = kvq_raw_to_f32<BF16>(src.at(r, lane * CPL + j));
            if constexpr (CHANNEL) {
#pragma unroll
                for (int j = 0; j < CPL; ++j) codes[j] = kvq_encode(x[j], sf[j], inv[j], zf[j], lv[j], sym);
            } else {
                const int gi = r * GPT + (lane * CPL) / GROUP;
                const float sfg = s_group[3 * gi], invg = s_group[3 * gi + 1], zfg = s_group[3 * gi + 2];
#pragma unroll
                for (int j = 0; j < CPL; ++j) codes[j] = kvq_encode(x[j], sfg, invg, zfg, (float)Q::LEVELS, sym);
            }
            kvq_u32* row_words = (kvq_u32*)(block + Q::CODES_OFFSET) + r * Q::ROW_WORDS;
            if constexpr (Q::BITS == 3) {
                kvq_pack_fields<CPL, 2, 0>(codes, row_words, lane);
                kvq_pack_fields<CPL, 1, 2>(codes, row_words + Q::LOW_PLANE_WORDS, lane);
            } else {
                kvq_pack_fields<CPL, Q::BITS, 0>(codes, row_words, lane);
            }
            if constexpr (Q::BOOST) {
#pragma unroll
                for (int j = 0; j < CPL; ++j) s_codes[r * D + lane * CPL + j] = (kvq_u8)codes[j];
            }
        }
        if constexpr (Q::BOOST) __syncthreads();
    } else {
        // 3. Every element's code, one per thread (independent IEEE divisions keep the pipes busy).
        for (int i = tid; i < PAGE * D; i += nt) {
            const int c = i % D;
            int gi;
            float levels;
            if constexpr (CHANNEL) {
                gi = c;
                if constexpr (Q::BOOST) levels = s_map[c] != 0xFF ? (float)Q::BOOST_LEVELS : (float)Q::LEVELS;
                else levels = (float)Q::LEVELS;
            } else {
                gi = (i / D) * GPT + c / GROUP;
                levels = (float)Q::LEVELS;
            }
            s_codes[i] = (kvq_u8)kvq_encode(kvq_raw_to_f32<BF16>(src.at(i / D, c)), s_group[3 * gi], s_group[3 * gi + 1], s_group[3 * gi + 2], levels, sym);
        }
        __syncthreads();
        // 4. Pack: one thread per output word, rows token-major, planes low bits first.
        for (int i = tid; i < PAGE * Q::ROW_WORDS; i += nt) {
            const int r = i / Q::ROW_WORDS, w = i % Q::ROW_WORDS;
            int width, shift, first;
            if constexpr (Q::BITS == 3) {
                if (w < Q::LOW_PLANE_WORDS) { width = 2; shift = 0; first = w * 16; }
                else { width = 1; shift = 2; first = (w - Q::LOW_PLANE_WORDS) * 32; }
            } else {
                width = Q::BITS; shift = 0; first = w * Q::PER_WORD;
            }
            const int per = 32 / width;
            const kvq_u8* codes = s_codes + r * D;
            kvq_u32 word = 0;
            for (int j = 0; j < per; ++j) {
                const int c = first + j;
                if (c >= D) break;
                word |= (((kvq_u32)codes[c] >> shift) & ((1u << width) - 1u)) << (j * width);
            }
            ((kvq_u32*)(block + Q::CODES_OFFSET))[i] = word;
        }
    }
    if constexpr (Q::BOOST) {
        // High plane: boosted channels' high bits in slot order.
        for (int i = tid; i < PAGE * Q::HIGH_ROW_WORDS; i += nt) {
            const int r = i / Q::HIGH_ROW_WORDS, w = i % Q::HIGH_ROW_WORDS;
            kvq_u32 word = 0;
            for (int c = 0; c < D; ++c) {
                const int slot = s_map[c];
                if (slot == 0xFF || slot / Q::HIGH_PER_WORD != w) continue;
                word |= (((kvq_u32)s_codes[r * D + c] >> Q::BITS) & Q::HIGH_MASK) << ((slot % Q::HIGH_PER_WORD) * Q::HIGH_BITS);
            }
            ((kvq_u32*)(block + Q::HIGH_OFFSET))[i] = word;
        }
        for (int c = tid; c < D; c += nt) block[Q::MAP_OFFSET + c] = s_map[c];
        for (int c = tid; c < D; c += nt) {  // the slot table: the map inverted
            const int slot = s_map[c];
            if (slot != 0xFF) block[Q::SLOTS_OFFSET + slot] = (kvq_u8)c;
        }
    }
    kvq_zero_padding(block, tid, nt, typename Q::PADDING{});
    for (int i = tid; i < Q::SCALE_COUNT; i += nt) {
        ((kvq_u16*)(block + Q::SCALES_OFFSET))[i] = s_scale[i];
        if constexpr (!Q::SYMMETRIC) ((kvq_u16*)(block + Q::ZEROS_OFFSET))[i] = s_zero[i];
    }
}
