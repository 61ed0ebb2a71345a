#pragma once
// The scores of the warpgroup decode (kvq/xquant/decode.cuh with KVQ_XQ_WGMMA) on tensor cores:
// a warp's 16 rows of each KV head's rebuilt K, f32 in the warpgroup MMA's accumulator layout
// after RoPE, times the head's query heads, as mma m16n8k8 on TF32 with f32 sums. On CUDA cores
// a thread spent an FMA a query head and a shared-memory load a query head and pair on each of
// its K values; here it spends two instructions a value, whatever the number of query heads.
//
// The accumulators are the A fragments as they lie: within a block of 8 columns the MMA's k index
// kk stands for column 2kk (kk < 4) or 2(kk − 4) + 1, so a thread's pair (2tq, 2tq + 1) of rows g
// and g + 8 is its registers (tq, tq + 4); the query fragments follow the same order.
//
// Precision: the tensor cores read an operand's top 19 bits, so each side is split in two,
// x = hi + lo with hi = x's top 19 bits and lo = x − hi (exact in f32, of which the top 19 bits are
// read again): K as two A operands, the query as two columns of B (the heads' high parts in
// columns 0–3, their low parts in 4–7; more than four query heads a KV head take a tile each).
// The four products sum to within about 2⁻²⁰ of q·k, f32's precision for the softmax.
static_assert(XQ_WN == 1 && XQ_MT == 1, "a warp holds 16 rows and every column of K");
static constexpr int XQ_SNT = GQA <= 4 ? 1 : 2;                       // n8 tiles of a KV head's query columns
static constexpr int XQ_QFRAG = XQ_KH * XQ_SNT * XQ_NT * 32;          // B fragments: (KV head, tile, k step, lane)
static constexpr kvq_u32 XQ_TF32_MASK = 0xffffe000u;                  // the bits the tensor cores read

// The query heads' B fragments, scaled by `scale`: entry ((kh·XQ_SNT + tile)·XQ_NT + nt)·32 + lane
// holds column n = lane / 4's values at columns 8nt + 2(lane % 4) and + 1 of its head (zero for a
// head past GQA), high or low part by the column's place.
static __device__ __forceinline__ void xq_build_qfrag(const kvq_u16* q, long head_row, float scale, float2* qf) {
    for (int i = threadIdx.x; i < XQ_QFRAG; i += THREADS) {
        const int lane = i % 32, nt = (i / 32) % XQ_NT, tile = (i / (32 * XQ_NT)) % XQ_SNT;
        const int kh = i / (32 * XQ_NT * XQ_SNT), n = lane / 4, tq = lane % 4;
        const bool low = XQ_SNT == 1 ? n >= 4 : tile == 1;
        const int h = XQ_SNT == 1 ? n % 4 : n;
        float v[2] = {0.f, 0.f};
        if (h < GQA) {
            const long at = (head_row + kh * GQA + h) * D + 8 * nt + 2 * tq;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float x = kvq_io_to_f32(q[at + e]) * scale;
                const float hi = __uint_as_float(__float_as_uint(x) & XQ_TF32_MASK);
                v[e] = low ? x - hi : hi;
            }
        }
        qf[i] = make_float2(v[0], v[1]);
    }
}

// The warp's scores into sp[query head][row] (rows 16·gw + g and + 8 of the group's tile).
static __device__ __forceinline__ void xq_scores_tc(const float (&acc)[XQ_KH][XQ_MT][XQ_NT][4], const float2* qf,
                                                    float (*sp)[XQ_M], int gw, int lane) {
    const int g = lane / 4, tq = lane % 4;
#pragma unroll
    for (int kh = 0; kh < XQ_KH; ++kh) {
        // [tile][K's high or low part]: four chains of MMAs, not one.
        float c[XQ_SNT][2][4];
#pragma unroll
        for (int t = 0; t < XQ_SNT; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[t][0][e] = c[t][1][e] = 0.f;
#pragma unroll
        for (int nt = 0; nt < XQ_NT; ++nt) {
            const float(&k)[4] = acc[kh][0][nt];
            // A's registers (g, tq), (g + 8, tq), (g, tq + 4), (g + 8, tq + 4).
            const float a[4] = {k[0], k[2], k[1], k[3]};
            kvq_u32 lo[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) lo[r] = __float_as_uint(a[r] - __uint_as_float(__float_as_uint(a[r]) & XQ_TF32_MASK));
#pragma unroll
            for (int t = 0; t < XQ_SNT; ++t) {
                const float2 b = qf[((kh * XQ_SNT + t) * XQ_NT + nt) * 32 + lane];
                const kvq_u32 b0 = __float_as_uint(b.x), b1 = __float_as_uint(b.y);
                kvq_mma_tf32(c[t][0], __float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]),
                             __float_as_uint(a[3]), b0, b1);
                kvq_mma_tf32(c[t][1], lo[0], lo[1], lo[2], lo[3], b0, b1);
            }
        }
        // Columns 2tq, 2tq + 1 of rows g (s[0], s[1]) and g + 8 (s[2], s[3]).
        float s[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[e] = c[0][0][e] + c[0][1][e];
            if constexpr (XQ_SNT == 2) s[e] += c[1][0][e] + c[1][1][e];
            // One tile: lanes tq ≥ 2 hold the low parts of the heads lanes tq − 2 hold.
            else s[e] += __shfl_down_sync(0xffffffffu, s[e], 2);
        }
        if (XQ_SNT == 2 || tq < 2) {
            const int row = 16 * gw + g;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int h = 2 * tq + e;
                if (h < GQA) {
                    sp[kh * GQA + h][row] = s[e];
                    sp[kh * GQA + h][row + 8] = s[2 + e];
                }
            }
        }
    }
}
