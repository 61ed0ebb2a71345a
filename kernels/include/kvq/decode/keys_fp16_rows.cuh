#pragma once
// Scores of FP16 rows inside a quantized scheme (sink, tail window): the rare, register-lean path.

// FP16 rows in a quantized scheme (sink, tail ring: a few chunks per sequence): scores with loads
// of one k-step at a time and the query straight from memory, so this rare path does not raise the
// register budget of the whole kernel.
static __device__ __forceinline__ void kvq_chunk_scores_lean(const kvq_u8* rows, int n, int g, int r,
    const kvq_u16* q, long head_row, float (&sc)[NSUB][4])
{
    const int head = kvq_col_head(g);
    const kvq_u16* const qrow = q + (head_row + min(head, GQA - 1)) * D;
    const kvq_u32* qw = (const kvq_u32*)(qrow + r * (D / 4));
#pragma unroll
    for (int s = 0; s < NSUB; ++s) {
        if (s * 16 < n) {
            const kvq_u8* const row_a = rows + (long)min(s * 16 + g, n - 1) * D * 2;
            const kvq_u8* const row_b = rows + (long)min(s * 16 + g + 8, n - 1) * D * 2;
            const uint2* ra = (const uint2*)(row_a + r * (D / 2));
            const uint2* rb = (const uint2*)(row_b + r * (D / 2));
            // The subtile's rows are loaded before the first mma: one memory round trip per subtile.
            // K-step kk takes block-order channels 4kk .. 4kk + 3, four channels of one slab's share.
            uint2 a[DVK / 16], b[DVK / 16];
#pragma unroll
            for (int kk = 0; kk < DVK / 16; ++kk) {
                if constexpr (KVQ_K_ONE_SLAB) {
                    a[kk] = ra[kk]; b[kk] = rb[kk];
                } else {
                    const int c = kvq_share_channel<4>(4 * kk, r);
                    const bool in_row = c < D;
                    a[kk] = in_row ? *(const uint2*)(row_a + 2 * c) : make_uint2(0u, 0u);
                    b[kk] = in_row ? *(const uint2*)(row_b + 2 * c) : make_uint2(0u, 0u);
                }
            }
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < DVK / 16; ++kk) {
                uint2 qq;
                if constexpr (KVQ_K_ONE_SLAB) {
                    qq = *(const uint2*)(qw + 2 * kk);
                } else {
                    const int ch = kvq_share_channel<4>(4 * kk, r);
                    qq = ch < D ? *(const uint2*)(qrow + ch) : make_uint2(0u, 0u);
                }
                if constexpr (IO == KvqDtype::Bf16) {
                qq.x = kvq_h2_pack(__uint_as_float(qq.x << 16), __uint_as_float(qq.x & 0xffff0000u));
                qq.y = kvq_h2_pack(__uint_as_float(qq.y << 16), __uint_as_float(qq.y & 0xffff0000u));
                }
                if (head >= GQA) { qq.x = 0u; qq.y = 0u; }
                kvq_mma(c, a[kk].x, b[kk].x, a[kk].y, b[kk].y, qq.x, qq.y);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) sc[s][i] = c[i];
        }
    }
}
