#pragma once
// K's rebuild on Hopper's warpgroup MMAs (kvq/xquant/decode.cuh with KVQ_XQ_WGMMA). The latents
// are the MMA's A operand in registers: each consumer thread decodes its own fragment of a
// chunk (two rows, four K pairs a K step) from the codes straight into f16 pairs, while the
// previous chunk's MMAs run, so no shared-memory stage, fence or barrier sits between the
// decoding and the tensor cores. One producer thread streams up_k's chunks (the B operand) by
// bulk copies into an XQ_STAGES-deep ring; each stage has a `full` mbarrier (the copy's bytes)
// and an `empty` one (the eight consumer warps' MMAs that read it have finished).
//
// A K pair of a fragment register is two channels of one code word, c and c + XQ_PD, whose codes
// lie 16 bits apart: one shift and one mask put both in place. So the MMA's K order within a
// block of 16 channels is a permutation of the channels (xq_pair_channel), which `up_k_groups`
// (kvq-runtime's XQuantWeights) follows: B is K-major without swizzling, 8 × 8 core matrices of
// 128 contiguous bytes, a stage holding [KV head][K group of 8 slots][D columns][8]: a KV head's
// part is one bulk copy, and each K step issues one m64nDk16 MMA a KV head on the same A.
static constexpr int XQ_B_KG = D * 16;                                         // bytes a K group of B
static constexpr int XQ_KG = XQ_KC / 8;                                        // K groups a chunk
static constexpr int XQ_WG_HEAD_BYTES = XQ_KG * XQ_B_KG;                        // a KV head's part of a stage
static constexpr int XQ_WG_STAGE_BYTES = XQ_KH * XQ_WG_HEAD_BYTES;
static constexpr int XQ_KS = XQ_KC / 16;                                       // K steps a chunk
// Registers a thread: the producer warpgroup copies and sets up passes, the consumers hold the
// 64 × D accumulators of each KV head, two chunks of A fragments, up to four chunks of codes in
// flight and the softmax. An increase waits until the registers are free, and the CTA holds only what
// it launched with (each thread at the __launch_bounds__ cap, 168 at 384 threads): asking for
// more hangs the compute warps.
static constexpr int XQ_PRODUCER_REGS = 24, XQ_CONSUMER_REGS = 240;
static_assert(XQ_PRODUCERS * XQ_PRODUCER_REGS + XQ_CT * XQ_CONSUMER_REGS <= THREADS * (65536 / THREADS / 8 * 8),
              "one CTA's registers, as launched");
static_assert(XQ_M == 64 && XQ_GROUPS == 2 && XQ_PRODUCERS == 128,
              "two consumer warpgroups, each its own tiles of 64 rows; one producer warpgroup");

// The ring across passes (kvq/xquant/decode.cuh: pass p is group p % 2's tile of XQ_M rows): the
// passes' chunks go through the stages in order, each pass streaming all of up_k's slice. Two
// other designs read up_k once a 128-row tile and were slower: passes walking the chunks forward
// and backward in turn, each starting on the chunks the one before left in the stages (its later
// loads then wait for the pass before to finish), and both groups sharing each tile and its tail
// (docs/CODEBOOKS.md §3.1).
// The stage of pass p's chunk kc, and which of that stage's loads (from 0) holds it.
// Unsigned, so where the stages divide the chunks a pass the compiler sees the stage of an
// unrolled chunk is a constant.
static __device__ __forceinline__ int xq_wg_stage(int p, int kc) { return (int)(((unsigned)p * XQ_CHUNKS + kc) % XQ_STAGES); }
static __device__ __forceinline__ int xq_wg_load_index(int p, int kc) { return (int)(((unsigned)p * XQ_CHUNKS + kc) / XQ_STAGES); }
static_assert(D % 32 == 0 && D <= 128, "one m64nDk16 MMA a K step (N = D)");
static_assert(KTensor::AXIS == KvqAxis::Channel && (KTensor::BITS >= 2 && KTensor::BITS <= 4),
              "register fragments decode 2- to 4-bit channel-axis latents (kvq-codegen's warpgroup refusal)");

// Bits of the plane whose words hold the K pairs (3-bit codes: the 2-bit low plane), channels a
// word, and the distance between a pair's channels (16 bits apart in the word).
static constexpr int XQ_PB = KTensor::BITS == 3 ? 2 : KTensor::BITS;
static constexpr int XQ_PW = 32 / XQ_PB;
static constexpr int XQ_PD = 16 / XQ_PB;
// Channel (within its block of 16) of pair q's first latent; the second is XQ_PD further.
static __device__ __forceinline__ constexpr int xq_pair_channel(int q) { return (q / XQ_PD) * XQ_PW + q % XQ_PD; }
// Words of a row's chunk of codes: the (low) plane's, then 3-bit codes' high plane.
static constexpr int XQ_LOW_WORDS = XQ_KC * XQ_PB / 32;
static constexpr int XQ_HIGH_WORDS = KTensor::BITS == 3 ? XQ_KC / 32 : 0;
struct XqRowCodes { kvq_u32 w[XQ_LOW_WORDS + XQ_HIGH_WORDS]; };
// Chunks of codes a thread holds in registers: the decode of chunk kc + 1 frees its buffer for
// chunk kc + 1 + XQ_CODE_BUFS. Four where a pass has eight chunks or more; two in shorter passes,
// whose chunk loop would otherwise unroll whole.
static constexpr int XQ_CODE_BUFS = XQ_CHUNKS >= 8 ? 4 : 2;
// A chunk's A fragments: K step s, registers (row g, pair 2tq), (g + 8, 2tq), (g, 2tq + 1), (g + 8, 2tq + 1).
using XqFrag = kvq_u32[XQ_KS][4];

// The page's scale and zero pairs in fragment order, for tiles of one page (built per tile):
// [block of 16 channels][tq][scale pair 2tq, scale pair 2tq + 1, zero pair 2tq, zero pair 2tq + 1].
static constexpr int XQ_KTAB_BYTES = XR / 16 * 4 * 16;

// up_k's chunk [c0, c0 + XQ_KC) of KV heads kvh, …, kvh + XQ_KH − 1 (their D columns each,
// up_k_groups) into stage B at `b_u32`: a bulk copy a KV head, whose bytes `full` waits for (the
// calling producer's arrival too).
static __device__ __forceinline__ void xq_wg_copy_b(const kvq_u16* up_k_groups, int kvh, int c0, unsigned b_u32,
                                                    unsigned full) {
    kvq_mbar_arrive_expect_tx(full, XQ_WG_STAGE_BYTES);
#pragma unroll
    for (int kh = 0; kh < XQ_KH; ++kh)
        kvq_bulk_copy_g2s(b_u32 + kh * XQ_WG_HEAD_BYTES, up_k_groups + ((long)(kvh + kh) * (XR / 8) + c0 / 8) * D * 8,
                          XQ_WG_HEAD_BYTES, full);
}

// acc[kh] += the warpgroup's 64 rows (A in registers) · stage st's B of KV head kh, XQ_KS
// MMAs of K = 16 a head, issued (not waited) after the fence that orders the fragments' writes
// before them. `ring` is the descriptor of the ring's first byte: a descriptor's address field
// is the byte address over 16, and the ring lies below 256 KiB, so moving into it is one add
// (with a constant offset where the stage is one, in an unrolled loop).
static __device__ __forceinline__ void xq_wg_mma_chunk(float (&acc)[XQ_KH][XQ_MT][XQ_NT][4], const XqFrag& a,
                                                       unsigned long long ring, int st) {
    kvq_wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < XQ_KS; ++ks)
#pragma unroll
        for (int kh = 0; kh < XQ_KH; ++kh)
            kvq_wgmma_f16_ra<D>(&acc[kh][0][0][0], a[ks],
                                ring + (unsigned)((st * XQ_WG_STAGE_BYTES + kh * XQ_WG_HEAD_BYTES + 2 * ks * XQ_B_KG) >> 4));
}

// The page block of store head h for the latent at channel c of a page row.
static __device__ __forceinline__ const kvq_u8* xq_head_block(const XqLoc& l, int c) {
    return l.block + (long)(c / XW) * KTensor::BLOCK_BYTES;
}

// Scale and zero of latent channel c of a page (f16 bits); a symmetric code's zero is −offset·scale.
static __device__ __forceinline__ void xq_k_scale_zero(const kvq_u8* head_block, int c, kvq_u32& s, kvq_u32& z) {
    s = ((const kvq_u16*)(head_block + KTensor::SCALES_OFFSET))[c % XW];
    if constexpr (KTensor::SYMMETRIC) z = kvq_h2_mul(s * 0x10001u, kvq_h2_int(KTensor::OFFSET) ^ KVQ_H2_SIGN) & 0xffffu;
    else z = ((const kvq_u16*)(head_block + KTensor::ZEROS_OFFSET))[c % XW];
}

// Builds the table of a page (row location `l`): thread `first` of `stride` fills entries first,
// first + stride, …
static __device__ __forceinline__ void xq_build_ktab(const XqLoc& l, kvq_u32* tab, int first, int stride) {
    for (int e = first; e < XR / 4; e += stride) {
        const int block = e / 4, tq = e % 4;
        kvq_u32 out[4];
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            const int c = 16 * block + xq_pair_channel(2 * tq + hi);
            const kvq_u8* hb = xq_head_block(l, c);
            kvq_u32 s0, z0, s1, z1;
            xq_k_scale_zero(hb, c, s0, z0);
            xq_k_scale_zero(hb, c + XQ_PD, s1, z1);
            out[hi] = s0 | (s1 << 16);
            out[2 + hi] = z0 | (z1 << 16);
        }
        ((uint4*)tab)[e] = make_uint4(out[0], out[1], out[2], out[3]);
    }
}

// N words of a code row (at a multiple of N words into it): as wide loads as the row stride keeps aligned.
template <int N>
static __device__ __forceinline__ void xq_load_words(const kvq_u32* p, kvq_u32* w) {
    constexpr int V = KTensor::ROW_WORDS % 4 == 0 && N % 4 == 0 ? 4 : (KTensor::ROW_WORDS % 2 == 0 && N % 2 == 0 ? 2 : 1);
    kvq_load<V * 4>((const kvq_u8*)p, w);
#pragma unroll
    for (int i = 1; i < N / V; ++i) kvq_load<V * 4>((const kvq_u8*)(p + V * i), w + V * i);
}

// Chunk kc's codes (both planes' words for its XQ_KC channels) of a thread's rows g and g + 8,
// page rows of one page: `row` is row g's codes in the page's first store head, and row g + 8's
// lie eight rows further, so one pointer serves both.
static __device__ __forceinline__ void xq_load_page_codes(const kvq_u8* row, int kc, XqRowCodes (&r)[2]) {
    const int c_row = kc * XQ_KC, c0 = c_row % XW;
    const kvq_u32* w = (const kvq_u32*)(row + (long)(c_row / XW) * KTensor::BLOCK_BYTES);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const kvq_u32* rw = w + i * 8 * KTensor::ROW_WORDS;
        xq_load_words<XQ_LOW_WORDS>(rw + c0 * XQ_PB / 32, r[i].w);
        if constexpr (XQ_HIGH_WORDS > 0) xq_load_words<XQ_HIGH_WORDS>(rw + KTensor::LOW_PLANE_WORDS + c0 / 32, r[i].w + XQ_LOW_WORDS);
    }
}

// The exact f16 pair of codes (channel, channel + XQ_PD) of pair q of K step s from a row's
// chunk. The word is picked by a select, not an index the lane computes, so the codes stay in
// registers (a block's pairs lie in one word, or in two for 4-bit codes).
static __device__ __forceinline__ kvq_u32 xq_code_pair_at(const XqRowCodes& r, int s, int q) {
    constexpr int WB = 16 / XQ_PW;                          // words a block of 16 channels
    static_assert(WB == 1 || WB == 2, "a block's codes in one or two words");
    const int c = 16 * s + xq_pair_channel(q);              // channel within the chunk
    constexpr kvq_u32 MASK = ((1u << XQ_PB) - 1) * 0x10001u;
    const kvq_u32 word = WB == 1 ? r.w[s] : (q / XQ_PD ? r.w[WB * s + (WB - 1)] : r.w[WB * s]);
    const kvq_u32 shifted = word >> ((c % XQ_PW) * XQ_PB);
    if constexpr (KTensor::BITS == 3) {
        // High-plane bits c and c + 8 (one word of 32 channels) to bits 2 and 18.
        const kvq_u32 h = r.w[XQ_LOW_WORDS + s / 2] >> (c % 32);
        const kvq_u32 x = (shifted & MASK) | ((h << 2) & 4u) | ((h << 10) & 0x40000u);
        return kvq_h2_sub(x | 0x64006400u, 0x64006400u);
    }
    return kvq_h2_sub(kvq_and_or<MASK>(shifted, 0x64006400u), 0x64006400u);
}

// Chunk kc's fragments of rows (g, g + 8) of a tile of one page: codes from registers, scales and
// zeros from the page's table, one f16x2 fma a register (the values kvq_page_value rounds to f16).
static __device__ __forceinline__ void xq_decode_chunk_fast(XqFrag& a, const XqRowCodes (&codes)[2], const kvq_u32* tab,
                                                            int kc, int tq) {
#pragma unroll
    for (int s = 0; s < XQ_KS; ++s) {
        const uint4 t = ((const uint4*)tab)[(kc * XQ_KS + s) * 4 + tq];
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            const kvq_u32 sc = hi ? t.y : t.x, ze = hi ? t.w : t.z;
#pragma unroll
            for (int r = 0; r < 2; ++r) a[s][2 * hi + r] = kvq_h2_fma(sc, xq_code_pair_at(codes[r], s, 2 * tq + hi), ze);
        }
    }
}

// One latent (f16 bits) of any row: a page row decoded with its own page's scale and zero, an
// FP16 sink or tail row as stored, a row past the tile's tokens as zero.
static __device__ __forceinline__ kvq_u32 xq_latent_any(const XqLoc& l, bool live, int c) {
    if (!live) return 0u;
    if (!l.page) return ((const kvq_u16*)xq_head<KTensor>(l, c).f16)[c % XW];
    const kvq_u8* hb = xq_head_block(l, c);
    const int hc = c % XW;
    const kvq_u32* row = (const kvq_u32*)(hb + KTensor::CODES_OFFSET) + l.row * KTensor::ROW_WORDS;
    kvq_u32 code;
    if constexpr (KTensor::BITS == 3)
        code = ((row[hc / 16] >> ((hc % 16) * 2)) & 3u) | (((row[KTensor::LOW_PLANE_WORDS + hc / 32] >> (hc % 32)) & 1u) << 2);
    else
        code = (row[hc * KTensor::BITS / 32] >> ((hc * KTensor::BITS) % 32)) & KTensor::MASK;
    kvq_u32 s, z;
    xq_k_scale_zero(hb, c, s, z);
    return kvq_h2_fma(s, kvq_h2_sub(code | 0x6400u, 0x6400u), z) & 0xffffu;
}

// Chunk kc's fragments for tiles with FP16 rows, rows past the tokens, or rows of two pages:
// each latent on its own (slow, and only at a sequence's edges).
static __device__ __forceinline__ void xq_decode_chunk_any(XqFrag& a, const XqLoc (&kl)[2], const bool (&live)[2], int kc,
                                                           int tq) {
#pragma unroll
    for (int s = 0; s < XQ_KS; ++s)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int c = kc * XQ_KC + 16 * s + xq_pair_channel(2 * tq + hi);
                a[s][2 * hi + r] = xq_latent_any(kl[r], live[r], c) | (xq_latent_any(kl[r], live[r], c + XQ_PD) << 16);
            }
}
