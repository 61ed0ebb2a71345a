#pragma once
// Scores of FP16 rows inside a quantized scheme (sink, tail window): the rare, register-lean path.

// FP16 rows in a quantized scheme (sink, tail ring: a few chunks per sequence): scores with loads
// of one k-step at a time and the query straight from memory, so this rare path does not raise the
// register budget of the whole kernel.
static __device__ __forceinline__ void kvq_chunk_scores_lean(const kvq_u8* rows, int n, int g, int r,
    const kvq_u16* q, long head_row, float (&sc)[NSUB][4])
{
    const int head = kvq_col_head(g);
    const kvq_u32* qw = (const kvq_u32*)(q + (head_row + min(head, GQA - 1)) * D + r * (D / 4));
#pragma unroll
    for (int s = 0; s < NSUB; ++s) {
        if (s * 16 < n) {
            const uint2* ra = (const uint2*)(rows + (long)min(s * 16 + g, n - 1) * D * 2 + r * (D / 2));
            const uint2* rb = (const uint2*)(rows + (long)min(s * 16 + g + 8, n - 1) * D * 2 + r * (D / 2));
            // The subtile's rows are loaded before the first mma: one memory round trip per subtile.
            uint2 a[D / 16], b[D / 16];
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) { a[kk] = ra[kk]; b[kk] = rb[kk]; }
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint2 qq = *(const uint2*)(qw + 2 * kk);
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
