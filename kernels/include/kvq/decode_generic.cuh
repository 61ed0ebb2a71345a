#pragma once
// The generic (CUDA-core) decode kernel and its range pass: shapes and layouts the tensor-core
// kernel does not take. Bodies of the unit's entry points; `if constexpr` on the tensor traits
// (KTensor, VTensor) and CALIBRATE picks each layout's code.
static_assert(HEAD_GROUPS == 1, "the generic kernel scores all of a KV head's query heads in one CTA");
// Scores give each lane CPL = ceil(D / 32) channels, lane·CPL + j; where D is not a multiple of 32
// the last lanes' channels past D are skipped (their query registers hold zeros). An enumerator:
// unlike a static constant it emits no PTX global.
enum : bool { KVQ_GEN_PAST = D % 32 != 0 };
// Whether channel c of a lane's CPL is one of the row's.
static __device__ __forceinline__ bool kvq_gen_channel(int c) { return !KVQ_GEN_PAST || c < D; }
// Where one token of one tensor lives: an f16 row (sink, tail ring or FP16 page) or a row of a
// quantized page block.
struct KvqLoc { int kind; const kvq_u16* f16; const kvq_u8* block; int row; int page; };

template <class T>
static __device__ __forceinline__ KvqLoc kvq_locate(
    int tok, int len, int seq, int kvh, int kv_heads,
    const kvq_u8* pool, const kvq_i32* page_table, int max_pages,
    const kvq_u16* sink, const kvq_u16* tail)
{
    KvqLoc l;
    if constexpr (T::KIND == KvqKind::Fp16) {
        l.kind = KIND_F16_ROW; l.block = 0; l.row = tok % PAGE; l.page = tok / PAGE;
        const long phys = page_table[(long)seq * max_pages + l.page];
        l.f16 = (const kvq_u16*)(pool + (phys * kv_heads + kvh) * (long)T::BLOCK_BYTES) + l.row * D;
    } else {
        const int sink_end = min(SINK, len);
        const int qend = kvq_quant_end(len, sink_end, T::LOCAL);
        if (tok < sink_end) {
            l.kind = KIND_F16_ROW; l.block = 0; l.row = 0; l.page = -1;
            l.f16 = sink + (((long)seq * kv_heads + kvh) * SINK + tok) * D;
        } else if (tok < qend) {
            l.kind = KIND_PAGE; l.f16 = 0;
            l.page = (tok - sink_end) / PAGE; l.row = (tok - sink_end) % PAGE;
            const long phys = page_table[(long)seq * max_pages + l.page];
            l.block = pool + (phys * kv_heads + kvh) * (long)T::BLOCK_BYTES;
        } else {
            l.kind = KIND_F16_ROW; l.block = 0; l.row = 0; l.page = -1;
            const int slot = (tok - sink_end) % T::TAIL_CAP;
            l.f16 = tail + (((long)seq * kv_heads + kvh) * T::TAIL_CAP + slot) * D;
        }
    }
    return l;
}
static __device__ __forceinline__ KvqLoc k_locate(int tok, int len, int seq, int kvh, int kv_heads, const kvq_u8* pool,
    const kvq_i32* page_table, int max_pages, const kvq_u16* sink, const kvq_u16* tail) {
    return kvq_locate<KTensor>(tok, len, seq, kvh, kv_heads, pool, page_table, max_pages, sink, tail);
}
static __device__ __forceinline__ KvqLoc v_locate(int tok, int len, int seq, int kvh, int kv_heads, const kvq_u8* pool,
    const kvq_i32* page_table, int max_pages, const kvq_u16* sink, const kvq_u16* tail) {
    return kvq_locate<VTensor>(tok, len, seq, kvh, kv_heads, pool, page_table, max_pages, sink, tail);
}

// End of the tile starting at t0: tiles never straddle a region or page boundary of K or V, so every
// token of a tile has the same source kind and page.
template <class T>
static __device__ __forceinline__ void kvq_tile_end_of(int t0, int len, int sink_end, int& t1) {
    if constexpr (T::KIND == KvqKind::Fp16) {
        t1 = min(t1, (t0 / PAGE + 1) * PAGE);
    } else {
        const int qend = kvq_quant_end(len, sink_end, T::LOCAL);
        if (t0 < sink_end) t1 = min(t1, sink_end);
        else if (t0 < qend) t1 = min(t1, min(qend, sink_end + ((t0 - sink_end) / PAGE + 1) * PAGE));
    }
}
static __device__ __forceinline__ int kvq_tile_end(int t0, int t_end, int len) {
    int t1 = min(t_end, t0 + TILE);
    const int sink_end = min(SINK, len);
    kvq_tile_end_of<KTensor>(t0, len, sink_end, t1);
    kvq_tile_end_of<VTensor>(t0, len, sink_end, t1);
    return t1;
}

// Scores of the tile's tokens for every query head of this KV head into s_scores[GQA][TILE]
// (natural-log units: q·k / sqrt(D)). Each warp takes whole tokens, each lane CPL channels.
// Channel-axis pages fold the dequantisation into the query: q·k̂ = Σ (q⊙s)·code + q·z.
template <class T = KTensor>
static __device__ __forceinline__ void kvq_tile_scores(
    const KvqLoc& first, int t0, int n, int len, int seq, int kvh, int kv_heads,
    const kvq_u8* k_pool, const kvq_i32* page_table, int max_pages,
    const kvq_u16* k_sink, const kvq_u16* k_tail,
    const float (&qreg)[GQA][CPL], float (&qs)[GQA][CPL], float (&kbias)[GQA], int& folded_page,
    float* s_scores)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    constexpr bool CHANNEL_FOLD = T::KIND == KvqKind::Int && T::AXIS == KvqAxis::Channel;
    if constexpr (CHANNEL_FOLD) {
    if (first.kind == KIND_PAGE && first.page != folded_page) {
        float zsum[GQA];
#pragma unroll
        for (int h = 0; h < GQA; ++h) zsum[h] = 0.f;
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
            const int c = lane * CPL + j;
            if (!kvq_gen_channel(c)) break;
            float s, z;
            k_scale_zero(first.block, 0, c, s, z);
#pragma unroll
            for (int h = 0; h < GQA; ++h) { qs[h][j] = qreg[h][j] * s; zsum[h] += qreg[h][j] * z; }
        }
#pragma unroll
        for (int h = 0; h < GQA; ++h) kbias[h] = kvq_warp_sum(zsum[h]);
        folded_page = first.page;
    }
    }
    for (int i = warp; i < n; i += WARPS) {
        const KvqLoc l = k_locate(t0 + i, len, seq, kvh, kv_heads, k_pool, page_table, max_pages, k_sink, k_tail);
        float part[GQA];
#pragma unroll
        for (int h = 0; h < GQA; ++h) part[h] = 0.f;
        if (l.kind == KIND_F16_ROW) {
#pragma unroll
            for (int j = 0; j < CPL; ++j) {
                if (!kvq_gen_channel(lane * CPL + j)) break;
                const float x = kvq_f16_to_f32(l.f16[lane * CPL + j]);
#pragma unroll
                for (int h = 0; h < GQA; ++h) part[h] += qreg[h][j] * x;
            }
        }
        else if constexpr (T::KIND == KvqKind::Int) {
#pragma unroll
            for (int j = 0; j < CPL; ++j) {
                const int c = lane * CPL + j;
                if (!kvq_gen_channel(c)) break;
                if constexpr (T::AXIS == KvqAxis::Channel) {
                const float code = (float)k_full_code(l.block, l.row, c);
#pragma unroll
                for (int h = 0; h < GQA; ++h) part[h] += qs[h][j] * code;
                } else {
                const float x = k_page_value(l.block, l.row, c);
#pragma unroll
                for (int h = 0; h < GQA; ++h) part[h] += qreg[h][j] * x;
                }
            }
        }
#pragma unroll
        for (int h = 0; h < GQA; ++h) {
            float s = kvq_warp_sum(part[h]);
            if constexpr (CHANNEL_FOLD)
                if (l.kind == KIND_PAGE) s += kbias[h];
            if (lane == 0) s_scores[h * TILE + i] = s;
        }
    }
}

// Loads this KV head's query heads, pre-scaled by 1/sqrt(D), lane-split like the keys.
static __device__ __forceinline__ void kvq_load_queries(const kvq_u16* q, int seq, int kvh, int kv_heads, float (&qreg)[GQA][CPL]) {
    const int lane = threadIdx.x % 32;
    const float scale = rsqrtf((float)D);
#pragma unroll
    for (int h = 0; h < GQA; ++h)
#pragma unroll
        for (int j = 0; j < CPL; ++j)
            qreg[h][j] = kvq_gen_channel(lane * CPL + j)
                ? kvq_io_to_f32(q[(((long)seq * kv_heads + kvh) * GQA + h) * D + lane * CPL + j]) * scale : 0.f;
}

// CalibQuant's calibration needs each query head's score range over quantized keys before the softmax:
// this pass computes it per split, the decode kernel reduces the splits. Grid (range_splits, kv_heads,
// batch): its own split count, which the decode kernel is given. The body of the unit's range
// entry point (calibrated schemes only).
template <int UNUSED = 0>
static __device__ __forceinline__ void kvq_generic_range(
    const kvq_u16* __restrict__ q,
    const kvq_u8* __restrict__ k_pool,
    const kvq_i32* __restrict__ page_table, int max_pages,
    const kvq_u16* __restrict__ k_sink, const kvq_u16* __restrict__ k_tail,
    const kvq_i32* __restrict__ seq_lens, const kvq_i32* __restrict__ seq_slots, int q_len,
    float* __restrict__ score_range, float* __restrict__ scores)   // scores: unused by this kernel
{
    kvq_allow_dependent_launch();   // the decode grid may be scheduled now (it waits for our ranges)
    __shared__ float s_scores[GQA * TILE];
    __shared__ float s_lo[WARPS][GQA], s_hi[WARPS][GQA];
    const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
    const int range_splits = gridDim.x, kv_heads = gridDim.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const KvqSlot at = kvq_seq_slot(seq_slots, seq_lens, seq, q_len);
    const int slot = at.slot, len = at.len, seen = at.seen;
    float qreg[GQA][CPL], qs[GQA][CPL], kbias[GQA];
    int folded_page = -1;
    kvq_load_queries(q, seq, kvh, kv_heads, qreg);
    float lo[GQA], hi[GQA];
#pragma unroll
    for (int h = 0; h < GQA; ++h) { lo[h] = __int_as_float(0x7f800000); hi[h] = KVQ_NEG_INF; }
    int t_begin, t_end;
    kvq_split_range(seen, split, range_splits, t_begin, t_end);
    for (int t0 = t_begin; t0 < t_end;) {
        const int t1 = kvq_tile_end(t0, t_end, len);
        const KvqLoc first = k_locate(t0, len, slot, kvh, kv_heads, k_pool, page_table, max_pages, k_sink, k_tail);
        if (first.kind == KIND_PAGE) {
            kvq_tile_scores(first, t0, t1 - t0, len, slot, kvh, kv_heads, k_pool, page_table, max_pages,
                            k_sink, k_tail, qreg, qs, kbias, folded_page, s_scores);
            __syncthreads();
            for (int h = 0; h < GQA; ++h)
                for (int i = threadIdx.x; i < t1 - t0; i += THREADS) {
                    lo[h] = fminf(lo[h], s_scores[h * TILE + i]);
                    hi[h] = fmaxf(hi[h], s_scores[h * TILE + i]);
                }
            __syncthreads();
        }
        t0 = t1;
    }
#pragma unroll
    for (int h = 0; h < GQA; ++h) {
        const float l = kvq_warp_min(lo[h]), u = kvq_warp_max(hi[h]);
        if (lane == 0) { s_lo[warp][h] = l; s_hi[warp][h] = u; }
    }
    __syncthreads();
    if (threadIdx.x < GQA) {
        const int h = threadIdx.x;
        float l = s_lo[0][h], u = s_hi[0][h];
        for (int w = 1; w < WARPS; ++w) { l = fminf(l, s_lo[w][h]); u = fmaxf(u, s_hi[w][h]); }
        float* out = score_range + ((((long)seq * kv_heads + kvh) * GQA + h) * range_splits + split) * 2;
        out[0] = l; out[1] = u;
    }
}

// Split-K decode: grid (num_splits + num_pieces, kv_heads, batch), block THREADS. Writes, per query
// head and split, the unnormalised output and (m, l) for the combine kernel; a launch of one part
// (one split, no pieces) given `out` also writes the output itself. This kernel does all
// the work in its splits: a piece's CTA (blockIdx.x >= num_splits) marks its partial empty (l = 0),
// which the combine skips, so launches sized for the tensor-core kernel's pieces stay valid. The
// body of the unit's decode entry point.
template <int UNUSED = 0>
static __device__ __forceinline__ void kvq_generic_decode(
    const kvq_u16* __restrict__ q,
    const kvq_u8* __restrict__ k_pool, const kvq_u8* __restrict__ v_pool,
    const kvq_i32* __restrict__ page_table, int max_pages,
    const kvq_u16* __restrict__ k_sink, const kvq_u16* __restrict__ v_sink,
    const kvq_u16* __restrict__ k_tail, const kvq_u16* __restrict__ v_tail,
    const kvq_i32* __restrict__ seq_lens, const kvq_i32* __restrict__ seq_slots, int q_len,
    const float* __restrict__ score_range, const float* __restrict__ scores,   // scores: unused by this kernel
    int range_splits,   // gridDim.x of the range grid: the splits score_range holds per head
    float* __restrict__ part_acc, float* __restrict__ part_ml,
    int num_pieces, int piece_permille,
    kvq_u16* __restrict__ out)
{
    kvq_allow_dependent_launch();   // the combine grid may be scheduled now (it waits for our writes)
    __shared__ float s_scores[GQA * TILE];
    __shared__ float s_m[GQA], s_l[GQA], s_alpha[GQA];
    __shared__ float s_cal_a[CALIBRATE ? GQA : 1], s_cal_b[CALIBRATE ? GQA : 1];
    const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
    const int parts = gridDim.x, num_splits = parts - num_pieces, kv_heads = gridDim.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (split >= num_splits) {
        if (threadIdx.x < GQA) {
            const long at = (((long)seq * kv_heads + kvh) * GQA + threadIdx.x) * parts + split;
            part_ml[at * 2] = KVQ_NEG_INF;
            part_ml[at * 2 + 1] = 0.f;
        }
        return;
    }
    const KvqSlot at = kvq_seq_slot(seq_slots, seq_lens, seq, q_len);
    const int slot = at.slot, len = at.len, seen = at.seen;
    float qreg[GQA][CPL], qs[GQA][CPL], kbias[GQA];
    int folded_page = -1;
    kvq_load_queries(q, seq, kvh, kv_heads, qreg);
    if constexpr (CALIBRATE) kvq_wait_for_previous_grid();   // the range grid may still be running (see launch.rs)
    if (threadIdx.x < GQA) {
        s_m[threadIdx.x] = KVQ_NEG_INF; s_l[threadIdx.x] = 0.f; s_alpha[threadIdx.x] = 1.f;
        if constexpr (CALIBRATE) {
        // g(x) = a·x + b with a = (δ−γ+τ1−τ2)/(δ−γ), b = γ − τ1 − a·γ over the head's range [γ, δ].
        const int h = threadIdx.x;
        const float* r = score_range + (((long)seq * kv_heads + kvh) * GQA + h) * range_splits * 2;
        float lo = __int_as_float(0x7f800000), hi = KVQ_NEG_INF;
        for (int s = 0; s < range_splits; ++s) { lo = fminf(lo, r[2 * s]); hi = fmaxf(hi, r[2 * s + 1]); }
        const float tau1 = KVQ_TAU1, tau2 = KVQ_TAU2;
        float a = 1.f;
        if (hi - lo > 0.f) a = (hi - lo + tau1 - tau2) / (hi - lo);
        s_cal_a[h] = a;
        s_cal_b[h] = lo - tau1 - a * lo;
        }
    }
    // P·V ownership: thread -> (token group, channels).
    const int tgroup = threadIdx.x / (D < THREADS ? D : THREADS);
    const int c0 = threadIdx.x % (D < THREADS ? D : THREADS);
    const bool pv_active = tgroup < TGROUPS;
    float acc[GQA][CPT];
#pragma unroll
    for (int h = 0; h < GQA; ++h)
#pragma unroll
        for (int j = 0; j < CPT; ++j) acc[h][j] = 0.f;
    __syncthreads();

    int t_begin, t_end;
    kvq_split_range(seen, split, num_splits, t_begin, t_end);
    for (int t0 = t_begin; t0 < t_end;) {
        const int t1 = kvq_tile_end(t0, t_end, len);
        const int n = t1 - t0;
        const KvqLoc kfirst = k_locate(t0, len, slot, kvh, kv_heads, k_pool, page_table, max_pages, k_sink, k_tail);
        kvq_tile_scores(kfirst, t0, n, len, slot, kvh, kv_heads, k_pool, page_table, max_pages,
                        k_sink, k_tail, qreg, qs, kbias, folded_page, s_scores);
        __syncthreads();
        // Online softmax: warp h' handles heads h' , h' + WARPS, ...
        for (int h = warp; h < GQA; h += WARPS) {
            float mx = KVQ_NEG_INF;
            for (int i = lane; i < n; i += 32) {
                float s = s_scores[h * TILE + i];
                if constexpr (CALIBRATE)
                if (kfirst.kind == KIND_PAGE) { s = s_cal_a[h] * s + s_cal_b[h]; s_scores[h * TILE + i] = s; }
                mx = fmaxf(mx, s);
            }
            mx = kvq_warp_max(mx);
            const float m_old = s_m[h];
            const float m_new = fmaxf(m_old, mx);
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
        if (pv_active) {
#pragma unroll
            for (int h = 0; h < GQA; ++h) {
                const float a = s_alpha[h];
#pragma unroll
                for (int j = 0; j < CPT; ++j) acc[h][j] *= a;
            }
            for (int i = tgroup; i < n; i += TGROUPS) {
                const KvqLoc l = v_locate(t0 + i, len, slot, kvh, kv_heads, v_pool, page_table, max_pages, v_sink, v_tail);
#pragma unroll
                for (int j = 0; j < CPT; ++j) {
                    const int c = c0 + j * THREADS;
                    if (c < D) {
                        float x;
                        if (l.kind == KIND_F16_ROW) x = kvq_f16_to_f32(l.f16[c]);
                        else if constexpr (VTensor::KIND == KvqKind::Int) x = v_page_value(l.block, l.row, c);
                        else x = 0.f;
#pragma unroll
                        for (int h = 0; h < GQA; ++h) acc[h][j] += s_scores[h * TILE + i] * x;
                    }
                }
            }
        }
        __syncthreads();
        t0 = t1;
    }

    // Reduce the token groups (when D < THREADS) through shared memory, then write the partials
    // (and with one part, the output: s_l holds the final denominators since the loop's last sync).
    __shared__ float s_red[TGROUPS > 1 ? TGROUPS * GQA * D : 1];
    const long head0 = ((long)seq * kv_heads + kvh) * GQA;
    const bool direct = parts == 1 && out != nullptr;
    if (TGROUPS > 1) {
        if (pv_active)
#pragma unroll
            for (int h = 0; h < GQA; ++h) s_red[(tgroup * GQA + h) * D + c0] = acc[h][0];
        __syncthreads();
        for (int i = threadIdx.x; i < GQA * D; i += THREADS) {
            float sum = 0.f;
            for (int g = 0; g < TGROUPS; ++g) sum += s_red[g * GQA * D + i];
            const int h = i / D, c = i % D;
            part_acc[((head0 + h) * parts + split) * D + c] = sum;
            if (direct) out[(head0 + h) * D + c] = kvq_output_value(sum, s_l[h]);
        }
    } else if (pv_active) {
#pragma unroll
        for (int h = 0; h < GQA; ++h)
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                const int c = c0 + j * THREADS;
                if (c < D) {
                    part_acc[((head0 + h) * parts + split) * D + c] = acc[h][j];
                    if (direct) out[(head0 + h) * D + c] = kvq_output_value(acc[h][j], s_l[h]);
                }
            }
    }
    if (threadIdx.x < GQA) {
        const int h = threadIdx.x;
        part_ml[((head0 + h) * parts + split) * 2] = s_m[h];
        part_ml[((head0 + h) * parts + split) * 2 + 1] = s_l[h];
    }
}
