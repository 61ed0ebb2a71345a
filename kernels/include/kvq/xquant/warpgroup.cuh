#pragma once
// K's rebuild on Hopper's warpgroup MMAs (kvq/xquant/decode.cuh with KVQ_XQ_WGMMA): two producer
// warpgroups fill an XQ_STAGES-deep ring of shared-memory stages, a chunk of XQ_KC latent
// channels each (the tile's latents decoded to f16 by ordinary stores, up_k's chunk by one bulk
// copy), and two consumer warpgroups multiply them, 64 of the tile's rows each, into registers.
// Each stage has two mbarriers: `full` completes when the producers' stores are in and the copy
// has landed (XQ_PRODUCERS + 1 arrivals, the copy's bytes), `empty` when the eight consumer
// warps' MMAs that read it have finished.
//
// Both operands are K-major without swizzling: 8 × 8 f16 core matrices of 128 contiguous bytes;
// a stage's A holds [K group of 8 channels][XQ_M rows][8] and its B [K group][D columns][8], the
// layout `up_k_groups` has in global memory ([KV head][R / 8][D][8]), so a chunk is one run of
// bytes there.
static constexpr int XQ_A_KG = XQ_M * 16;
static constexpr int XQ_B_KG = D * 16;
static constexpr int XQ_KG = XQ_KC / 8;                                        // K groups a chunk
static constexpr int XQ_WG_A_BYTES = XQ_KG * XQ_A_KG;
static constexpr int XQ_WG_STAGE_BYTES = XQ_WG_A_BYTES + XQ_KG * XQ_B_KG;
// Registers a thread: the producers' loads and addresses need few, the consumers hold the
// 64 × D accumulators and the softmax. An increase waits until the registers are free, so the
// two together stay below the file's 65,536 (at exactly 65,536 the decode hung).
static constexpr int XQ_PRODUCER_REGS = 56, XQ_CONSUMER_REGS = 192;
static_assert(XQ_PRODUCERS * XQ_PRODUCER_REGS + XQ_CT * XQ_CONSUMER_REGS <= 65536, "one CTA's registers");
static_assert(XQ_M == 128 && XQ_PRODUCERS == 256, "two consumer warpgroups of 64 rows, two producer warpgroups");
static_assert(D % 32 == 0 && D <= 128, "one m64nDk16 MMA a K step (N = D)");
static_assert(XQ_APT * 4 == XQ_KC, "a producer warp decodes a quarter of each chunk's channels");

// up_k's chunk [c0, c0 + XQ_KC) of KV head kvh's D columns (up_k_groups) into stage B at `b_u32`:
// one bulk copy whose bytes `full` waits for (the calling producer's arrival too).
static __device__ __forceinline__ void xq_wg_copy_b(const kvq_u16* up_k_groups, int kvh, int c0, unsigned b_u32,
                                                    unsigned full) {
    constexpr unsigned BYTES = XQ_KG * XQ_B_KG;
    kvq_mbar_arrive_expect_tx(full, BYTES);
    kvq_bulk_copy_g2s(b_u32, up_k_groups + ((long)kvh * (XR / 8) + c0 / 8) * D * 8, BYTES, full);
}

// acc += the stage's A rows [64·wg, 64·wg + 64) · B, XQ_KC / 16 MMAs of K = 16, issued (not waited).
static __device__ __forceinline__ void xq_wg_mma_chunk(float (&acc)[XQ_MT][XQ_NT][4], unsigned stage_u32, int wg) {
    const unsigned a = stage_u32 + wg * 64 * 16, b = stage_u32 + XQ_WG_A_BYTES;
#pragma unroll
    for (int ks = 0; ks < XQ_KC / 16; ++ks)
        kvq_wgmma_f16<D>(&acc[0][0][0], kvq_wgmma_desc(a + 2 * ks * XQ_A_KG, XQ_A_KG, 128),
                         kvq_wgmma_desc(b + 2 * ks * XQ_B_KG, XQ_B_KG, 128));
}
