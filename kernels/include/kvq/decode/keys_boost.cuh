#pragma once
// Kitty's boosted channels: their high plane as extra k-steps on the f16 path.
// Declared in every configuration: a template on the plane's words (K_HIGH_WORDS, 0 without a
// boosted plane), instantiated only where K_QUANT && K_BOOST.

// Kitty: the boosted channels' high bits, a 2-bit plane of K_HIGH_WORDS words per token, as extra
// k-steps: slot pairs (r, r+8) and (r+4, r+12) of each word against 4·(q⊙s) of the slots' channels.
template <bool GUARD, int HW = K_HIGH_WORDS>
static __device__ __forceinline__ void kvq_chunk_high_scores(const kvq_u8* high_rows, int n, int g, int r,
    const kvq_u32 (&hh)[HW][2], const kvq_u32 (&hl)[HW][2], float (&sc)[NSUB][4])
{
    const kvq_u32* high = (const kvq_u32*)high_rows;
#pragma unroll
    for (int s = 0; s < NSUB; ++s) {
        if (!GUARD || s * 16 < n) {
            const int ta = kvq_row<GUARD>(s * 16 + g, n), tb = kvq_row<GUARD>(s * 16 + g + 8, n);
#pragma unroll
            for (int w = 0; w < HW; ++w) {
                const kvq_u32 xa = high[ta * HW + w], xb = high[tb * HW + w];
                const kvq_u32 m = 0x00030003u;
                const kvq_u32 a0 = kvq_h2_sub(((xa >> (2 * r)) & m) | KVQ_MAGIC, KVQ_MAGIC);
                const kvq_u32 a1 = kvq_h2_sub(((xb >> (2 * r)) & m) | KVQ_MAGIC, KVQ_MAGIC);
                const kvq_u32 a2 = kvq_h2_sub(((xa >> (2 * r + 8)) & m) | KVQ_MAGIC, KVQ_MAGIC);
                const kvq_u32 a3 = kvq_h2_sub(((xb >> (2 * r + 8)) & m) | KVQ_MAGIC, KVQ_MAGIC);
                kvq_mma(sc[s], a0, a1, a2, a3, hh[w][0], hh[w][1]);
                kvq_mma(sc[s], a0, a1, a2, a3, hl[w][0], hl[w][1]);
            }
        }
    }
}
