#pragma once
// Split-K decode attention over an XQuant latent cache (docs/CODEBOOKS.md §3): the cache holds
// the layer input's latents X·down_k and X·down_v in the integer store of docs/LAYOUT.md (one
// "head" of R channels: KTensor per channel, VTensor per token, FP16 sink and tail rows of
// latents), and the kernel rebuilds K = RoPE(L̂_k·up_k) per tile of tokens for its KV head,
// scores the KV head's GQA query heads against it, and never rebuilds V: it accumulates
// Σ_t p_t·l̂_v,t over the latent and multiplies by up_v once per split. Grid (num_splits, kv_heads,
// rows), block THREADS; writes each split's unnormalised output and (m, l) for kvq/combine.cuh.
//
// K is rebuilt on tensor cores (mma m16n8k16, the tile's 16 tokens as M, the KV head's columns
// over the warps) in three passes of split f16 operands, x = hi + lo for the latents and for up_k:
// hi·hi + hi·lo + lo·hi keeps the product to about f32's precision, three times the one-pass
// cost (CODEBOOKS.md §3.1 on the floor and the one-pass option).
//
// The including unit defines (kvq/common.cuh, kvq/io.cuh, kvq/tensor.cuh and kvq/decode_common.cuh
// first): IO, D (head_dim of K, V and the queries), XR (the latent width R: the cached tensors'
// rows), GQA, THREADS, TILE, PAGE, SINK, and KTensor, VTensor (kvq/tensor.cuh's traits at width R).
static_assert(D % 2 == 0 && D <= 256, "head_dim: even, at most 256");
static_assert(GQA * TILE <= THREADS, "a thread a (query head, token) score");
static_assert(GQA <= TILE, "the split's latent sums reuse the tile's latent buffer");
static_assert(TILE == 16 && THREADS == 128, "K's rebuild: the tile is an mma's 16 rows, four warps");
static_assert(D % 32 == 0 && XR % 16 == 0, "K's rebuild: 8-column tiles over four warps, k-steps of 16");
static constexpr int XQ_NT = D / 32;   // 8-column mma tiles a warp rebuilds
static constexpr int R = XR;
static constexpr int HD = D;
static constexpr int XQ_RPT = (R + THREADS - 1) / THREADS;   // latent channels a thread accumulates

// Where a token's latent row lives: an f16 row (sink or tail ring) or row `row` of a page block.
struct XqLoc { bool page; const kvq_u16* f16; const kvq_u8* block; int row; };

template <class T>
static __device__ __forceinline__ XqLoc xq_locate(int tok, int len, int slot, const kvq_u8* pool, const kvq_i32* page_table,
                                                  int max_pages, const kvq_u16* sink, const kvq_u16* tail) {
    const int sink_end = min(SINK, len);
    const int rest = len - sink_end - T::LOCAL;
    const int qend = sink_end + (rest > 0 ? rest / PAGE : 0) * PAGE;
    XqLoc l{false, nullptr, nullptr, 0};
    if (tok < sink_end) {
        l.f16 = sink + ((long)slot * SINK + tok) * R;
    } else if (tok < qend) {
        l.page = true;
        l.row = (tok - sink_end) % PAGE;
        l.block = pool + (long)page_table[(long)slot * max_pages + (tok - sink_end) / PAGE] * T::BLOCK_BYTES;
    } else {
        l.f16 = tail + ((long)slot * T::TAIL_CAP + (tok - sink_end) % T::TAIL_CAP) * R;
    }
    return l;
}

template <class T>
static __device__ __forceinline__ float xq_latent(const XqLoc& l, int c) {
    return l.page ? kvq_page_value<T>(l.block, l.row, c) : kvq_f16_to_f32(l.f16[c]);
}

// x as f16 bits rounded to nearest, and the f16 bits of what that rounding left.
static __device__ __forceinline__ void xq_split(float x, kvq_u32& hi, kvq_u32& lo) {
    const kvq_u16 h = kvq_f32_to_f16(x);
    hi = h;
    lo = kvq_f32_to_f16(x - kvq_f16_to_f32(h));
}

static __device__ __forceinline__ void xq_mma(float (&c)[4], kvq_u32 a0, kvq_u32 a1, kvq_u32 a2, kvq_u32 a3, kvq_u32 b0,
                                              kvq_u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 { %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The A fragment of rows (g, g + 8) at columns k, k + 1 of the tile's latents, as hi and lo f16x2.
static __device__ __forceinline__ void xq_a_pair(const float* lat, int row, int k, kvq_u32& hi, kvq_u32& lo) {
    kvq_u32 h0, l0, h1, l1;
    xq_split(lat[row * XR + k], h0, l0);
    xq_split(lat[row * XR + k + 1], h1, l1);
    hi = h0 | (h1 << 16);
    lo = l0 | (l1 << 16);
}

// K = L̂·up_k for the tile (rows past n are zero latents), into s_k [TILE][D]: warp w rebuilds
// columns [w·D/4, (w+1)·D/4). up_hi and up_lo are up_kᵀ split in f16, [kv_heads·D][XR].
static __device__ __forceinline__ void xq_rebuild_k(const float* lat, const kvq_u16* up_hi, const kvq_u16* up_lo, int kvh,
                                                    float* s_k) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    float c[XQ_NT][4];
#pragma unroll
    for (int nt = 0; nt < XQ_NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
    const long col0 = (long)kvh * D + warp * (D / 4);
    for (int kk = 0; kk < XR; kk += 16) {
        kvq_u32 ah[4], al[4];
        xq_a_pair(lat, g, kk + 2 * tq, ah[0], al[0]);
        xq_a_pair(lat, g + 8, kk + 2 * tq, ah[1], al[1]);
        xq_a_pair(lat, g, kk + 2 * tq + 8, ah[2], al[2]);
        xq_a_pair(lat, g + 8, kk + 2 * tq + 8, ah[3], al[3]);
#pragma unroll
        for (int nt = 0; nt < XQ_NT; ++nt) {
            const long at = (col0 + nt * 8 + g) * XR + kk + 2 * tq;
            const kvq_u32 bh0 = *(const kvq_u32*)(up_hi + at), bh1 = *(const kvq_u32*)(up_hi + at + 8);
            const kvq_u32 bl0 = *(const kvq_u32*)(up_lo + at), bl1 = *(const kvq_u32*)(up_lo + at + 8);
            xq_mma(c[nt], al[0], al[1], al[2], al[3], bh0, bh1);
            xq_mma(c[nt], ah[0], ah[1], ah[2], ah[3], bl0, bl1);
            xq_mma(c[nt], ah[0], ah[1], ah[2], ah[3], bh0, bh1);
        }
    }
#pragma unroll
    for (int nt = 0; nt < XQ_NT; ++nt) {
        const int j = warp * (D / 4) + nt * 8 + 2 * tq;
        s_k[g * D + j] = c[nt][0];
        s_k[g * D + j + 1] = c[nt][1];
        s_k[(g + 8) * D + j] = c[nt][2];
        s_k[(g + 8) * D + j + 1] = c[nt][3];
    }
}

// End of the tile starting at t0: within one region and page of both tensors.
template <class T>
static __device__ __forceinline__ int xq_tile_end(int t0, int t1, int len) {
    const int sink_end = min(SINK, len);
    if (t0 < sink_end) return min(t1, sink_end);
    const int rest = len - sink_end - T::LOCAL;
    const int qend = sink_end + (rest > 0 ? rest / PAGE : 0) * PAGE;
    if (t0 < qend) return min(t1, min(qend, sink_end + ((t0 - sink_end) / PAGE + 1) * PAGE));
    return t1;
}

static __device__ __forceinline__ void kvq_xquant_decode(
    const kvq_u16* __restrict__ q, const kvq_u8* __restrict__ k_pool, const kvq_u8* __restrict__ v_pool,
    const kvq_i32* __restrict__ page_table, int max_pages, const kvq_u16* __restrict__ k_sink,
    const kvq_u16* __restrict__ v_sink, const kvq_u16* __restrict__ k_tail, const kvq_u16* __restrict__ v_tail,
    const kvq_i32* __restrict__ seq_lens, const kvq_i32* __restrict__ seq_slots, const kvq_u16* __restrict__ up_k_hi,
    const kvq_u16* __restrict__ up_k_lo, const float* __restrict__ up_v, const double* __restrict__ rope_freq, float* __restrict__ part_acc,
    float* __restrict__ part_ml)
{
    extern __shared__ __align__(16) float xq_smem[];
    float* s_lat = xq_smem;                 // [TILE][R]: a tile's K latents, then the split's Σ p·l̂_v
    __shared__ float s_q[GQA * HD], s_k[TILE * HD], s_scores[GQA * TILE];
    __shared__ float s_m[GQA], s_l[GQA], s_alpha[GQA];
    const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
    const int num_splits = gridDim.x, kv_heads = gridDim.y, OUT = kv_heads * HD;
    const KvqSlot at = kvq_seq_slot(seq_slots, seq_lens, seq, 1);
    const int slot = at.slot, len = at.len;
    const long head_row = ((long)seq * kv_heads + kvh) * GQA;
    const float scale = rsqrtf((float)HD);
    for (int i = threadIdx.x; i < GQA * HD; i += THREADS) s_q[i] = kvq_io_to_f32(q[head_row * HD + i]) * scale;
    if (threadIdx.x < GQA) { s_m[threadIdx.x] = KVQ_NEG_INF; s_l[threadIdx.x] = 0.f; }
    float acc[GQA][XQ_RPT];
#pragma unroll
    for (int g = 0; g < GQA; ++g)
#pragma unroll
        for (int j = 0; j < XQ_RPT; ++j) acc[g][j] = 0.f;
    __syncthreads();

    int t_begin, t_end;
    kvq_split_range(len, split, num_splits, t_begin, t_end);
    for (int t0 = t_begin; t0 < t_end;) {
        const int t1 = min(xq_tile_end<KTensor>(t0, min(t_end, t0 + TILE), len),
                           xq_tile_end<VTensor>(t0, min(t_end, t0 + TILE), len));
        const int n = t1 - t0;
        // 1. The tile's K latents, dequantized as the reference does (rows past n zero).
        const XqLoc k0 = xq_locate<KTensor>(t0, len, slot, k_pool, page_table, max_pages, k_sink, k_tail);
        for (int i = threadIdx.x; i < TILE * R; i += THREADS) {
            const int t = i / R, c = i % R;
            float x = 0.f;
            if (t < n) {
                XqLoc l = k0;
                if (l.page) l.row += t;
                else l = xq_locate<KTensor>(t0 + t, len, slot, k_pool, page_table, max_pages, k_sink, k_tail);
                x = xq_latent<KTensor>(l, c);
            }
            s_lat[t * R + c] = x;
        }
        __syncthreads();
        // 2. K = L̂_k·up_k for this KV head's columns on tensor cores, then RoPE at each token's
        //    position.
        xq_rebuild_k(s_lat, up_k_hi, up_k_lo, kvh, s_k);
        __syncthreads();
        for (int i = threadIdx.x; i < n * (HD / 2); i += THREADS) {
            const int t = i / (HD / 2), j = i % (HD / 2);
            double sn, cs;
            sincos((double)(t0 + t) * rope_freq[j], &sn, &cs);
            const double a = s_k[t * HD + j], b = s_k[t * HD + j + HD / 2];
            s_k[t * HD + j] = (float)(a * cs - b * sn);
            s_k[t * HD + j + HD / 2] = (float)(a * sn + b * cs);
        }
        __syncthreads();
        // 3. Scores: a thread a (query head, token).
        if (threadIdx.x < GQA * n) {
            const int g = threadIdx.x / n, t = threadIdx.x % n;
            float s = 0.f;
            for (int j = 0; j < HD; ++j) s = fmaf(s_q[g * HD + j], s_k[t * HD + j], s);
            s_scores[g * TILE + t] = s;
        }
        __syncthreads();
        // 4. Online softmax, a warp a query head.
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        for (int g = warp; g < GQA; g += THREADS / 32) {
            float mx = KVQ_NEG_INF;
            for (int t = lane; t < n; t += 32) mx = fmaxf(mx, s_scores[g * TILE + t]);
            mx = kvq_warp_max(mx);
            const float m_old = s_m[g], m_new = fmaxf(m_old, mx);
            float sum = 0.f;
            for (int t = lane; t < n; t += 32) {
                const float p = expf(s_scores[g * TILE + t] - m_new);
                s_scores[g * TILE + t] = p;
                sum += p;
            }
            sum = kvq_warp_sum(sum);
            if (lane == 0) {
                const float alpha = m_old == KVQ_NEG_INF ? 0.f : expf(m_old - m_new);
                s_alpha[g] = alpha;
                s_l[g] = s_l[g] * alpha + sum;
                s_m[g] = m_new;
            }
        }
        __syncthreads();
        // 5. Σ p·l̂_v over the latent: a thread owns channels threadIdx.x + THREADS·j.
        const XqLoc v0 = xq_locate<VTensor>(t0, len, slot, v_pool, page_table, max_pages, v_sink, v_tail);
#pragma unroll
        for (int g = 0; g < GQA; ++g)
#pragma unroll
            for (int j = 0; j < XQ_RPT; ++j) acc[g][j] *= s_alpha[g];
        for (int t = 0; t < n; ++t) {
            XqLoc l = v0;
            if (l.page) l.row += t;
            else l = xq_locate<VTensor>(t0 + t, len, slot, v_pool, page_table, max_pages, v_sink, v_tail);
#pragma unroll
            for (int j = 0; j < XQ_RPT; ++j) {
                const int c = threadIdx.x + THREADS * j;
                if (c < R) {
                    const float x = xq_latent<VTensor>(l, c);
#pragma unroll
                    for (int g = 0; g < GQA; ++g) acc[g][j] = fmaf(s_scores[g * TILE + t], x, acc[g][j]);
                }
            }
        }
        __syncthreads();
        t0 = t1;
    }
    // The split's output: (Σ p·l̂_v)·up_v for this KV head's columns.
#pragma unroll
    for (int j = 0; j < XQ_RPT; ++j) {
        const int c = threadIdx.x + THREADS * j;
        if (c < R)
#pragma unroll
            for (int g = 0; g < GQA; ++g) s_lat[g * R + c] = acc[g][j];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < GQA * HD; i += THREADS) {
        const int g = i / HD, j = i % HD;
        const float* w = up_v + kvh * HD + j;
        float sum = 0.f;
        for (int c = 0; c < R; ++c) sum = fmaf(s_lat[g * R + c], w[(long)c * OUT], sum);
        part_acc[((head_row + g) * num_splits + split) * HD + j] = sum;
    }
    if (threadIdx.x < GQA) {
        const int g = threadIdx.x;
        part_ml[((head_row + g) * num_splits + split) * 2] = s_m[g];
        part_ml[((head_row + g) * num_splits + split) * 2 + 1] = s_l[g];
    }
}
