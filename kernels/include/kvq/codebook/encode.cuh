#pragma once
// Filling a paged CommVQ cache on the GPU (docs/CODEBOOKS.md §5): the FP16 rows of a chunk of new
// tokens, and whole pages encoded into their (page, KV head) blocks, bit for bit the blocks
// kvq_reference::commvq::device lays out from CommVqCache::build_rotated on the same inputs.
//
// The including unit defines (kvq/common.cuh, kvq/io.cuh and kvq/codebook/side.cuh first):
//   IO, D, PAGE, SINK, KSide and VSide (side.cuh's members), ENCODE_WARPS (warps of an encoder
//   CTA) and ENCODE_TOKENS (tokens a warp of the RoPE key encoder codes together).
//
// Exactness: the reference encoders compute in f64 (kvq_reference::commvq::key, ::additive). Every
// arithmetic step here is the same IEEE f64 operation in the same order — explicit __dadd_rn /
// __dsub_rn / __dmul_rn, so no multiply-add is ever contracted — and the tables a step reads are
// the reference's own, computed on the host (kvq_reference::commvq::encoder). Its 4-way dot product
// is reproduced accumulator by accumulator; a sum over an iterator starts at -0.0 as Rust's does.
// Conversions: f16/bf16 → f32 → f64 are exact; f64 → f16 rounds to f32 first, as the reference does.
//
// Inputs are rows of the unit's 16-bit format. A chunk's source for the encoders is either the
// caller's tensor ([token][kv_head][D]) or a sequence's pending ring ([kv_head][TAIL_CAP][D], the
// not yet coded tokens in the input format, slot (t − sink_end) mod TAIL_CAP as the FP16 tail).

// Status words, all zero when nothing went wrong (so zeroed memory is a clean status): [0] flags,
// [1] the first token whose input is out of range, [2] the first token whose scale or factor
// overflows f16, each token stored complemented (~t) so that an atomic max keeps the first.
// Engine caches keep KVQ_CB_STATUS_WORDS a sequence slot.
static constexpr kvq_u32 KVQ_CB_BAD_INPUT = 1, KVQ_CB_SCALE_OVERFLOW = 2, KVQ_CB_FACTOR_OVERFLOW = 4;
static constexpr int KVQ_CB_STATUS_WORDS = 4;
static constexpr float KVQ_F16_MAX = 65504.f;

static __device__ __forceinline__ void kvq_cb_flag(kvq_u32* status, kvq_u32 flag, int word, int token) {
    atomicOr(status, flag);
    atomicMax(status + word, ~(kvq_u32)token);
}

// f64 → f16 as the reference rounds it (kvq_reference::commvq::f16_of_f64): to the nearest f32,
// then to the nearest f16, not PTX's one-step cvt.rn.f16.f64, which can differ in the last bit.
static __device__ __forceinline__ kvq_u16 kvq_f64_to_f16(double x) { return kvq_f32_to_f16(__double2float_rn(x)); }
static __device__ __forceinline__ bool kvq_f16_bits_finite(kvq_u16 h) { return (h & 0x7c00) != 0x7c00; }
static __device__ __forceinline__ double kvq_io_to_f64(kvq_u16 x) { return (double)kvq_io_to_f32(x); }

// The reference's dot product (kvq_reference::commvq::key::dot): four interleaved partial sums over
// whole chunks of four, then ((a0 + a1) + (a2 + a3)) + the remainder's sequential sum.
template <int N>
static __device__ __forceinline__ double kvq_dot4(const double* x, const double* y) {
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
#pragma unroll 4
    for (int k = 0; k < N / 4; ++k) {
        a0 = __dadd_rn(a0, __dmul_rn(x[4 * k], y[4 * k]));
        a1 = __dadd_rn(a1, __dmul_rn(x[4 * k + 1], y[4 * k + 1]));
        a2 = __dadd_rn(a2, __dmul_rn(x[4 * k + 2], y[4 * k + 2]));
        a3 = __dadd_rn(a3, __dmul_rn(x[4 * k + 3], y[4 * k + 3]));
    }
    double tail = -0.0;
#pragma unroll
    for (int i = N / 4 * 4; i < N; ++i) tail = __dadd_rn(tail, __dmul_rn(x[i], y[i]));
    return __dadd_rn(__dadd_rn(__dadd_rn(a0, a1), __dadd_rn(a2, a3)), tail);
}

// Rows of a chunk's source: token r of the chunk (r from `first`) of KV head h.
struct KvqCbRows {
    const kvq_u16* base;
    long tok_stride, head_stride;
    int first, cap;   // cap > 0: a ring of `cap` rows, token r at row (first + r) % cap
    __device__ __forceinline__ const kvq_u16* row(int h, int r) const {
        const long at = cap > 0 ? (long)((first + r) % cap) : (long)(first + r);
        return base + h * head_stride + at * tok_stride;
    }
};

// Whether a 16-bit input value is one the cache takes: finite and within f16's range (the
// reference's check_cacheable).
static __device__ __forceinline__ bool kvq_cb_cacheable(kvq_u16 x) {
    const float f = kvq_io_to_f32(x);
    return fabsf(f) <= KVQ_F16_MAX;   // false for NaN and ±inf too
}

// ---------------------------------------------------------------------------------------------
// Rows: a chunk's FP16 rows into the sink, tail ring or FP16 pages, its coded sides' inputs into
// the pending rings, every input value checked. Grid (chunk tokens, kv_heads), block 128.

template <class S>
static __device__ __forceinline__ void kvq_cb_store_side(const kvq_u16* fp16_src, const kvq_u16* coded_src, int tok, int ring_from,
                                                         int slot, int kvh, int kv_heads, kvq_u8* pool, const kvq_i32* page_table,
                                                         int max_pages, kvq_u16* sink, kvq_u16* tail, kvq_u16* pending) {
    if constexpr (S::KIND == KvqCbKind::Fp16) {
        const long phys = page_table[(long)slot * max_pages + tok / PAGE];
        kvq_u16* dst = (kvq_u16*)(pool + (phys * kv_heads + kvh) * (long)S::BLOCK_BYTES) + (tok % PAGE) * D;
        for (int c = threadIdx.x; c < D; c += blockDim.x) dst[c] = kvq_f32_to_f16(kvq_io_to_f32(fp16_src[c]));
    } else {
        if (tok < SINK) {
            kvq_u16* dst = sink + (((long)slot * kv_heads + kvh) * SINK + tok) * D;
            for (int c = threadIdx.x; c < D; c += blockDim.x) dst[c] = kvq_f32_to_f16(kvq_io_to_f32(fp16_src[c]));
        } else if (tok >= ring_from) {
            const long row = (((long)slot * kv_heads + kvh) * S::TAIL_CAP + (tok - SINK) % S::TAIL_CAP) * D;
            for (int c = threadIdx.x; c < D; c += blockDim.x) {
                tail[row + c] = kvq_f32_to_f16(kvq_io_to_f32(fp16_src[c]));
                pending[row + c] = coded_src[c];
            }
        }
    }
}

// Token `tok` of sequence `slot`, KV head `kvh`: row `row` of `k_pre`, `k_post`, `v` ([row][kv_head][D];
// k_pre only read when keys are RoPE-coded). A coded side's tokens below its `ring_from` are left to
// a page encoder that reads the caller's tensors.
static __device__ __forceinline__ void kvq_cb_store_rows(const kvq_u16* k_pre, const kvq_u16* k_post, const kvq_u16* v, int row, int tok,
                                                         int kvh, int kv_heads, int k_ring_from, int v_ring_from, int slot,
                                                         kvq_u8* k_pool, kvq_u8* v_pool, const kvq_i32* page_table, int max_pages,
                                                         kvq_u16* k_sink, kvq_u16* v_sink, kvq_u16* k_tail, kvq_u16* v_tail,
                                                         kvq_u16* k_pending, kvq_u16* v_pending, kvq_u32* status) {
    const long at = ((long)row * kv_heads + kvh) * D;
    bool ok = true;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        ok = ok && kvq_cb_cacheable(k_post[at + c]) && kvq_cb_cacheable(v[at + c]);
        if constexpr (KSide::KIND == KvqCbKind::Rope) ok = ok && kvq_cb_cacheable(k_pre[at + c]);
    }
    if (!ok) kvq_cb_flag(status, KVQ_CB_BAD_INPUT, 1, tok);
    const kvq_u16* k_coded = KSide::KIND == KvqCbKind::Rope ? k_pre + at : k_post + at;
    kvq_cb_store_side<KSide>(k_post + at, k_coded, tok, k_ring_from, slot, kvh, kv_heads, k_pool, page_table, max_pages, k_sink,
                             k_tail, k_pending);
    kvq_cb_store_side<VSide>(v + at, v + at, tok, v_ring_from, slot, kvh, kv_heads, v_pool, page_table, max_pages, v_sink, v_tail,
                             v_pending);
}

// A coded page's block: zeroed by the whole CTA (alignment gaps included) before it is written.
template <class S>
static __device__ __forceinline__ kvq_u8* kvq_cb_zero_block(kvq_u8* pool, const kvq_i32* page_table, int max_pages, int slot,
                                                            int page, int kvh, int kv_heads) {
    const long phys = page_table[(long)slot * max_pages + page];
    kvq_u8* block = pool + (phys * kv_heads + kvh) * (long)S::BLOCK_BYTES;
    for (int i = threadIdx.x; i < S::BLOCK_BYTES / 4; i += blockDim.x) ((kvq_u32*)block)[i] = 0;
    __syncthreads();
    return block;
}

// ---------------------------------------------------------------------------------------------
// RoPE-commutative keys (kvq_reference::commvq::key::GroupEncoder): grid (pages, kv_heads), block
// ENCODE_WARPS warps; page j of the launch is logical page page0 + j, its tokens the source's rows
// j·PAGE … A warp codes ENCODE_TOKENS tokens' vectors of one group together, so each table entry it
// reads serves them all: lanes compute the projections α, β of the entries, then the lanes' shares
// of the N'² distances and a warp argmin per token (ties: the smallest a·N' + b, the reference's
// first strict minimum), then the residual updates. Each token's arithmetic is its own, in the
// reference's order.

struct KvqRopeTables { const double *c, *ic, *norm, *cross; };

static constexpr int KVQ_RK_DIM = 2 * KSide::PAIRS;   // a group vector's real dimension
static constexpr int KVQ_RK_LEVELS = KSide::LEVELS;

// The f16 scale of token r (its key's norm, over one head or all heads for span = token) and its
// reciprocal, as kvq_reference::commvq::vectors::key_scales and encode_rope compute them.
static __device__ __forceinline__ void kvq_rk_scale(const KvqCbRows& src, int r, int kvh, int kv_heads, kvq_u16& bits, double& inv,
                                                    bool& bad_input) {
    double sum = -0.0;
    const int h0 = KSide::TOKEN_SCALE ? 0 : kvh, h1 = KSide::TOKEN_SCALE ? kv_heads : kvh + 1;
    bad_input = false;
    for (int h = h0; h < h1; ++h) {
        const kvq_u16* row = src.row(h, r);
        for (int c = 0; c < D; ++c) {
            bad_input = bad_input || !kvq_cb_cacheable(row[c]);
            const double x = kvq_io_to_f64(row[c]);
            sum = __dadd_rn(sum, __dmul_rn(x, x));
        }
    }
    bits = kvq_f64_to_f16(__dsqrt_rn(sum));
    const double s = (double)kvq_f16_to_f32(bits);
    inv = s > 0.0 ? __ddiv_rn(1.0, s) : 0.0;
}

// kvq_dot4 of T vectors x[t] (rows of stride N) with one y, reading each y element once.
template <int T, int N>
static __device__ __forceinline__ void kvq_dot4_many(const double* x, const double* y, double (&out)[T]) {
    double a[T][4];
#pragma unroll
    for (int t = 0; t < T; ++t) a[t][0] = a[t][1] = a[t][2] = a[t][3] = 0.0;
#pragma unroll 2
    for (int k = 0; k < N / 4; ++k) {
        const double y0 = y[4 * k], y1 = y[4 * k + 1], y2 = y[4 * k + 2], y3 = y[4 * k + 3];
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const double* xt = x + t * N + 4 * k;
            a[t][0] = __dadd_rn(a[t][0], __dmul_rn(xt[0], y0));
            a[t][1] = __dadd_rn(a[t][1], __dmul_rn(xt[1], y1));
            a[t][2] = __dadd_rn(a[t][2], __dmul_rn(xt[2], y2));
            a[t][3] = __dadd_rn(a[t][3], __dmul_rn(xt[3], y3));
        }
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
        double tail = -0.0;
#pragma unroll
        for (int i = N / 4 * 4; i < N; ++i) tail = __dadd_rn(tail, __dmul_rn(x[t * N + i], y[i]));
        out[t] = __dadd_rn(__dadd_rn(__dadd_rn(a[t][0], a[t][1]), __dadd_rn(a[t][2], a[t][3])), tail);
    }
}

static __device__ void kvq_encode_rope_keys(KvqCbRows src, int page, int kvh, int kv_heads, int slot, kvq_u8* pool,
                                            const kvq_i32* page_table, int max_pages, KvqRopeTables tab, kvq_u32* status) {
    constexpr int G = KSide::PAIRS, GROUPS = KSide::GROUPS, R = KSide::RESIDUALS, L = KVQ_RK_LEVELS, DIM = KVQ_RK_DIM;
    constexpr int T = ENCODE_TOKENS, HALF_BITS = KSide::CODE_BITS / 2;
    __shared__ double z_s[ENCODE_WARPS][T][DIM];
    __shared__ double alpha_s[ENCODE_WARPS][T][L], beta_s[ENCODE_WARPS][T][L];
    __shared__ kvq_u32 codes_s[GROUPS * R * PAGE];
    __shared__ double inv_s[PAGE];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    kvq_u8* block = kvq_cb_zero_block<KSide>(pool, page_table, max_pages, slot, page, kvh, kv_heads);
    kvq_u16* scales = (kvq_u16*)(block + KSide::SCALES_OFFSET);
    for (int r = threadIdx.x; r < PAGE; r += blockDim.x) {
        kvq_u16 bits;
        bool bad;
        kvq_rk_scale(src, r, kvh, kv_heads, bits, inv_s[r], bad);
        const int tok = SINK + page * PAGE + r;
        if (bad) kvq_cb_flag(status, KVQ_CB_BAD_INPUT, 1, tok);
        if (!kvq_f16_bits_finite(bits)) kvq_cb_flag(status, KVQ_CB_SCALE_OVERFLOW, 2, tok);
        scales[r] = bits;
    }
    __syncthreads();
    double* z = &z_s[warp][0][0];
    double* alpha = &alpha_s[warp][0][0];
    double* beta = &beta_s[warp][0][0];
    constexpr int CHUNKS = (PAGE + T - 1) / T;   // a group's tokens, T at a time
    for (int w = warp; w < GROUPS * CHUNKS; w += ENCODE_WARPS) {
        const int group = w / CHUNKS, r0 = (w % CHUNKS) * T;
        // Tokens past the page repeat its last token: computed, never written.
        for (int i = lane; i < T * G; i += 32) {   // pairs::gather: (x_p, x_{p+D/2}) · inv
            const int t = i / G, pair = i % G, r = min(r0 + t, PAGE - 1);
            const kvq_u16* row = src.row(kvh, r);
            const int p = group * G + pair;
            z[t * DIM + 2 * pair] = __dmul_rn(kvq_io_to_f64(row[p]), inv_s[r]);
            z[t * DIM + 2 * pair + 1] = __dmul_rn(kvq_io_to_f64(row[p + D / 2]), inv_s[r]);
        }
        __syncwarp();
        for (int round = 0; round < R; ++round) {
            const long tb = ((long)kvh * GROUPS + group) * R + round;
            const double* c = tab.c + tb * L * DIM;
            const double* ic = tab.ic + tb * L * DIM;
            const double* norm = tab.norm + tb * L;
            const double* cross = tab.cross + tb * L * L;
            // alpha holds each entry's row term norm_a − 2α_a and beta 2β_b: the values
            // RoundTables::distances computes for them, once per entry instead of per pair.
            for (int k = lane; k < L; k += 32) {
                double a[T], b[T];
                kvq_dot4_many<T, DIM>(z, c + (long)k * DIM, a);
                kvq_dot4_many<T, DIM>(z, ic + (long)k * DIM, b);
                const double nk = norm[k];
#pragma unroll
                for (int t = 0; t < T; ++t) {
                    alpha[t * L + k] = __dsub_rn(nk, __dmul_rn(2.0, a[t]));
                    beta[t * L + k] = __dmul_rn(2.0, b[t]);
                }
            }
            __syncwarp();
            // RoundTables::distances then nearest: ((norm_a − 2α_a) + norm_b) − 2β_b + 2χ_ab.
            double best[T];
            int at[T];
#pragma unroll
            for (int t = 0; t < T; ++t) { best[t] = __longlong_as_double(0x7ff0000000000000ll); at[t] = -1; }
            for (int i = lane; i < L * L; i += 32) {
                const int a = i / L, b = i % L;
                const double nb = norm[b], x2 = __dmul_rn(2.0, cross[i]);
#pragma unroll
                for (int t = 0; t < T; ++t) {
                    const double d = __dadd_rn(__dsub_rn(__dadd_rn(alpha[t * L + a], nb), beta[t * L + b]), x2);
                    if (d < best[t]) { best[t] = d; at[t] = i; }
                }
            }
#pragma unroll
            for (int t = 0; t < T; ++t) {
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    const double ob = __shfl_xor_sync(0xffffffffu, best[t], o);
                    const int oat = __shfl_xor_sync(0xffffffffu, at[t], o);
                    const bool take = oat >= 0 && (at[t] < 0 || ob < best[t] || (!(best[t] < ob) && oat < at[t]));
                    if (take) { best[t] = ob; at[t] = oat; }
                }
                if (at[t] < 0) at[t] = 0;   // every distance NaN or +inf: the reference keeps index 0
            }
            __syncwarp();   // every lane has read α and β before the next round writes them
#pragma unroll
            for (int t = 0; t < T; ++t) {
                const int a = at[t] / L, b = at[t] % L;
                const double* ca = c + (long)a * DIM;
                const double* icb = ic + (long)b * DIM;
                for (int i = lane; i < DIM; i += 32) z[t * DIM + i] = __dsub_rn(z[t * DIM + i], __dadd_rn(ca[i], icb[i]));
                if (lane == 0 && r0 + t < PAGE) codes_s[(group * R + round) * PAGE + r0 + t] = (kvq_u32)a << HALF_BITS | (kvq_u32)b;
            }
            __syncwarp();
        }
    }
    __syncthreads();
    // Pack each (group, round) stream: code r at bits r·w .. r·w + w, LSB first, maybe straddling.
    constexpr int W = KSide::CODE_BITS, SW = KSide::STREAM_WORDS;
    kvq_u32* words = (kvq_u32*)(block + KSide::CODES_OFFSET);
    for (int i = threadIdx.x; i < GROUPS * R * SW; i += blockDim.x) {
        const int stream = i / SW, w = i % SW;
        const kvq_u32* cs = codes_s + stream * PAGE;
        kvq_u32 word = 0;
        const int lo = (32 * w) / W, hi = min(PAGE - 1, (32 * w + 31) / W);
        for (int r = lo; r <= hi; ++r) {
            const int shift = r * W - 32 * w;   // may be negative: the code's high part
            const unsigned long long c = cs[r];
            word |= (kvq_u32)(shift >= 0 ? c << shift : c >> -shift);
        }
        words[i] = word;
    }
}

// ---------------------------------------------------------------------------------------------
// Binary additive tensors (kvq_reference::commvq::additive::encode_vector, span = head): grid
// (pages, kv_heads), ENCODE_WARPS warps, eight lanes a token (four tokens a warp). u = (x − μ) ⊘ σ,
// its direction coded by iterated conditional modes over the row pairs from the zero code (at most
// ENCODE_SWEEPS passes), w = ‖u‖ / ‖s·C‖. The eight lanes split each pass's two dot products by
// the reference's four accumulators (lanes 0–3 row a, 4–7 row b) and the residual's channels; the
// sums over channels in order stay on one lane.

struct KvqAdditiveTables { const double *rows, *norm, *pair_cross, *mean, *scale; };
static constexpr int KVQ_ENCODE_SWEEPS = 6;   // kvq_reference::commvq::additive::ENCODE_SWEEPS
static constexpr int KVQ_AV_LANES = 8;        // lanes a token
static constexpr int KVQ_AV_TOKENS = ENCODE_WARPS * 32 / KVQ_AV_LANES;   // tokens a CTA at a time

// One of the reference's dot products of the residual `res` with `row`, from the lanes of a half
// (four lanes, accumulator `acc` each): ((a0 + a1) + (a2 + a3)) + the remainder's sum.
static __device__ __forceinline__ double kvq_av_half_dot(const double* res, const double* row, int lane) {
    const int acc = lane % 4, first = lane & ~3;
    double a = 0.0;
    for (int k = 0; k < D / 4; ++k) a = __dadd_rn(a, __dmul_rn(res[4 * k + acc], row[4 * k + acc]));
    double tail = -0.0;
    for (int i = D / 4 * 4; i < D; ++i) tail = __dadd_rn(tail, __dmul_rn(res[i], row[i]));
    const double a0 = __shfl_sync(0xffffffffu, a, first), a1 = __shfl_sync(0xffffffffu, a, first + 1);
    const double a2 = __shfl_sync(0xffffffffu, a, first + 2), a3 = __shfl_sync(0xffffffffu, a, first + 3);
    return __dadd_rn(__dadd_rn(__dadd_rn(a0, a1), __dadd_rn(a2, a3)), tail);
}

template <class S>
static __device__ void kvq_encode_additive(KvqCbRows src, int page, int kvh, int kv_heads, int slot, kvq_u8* pool,
                                           const kvq_i32* page_table, int max_pages, KvqAdditiveTables tab, kvq_u32* status) {
    constexpr int ROWS = S::ROWS, WORDS = ROWS / 32;
    __shared__ double res_s[KVQ_AV_TOKENS][D];
    const int lane = threadIdx.x % 32, sub = threadIdx.x / KVQ_AV_LANES, jl = lane % KVQ_AV_LANES;
    const int lead = lane - jl;   // the token's first lane
    kvq_u8* block = kvq_cb_zero_block<S>(pool, page_table, max_pages, slot, page, kvh, kv_heads);
    const double* rows = tab.rows + (long)kvh * ROWS * D;
    const double* norm = tab.norm + (long)kvh * ROWS;
    const double* pair_cross = tab.pair_cross + (long)kvh * (ROWS / 2);
    const double* mean = tab.mean + (long)kvh * D;
    const double* scale = tab.scale + (long)kvh * D;
    double* res = res_s[sub];
    // Every lane of a warp runs the same number of passes of the same loops (shuffles need the
    // whole warp): a token past the page or already settled computes and changes nothing.
    for (int r0 = 0; r0 < PAGE; r0 += KVQ_AV_TOKENS) {
        const int r = r0 + sub;
        const bool live = r < PAGE;
        const kvq_u16* x = src.row(kvh, live ? r : PAGE - 1);
        const int tok = SINK + page * PAGE + r;
        bool bad = false;
        for (int c = jl; c < D; c += KVQ_AV_LANES) {
            bad = bad || !kvq_cb_cacheable(x[c]);
            res[c] = __ddiv_rn(__dsub_rn(kvq_io_to_f64(x[c]), mean[c]), scale[c]);
        }
        if (bad && live) kvq_cb_flag(status, KVQ_CB_BAD_INPUT, 1, tok);
        __syncwarp();
        double sum = -0.0;
        if (jl == 0)
            for (int c = 0; c < D; ++c) sum = __dadd_rn(sum, __dmul_rn(res[c], res[c]));
        const double unorm = __dsqrt_rn(__shfl_sync(0xffffffffu, sum, lead));
        kvq_u32 code[WORDS];
#pragma unroll
        for (int w = 0; w < WORDS; ++w) code[w] = 0;
        const bool coded = unorm != 0.0;
        if (coded)
            for (int c = jl; c < D; c += KVQ_AV_LANES) res[c] = __ddiv_rn(res[c], unorm);   // the target
        __syncwarp();
        bool active = coded;
        for (int sweep = 0; sweep < KVQ_ENCODE_SWEEPS && __any_sync(0xffffffffu, active); ++sweep) {
            bool changed = false;
            for (int grp = 0; grp < ROWS / 2; ++grp) {
                const int a = 2 * grp, b = a + 1;
                const kvq_u32 bits = code[a / 32] >> (a % 32);
                const double sa = (double)(bits & 1), sb = (double)(bits >> 1 & 1);
                const double q = pair_cross[grp], na = norm[a], nb = norm[b];
                const double* ra = rows + (long)a * D;
                const double* rb = rows + (long)b * D;
                const double dot = kvq_av_half_dot(res, jl < 4 ? ra : rb, lane);
                const double dot_a = __shfl_sync(0xffffffffu, dot, lead), dot_b = __shfl_sync(0xffffffffu, dot, lead + 4);
                const double da = __dadd_rn(__dadd_rn(dot_a, __dmul_rn(sa, na)), __dmul_rn(sb, q));
                const double db = __dadd_rn(__dadd_rn(dot_b, __dmul_rn(sb, nb)), __dmul_rn(sa, q));
                double best = 0.0;
                int choice = 0;   // bit 0: row a on, bit 1: row b on
#pragma unroll
                for (int opt = 1; opt <= 3; ++opt) {   // (on, off), (off, on), (on, on)
                    const double oa = (double)(opt & 1), ob = (double)(opt >> 1);
                    const double cost =
                        __dadd_rn(__dadd_rn(__dadd_rn(__dmul_rn(-2.0, __dadd_rn(__dmul_rn(oa, da), __dmul_rn(ob, db))), __dmul_rn(oa, na)),
                                            __dmul_rn(ob, nb)),
                                  __dmul_rn(__dmul_rn(__dmul_rn(2.0, oa), ob), q));
                    if (cost < best) { best = cost; choice = opt; }
                }
                const int old = (int)(bits & 3);
                __syncwarp();   // the dots have read the residual
                if (active && choice != old) {
                    changed = true;
                    // Row a then row b: add a row leaving the code, subtract one joining it.
                    for (int e = 0; e < 2; ++e) {
                        const int was = old >> e & 1, now = choice >> e & 1;
                        const double* row = e == 0 ? ra : rb;
                        if (was && !now) for (int c = jl; c < D; c += KVQ_AV_LANES) res[c] = __dadd_rn(res[c], row[c]);
                        if (!was && now) for (int c = jl; c < D; c += KVQ_AV_LANES) res[c] = __dsub_rn(res[c], row[c]);
                    }
                    code[a / 32] = (code[a / 32] & ~(3u << (a % 32))) | (kvq_u32)choice << (a % 32);
                }
                __syncwarp();
            }
            active = active && changed;
        }
        // ‖s·C‖: each channel's sum of the code's rows in row order, then the squares in order.
        for (int c = jl; c < D; c += KVQ_AV_LANES) {
            double o = 0.0;
            for (int row = 0; row < ROWS; ++row)
                if (code[row / 32] >> (row % 32) & 1) o = __dadd_rn(o, rows[(long)row * D + c]);
            res[c] = o;
        }
        __syncwarp();
        if (jl == 0 && live) {
            kvq_u16 factor = 0;
            if (coded) {
                double dn2 = -0.0;
                for (int c = 0; c < D; ++c) dn2 = __dadd_rn(dn2, __dmul_rn(res[c], res[c]));
                const double dn = __dsqrt_rn(dn2);
                factor = kvq_f64_to_f16(dn > 0.0 ? __ddiv_rn(unorm, dn) : 0.0);
                if (!kvq_f16_bits_finite(factor)) kvq_cb_flag(status, KVQ_CB_FACTOR_OVERFLOW, 2, tok);
            }
            kvq_u32* words = (kvq_u32*)(block + S::CODES_OFFSET);
#pragma unroll
            for (int w = 0; w < WORDS; ++w) words[w * PAGE + r] = code[w];
            ((kvq_u16*)(block + S::SCALES_OFFSET))[r] = factor;
        }
        __syncwarp();
    }
}

// One side's encoder of page `page`, KV head `kvh` (its tokens the source's rows from src.first), its
// tables t0… in the order kvq_reference::commvq::encoder lists them: RoPE keys (c, ic, norm, cross),
// additive (rows, norm, pair_cross, mean, scale).
template <class S>
static __device__ __forceinline__ void kvq_cb_encode_page(KvqCbRows src, int page, int kvh, int kv_heads, int slot, kvq_u8* pool,
                                                          const kvq_i32* page_table, int max_pages, const double* t0, const double* t1,
                                                          const double* t2, const double* t3, const double* t4, kvq_u32* status) {
    if constexpr (S::KIND == KvqCbKind::Rope) {
        kvq_encode_rope_keys(src, page, kvh, kv_heads, slot, pool, page_table, max_pages, KvqRopeTables{t0, t1, t2, t3}, status);
    } else if constexpr (S::KIND == KvqCbKind::Additive) {
        kvq_encode_additive<S>(src, page, kvh, kv_heads, slot, pool, page_table, max_pages, KvqAdditiveTables{t0, t1, t2, t3, t4},
                               status);
    }
}

// ---------------------------------------------------------------------------------------------
// Chunk launches (a host that knows the sequence's length): grid (pages, kv_heads), page j of the
// launch logical page page0 + j, its tokens the source's rows from first + j·PAGE.
template <class S>
static __device__ __forceinline__ void kvq_cb_encode_pages(KvqCbRows src, int page0, int slot, kvq_u8* pool, const kvq_i32* page_table,
                                                           int max_pages, const double* t0, const double* t1, const double* t2,
                                                           const double* t3, const double* t4, kvq_u32* status) {
    src.first += blockIdx.x * PAGE;
    kvq_cb_encode_page<S>(src, page0 + blockIdx.x, blockIdx.y, gridDim.y, slot, pool, page_table, max_pages, t0, t1, t2, t3, t4,
                          status);
}

// ---------------------------------------------------------------------------------------------
// Engine steps (graph-capturable: lengths read on the device). A step appends one token to each of
// n sequences, sequence i in slot slots[i] (−1: padding), at position seq_lens[slot]; a slot whose
// status holds an unreported error takes nothing until the host has read and cleared it. The
// commit kernel then advances the lengths of the slots that stayed clean.

// Coded pages of a side at `len` tokens (kvq_reference::regions::TokenRegions).
template <class S>
static __device__ __forceinline__ int kvq_cb_coded_pages(int len) {
    const int rest = len - min(len, SINK) - S::LOCAL;
    return rest > 0 ? rest / PAGE : 0;
}

// Whether every thread of the CTA sees slot `slot` usable: a real slot with a clean status.
static __device__ __forceinline__ bool kvq_cb_slot_open(int slot, const kvq_u32* status) {
    return __syncthreads_or(threadIdx.x == 0 && slot >= 0 && status[(long)slot * KVQ_CB_STATUS_WORDS] == 0) != 0;
}

// Grid (n, kv_heads): sequence blockIdx.x's new token, row blockIdx.x of the inputs, every coded
// side's row into its pending ring (the page encoders read it there).
static __device__ __forceinline__ void kvq_cb_step_store(const kvq_u16* k_pre, const kvq_u16* k_post, const kvq_u16* v, const kvq_i32* slots,
                                                         const kvq_i32* seq_lens, kvq_u8* k_pool, kvq_u8* v_pool,
                                                         const kvq_i32* page_table, int max_pages, kvq_u16* k_sink, kvq_u16* v_sink,
                                                         kvq_u16* k_tail, kvq_u16* v_tail, kvq_u16* k_pending, kvq_u16* v_pending,
                                                         kvq_u32* status) {
    const int slot = slots[blockIdx.x];
    if (!kvq_cb_slot_open(slot, status)) return;
    kvq_cb_store_rows(k_pre, k_post, v, blockIdx.x, seq_lens[slot], blockIdx.y, gridDim.y, 0, 0, slot, k_pool, v_pool, page_table,
                      max_pages, k_sink, v_sink, k_tail, v_tail, k_pending, v_pending, status + (long)slot * KVQ_CB_STATUS_WORDS);
}

// Grid (n, kv_heads): the page sequence blockIdx.x's new token closes on side S, if any, coded from
// the slot's pending ring ([slot][kv_head][TAIL_CAP][D]).
template <class S>
static __device__ __forceinline__ void kvq_cb_step_encode(const kvq_u16* pending, const kvq_i32* slots, const kvq_i32* seq_lens,
                                                          kvq_u8* pool, const kvq_i32* page_table, int max_pages, const double* t0,
                                                          const double* t1, const double* t2, const double* t3, const double* t4,
                                                          kvq_u32* status) {
    const int slot = slots[blockIdx.x];
    if (!kvq_cb_slot_open(slot, status)) return;
    const int len = seq_lens[slot], page = kvq_cb_coded_pages<S>(len);
    if (kvq_cb_coded_pages<S>(len + 1) == page) return;
    const int kv_heads = gridDim.y;
    const KvqCbRows src{pending + (long)slot * kv_heads * S::TAIL_CAP * D, D, (long)S::TAIL_CAP * D, (page * PAGE) % S::TAIL_CAP,
                        S::TAIL_CAP};
    kvq_cb_encode_page<S>(src, page, blockIdx.y, kv_heads, slot, pool, page_table, max_pages, t0, t1, t2, t3, t4,
                          status + (long)slot * KVQ_CB_STATUS_WORDS);
}

// Grid (ceil(n / blockDim.x)): seq_lens[slots[i]] += 1 where the slot stayed clean.
static __device__ __forceinline__ void kvq_cb_step_commit(const kvq_i32* slots, int n, kvq_i32* seq_lens, const kvq_u32* status) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int slot = slots[i];
    if (slot >= 0 && status[(long)slot * KVQ_CB_STATUS_WORDS] == 0) seq_lens[slot] += 1;
}

// One thread: `begin` empties slot `slot` (length 0, status clean) before a prompt; otherwise its
// length becomes `len` if its status stayed clean.
static __device__ __forceinline__ void kvq_cb_set_length(int slot, int len, int begin, kvq_i32* seq_lens, kvq_u32* status) {
    kvq_u32* st = status + (long)slot * KVQ_CB_STATUS_WORDS;
    if (begin) {
        for (int w = 0; w < KVQ_CB_STATUS_WORDS; ++w) st[w] = 0;
        seq_lens[slot] = 0;
    } else if (st[0] == 0) {
        seq_lens[slot] = len;
    }
}
