#pragma once
// V's side of the XQuant decode (kvq/xquant/decode.cuh): Σ_t p_t·l̂_v,t over the latent, a row a
// query head, which the split multiplies by up_v once at its end.
//
// On tensor cores (TENSOR_V: token-axis V latents with one group a store head, 2 or 4 bits,
// R ≤ 1024 in at most XQ_TVH_MAX store heads), for tiles wholly inside the quantized region:
// l̂_t,c = s_t·code_t,c + z_t (s, z those of c's store head), so
// Σ_t p_t·l̂_t,c = Σ_t (p_t·s_t)·code_t,c + Σ_t p_t·z_t. The codes are exact in f16; W = p·s (one
// a store head) is split into two f16 halves (two products, about f32's precision); the tile's code
// rows wait in shared memory (cp.async during K's rebuild, the store heads' pieces side by side),
// and each warp owns every eighth 16-channel m-tile of the latent: O_c,h += codeᵀ·W, with the
// channels as the mma's rows and the query heads (8, padded) as its columns. The zero term Σ p·z
// is a number a query head and store head.
//
// Elsewhere (tiles with FP16 sink or tail rows, and other V latents), on CUDA cores: a thread owns
// XQ_VQ consecutive channels and adds Σ_t p_t·l̂_t,c into the split's sums in shared memory, a batch
// of tokens' raw latents in flight at once.
static constexpr int XQ_VMT = (XR / 16 + XQ_GW - 1) / XQ_GW;         // V m-tiles a warp (tensor path)
static constexpr int XQ_VROW = XR * VTensor::BITS / 8;               // bytes of a V code row
static constexpr int XQ_VHROW = XW * VTensor::BITS / 8;              // bytes of a store head's part of it
static constexpr int XQ_VLD = XQ_VROW + 16;                          // staged V row stride (bytes): banks apart
static constexpr int XQ_WLD = XQ_M + 8;                              // W row stride (halves): banks apart

// Up to four query heads, W's high and low parts share one n8 tile of the mma (rows 0–3, 4–7).
static constexpr bool XQ_VMERGED = XQ_QH <= 4;
static constexpr int XQ_WPART = (XQ_VMERGED ? 1 : 2) * 8 * XQ_WLD;     // a store head's W (halves)
static_assert(!TENSOR_V || !CROSS_LAYER, "cross-layer latents add their accumulator on CUDA cores");
static_assert(!TENSOR_V || (VTensor::AXIS == KvqAxis::Token && VTensor::GROUPS_PER_TOKEN == 1 &&
                            (VTensor::BITS == 2 || VTensor::BITS == 4) && XR <= 1024 && XH <= XQ_TVH_MAX &&
                            XQ_VHROW % 16 == 0),
              "tensor-core values: token-axis latents, one group a store head, 2 or 4 bits, at most 1024 in at most "
              "XQ_TVH_MAX store heads, whole 16-byte head rows");

using XqVSpan = XqSpan<VTensor, XQ_VQ>;

// Copies the tile's V code rows (page rows only: the tensor path's tiles) into sV by cp.async:
// thread `first` of `stride` takes 16-byte pieces first, first + stride, …; `row_at(t)` is row
// t's location.
template <class RowAt>
static __device__ __forceinline__ void xq_copy_v_rows(RowAt row_at, int n, kvq_u8* sV, int first, int stride) {
    constexpr int PIECES = XQ_VROW / 16;
    for (int i = first; i < n * PIECES; i += stride) {
        const int t = i / PIECES, k = (i % PIECES) * 16;
        const XqLoc l = row_at(t);
        const kvq_u8* src = l.block + (long)(k / XQ_VHROW) * VTensor::BLOCK_BYTES + VTensor::CODES_OFFSET +
                            (long)l.row * XQ_VHROW + k % XQ_VHROW;
        kvq_cp_async16(kvq_smem_u32(sV + t * XQ_VLD + k), src);
    }
}

// Scale and zero of a page row's V latents, a store head each (one group a store head);
// symmetric codes' zero is −offset·scale.
static __device__ __forceinline__ void xq_v_scale_zero(const XqLoc& l, float (&s)[XQ_TVH], float (&z)[XQ_TVH]) {
#pragma unroll
    for (int h = 0; h < XQ_TVH; ++h) {
        s[h] = 0.f;
        z[h] = 0.f;
        if (!l.page) continue;
        const kvq_u8* block = l.block + (long)h * VTensor::BLOCK_BYTES;
        s[h] = kvq_f16_to_f32(((const kvq_u16*)(block + VTensor::SCALES_OFFSET))[l.row]);
        if constexpr (VTensor::SYMMETRIC) z[h] = -(float)VTensor::OFFSET * s[h];
        else z[h] = kvq_f16_to_f32(((const kvq_u16*)(block + VTensor::ZEROS_OFFSET))[l.row]);
    }
}

// A lane's channels of an m-tile, g and g + 8 (g = lane / 4), in a token row's code words: the
// byte that holds channel g's code and the code's place in it (2-bit: four codes a byte; 4-bit:
// two). An A register takes that byte of two tokens' words by one byte permute and masks the
// code in place, without a shift: the register then holds code·2^(bits·place), still exact in
// f16 (at most 1,264 with the 1,024 bias), and the m-tile's sums come out scaled by that power of
// two a row, which xq_values_scale undoes, exactly, on the f32 sums.
struct XqVLane {
    kvq_u32 sel_lo, sel_hi;   // byte permutes: channel g's byte of each token word (g + 8's)
    kvq_u32 mask;             // the code's bits in bytes 0 and 2
};
static __device__ __forceinline__ XqVLane xq_v_lane(int lane) {
    const int g = lane / 4;
    constexpr int PER_BYTE = 8 / VTensor::BITS;
    const int byte = (g * VTensor::BITS) / 8, place = g % PER_BYTE;
    // 2-bit: channels g and g + 8 are bytes `byte` and `byte + 2` of one word; 4-bit: byte
    // `byte` of the m-tile's first and second word (the caller passes the right words).
    const kvq_u32 lo = (kvq_u32)byte, hi = VTensor::BITS == 2 ? (kvq_u32)byte + 2 : (kvq_u32)byte;
    XqVLane v;
    v.sel_lo = lo | lo << 4 | (lo + 4) << 8 | (lo + 4) << 12;
    v.sel_hi = hi | hi << 4 | (hi + 4) << 8 | (hi + 4) << 12;
    v.mask = ((kvq_u32)VTensor::MASK << (place * VTensor::BITS)) * 0x10001u;
    return v;
}
// The factor that undoes xq_v_lane's scaling of this lane's rows: 2^−(bits·place).
static __device__ __forceinline__ float xq_values_scale(int lane) {
    const int g = lane / 4, place = g % (8 / VTensor::BITS);
    return __int_as_float((127 - place * VTensor::BITS) << 23);
}
// One channel's codes at two tokens (words a, b; the first token low), scaled as above, as an
// exact f16 pair.
static __device__ __forceinline__ kvq_u32 xq_code_pair(kvq_u32 a, kvq_u32 b, kvq_u32 sel, kvq_u32 mask) {
    return kvq_h2_sub(kvq_and_or(kvq_prmt(a, b, sel), mask, 0x64006400u), 0x64006400u);
}

// vo += codeᵀ·W over the tile's XQ_M tokens for this warp's m-tiles (m-tile i is channels
// 16·(XQ_VMT·warp + i) + [0, 16): a warp's codes are consecutive words of each token row, read
// a few 16-byte pieces at a time); W is [store head][2 parts][8 heads][XQ_WLD] f16, zero past
// the tile's tokens. Up to four query heads, the two parts share one n8 tile (XQ_VMERGED: heads
// in columns 0–3, their low parts in 4–7) and xq_values_merge adds the halves after the tile.
static_assert(XQ_VMT * XQ_GW >= XR / 16, "the warps' m-tiles cover the latent");
static constexpr int XQ_VWPM = VTensor::BITS == 2 ? 1 : 2;            // code words an m-tile's row
// A warp's m-tiles a batch (their code words of a row, at most eight, in registers at once): the
// most that divide the warp's m-tiles.
static __host__ __device__ constexpr int xq_v_batch(int most) { return XQ_VMT % most == 0 ? most : xq_v_batch(most - 1); }
static constexpr int XQ_VMB = xq_v_batch(XQ_VMT < 8 / XQ_VWPM ? XQ_VMT : 8 / XQ_VWPM);
static constexpr int XQ_VWORDS = XQ_VMB * XQ_VWPM;                   // a batch's words of a token row
static_assert(XQ_VMT % XQ_VMB == 0, "whole batches of m-tiles");
// All of a warp's m-tiles in one store head (their W is one), checked where it matters.
static constexpr bool XQ_VONE_HEAD = XW % (16 * XQ_VMT) == 0;
static __device__ __forceinline__ void xq_values_mma(float (&vo)[XQ_VMT][4], const kvq_u8* sV, const kvq_u16* sW, int warp,
                                                     int lane) {
    const int g = lane / 4, tq = lane % 4;
    const XqVLane vl = xq_v_lane(lane);
    const int mt0 = XQ_VMT * warp;
    if (mt0 >= XR / 16) return;
    constexpr int V = XQ_VWORDS % 4 == 0 ? 4 : (XQ_VWORDS % 2 == 0 ? 2 : 1);
    static_assert(!TENSOR_V || XQ_VLD % (4 * V) == 0, "a warp's words of a token row in aligned pieces");
    // Two K steps an iteration: the next step's code rows load while this one's MMAs run.
#pragma unroll 2
    for (int ks = 0; ks < XQ_M / 16; ++ks) {
        const int t0 = ks * 16 + 2 * tq;
        kvq_u32 b[2][2];
        auto load_b = [&](int mt) {
            const kvq_u16* w = sW + (XH > 1 ? (16 * mt) / XW : 0) * XQ_WPART;
#pragma unroll
            for (int part = 0; part < (XQ_VMERGED ? 1 : 2); ++part) {
                b[part][0] = *(const kvq_u32*)(w + (part * 8 + g) * XQ_WLD + t0);
                b[part][1] = *(const kvq_u32*)(w + (part * 8 + g) * XQ_WLD + t0 + 8);
            }
        };
        if (XQ_VONE_HEAD) load_b(mt0);
#pragma unroll
        for (int b0 = 0; b0 < XQ_VMT; b0 += XQ_VMB) {
            if (mt0 + b0 >= XR / 16) continue;
            // Rows t0, t0 + 1, t0 + 8, t0 + 9: the batch's code words of each.
            kvq_u32 rw[4][XQ_VWORDS];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const kvq_u8* row = sV + (t0 + (r & 1) + 8 * (r >> 1)) * XQ_VLD + (mt0 + b0) * XQ_VWPM * 4;
#pragma unroll
                for (int k = 0; k < XQ_VWORDS / V; ++k) kvq_load<4 * V>(row + 4 * V * k, rw[r] + V * k);
            }
#pragma unroll
            for (int i = 0; i < XQ_VMB; ++i) {
                const int mt = b0 + i;
                if (mt0 + mt < XR / 16) {
                    if (!XQ_VONE_HEAD) load_b(mt0 + mt);
                    kvq_u32 a[4];
                    if constexpr (VTensor::BITS == 2) {
                        // Channel g at bit 2g of the m-tile's word, channel g + 8 at bit 2g + 16.
                        a[0] = xq_code_pair(rw[0][i], rw[1][i], vl.sel_lo, vl.mask);
                        a[1] = xq_code_pair(rw[0][i], rw[1][i], vl.sel_hi, vl.mask);
                        a[2] = xq_code_pair(rw[2][i], rw[3][i], vl.sel_lo, vl.mask);
                        a[3] = xq_code_pair(rw[2][i], rw[3][i], vl.sel_hi, vl.mask);
                    } else {
                        // Channel g at bit 4g of the m-tile's first word, channel g + 8 of its second.
                        a[0] = xq_code_pair(rw[0][2 * i], rw[1][2 * i], vl.sel_lo, vl.mask);
                        a[1] = xq_code_pair(rw[0][2 * i + 1], rw[1][2 * i + 1], vl.sel_hi, vl.mask);
                        a[2] = xq_code_pair(rw[2][2 * i], rw[3][2 * i], vl.sel_lo, vl.mask);
                        a[3] = xq_code_pair(rw[2][2 * i + 1], rw[3][2 * i + 1], vl.sel_hi, vl.mask);
                    }
                    kvq_mma(vo[mt], a[0], a[1], a[2], a[3], b[0][0], b[0][1]);
                    if constexpr (!XQ_VMERGED) kvq_mma(vo[mt], a[0], a[1], a[2], a[3], b[1][0], b[1][1]);
                }
            }
        }
    }
}

// With the parts merged, columns 2tq, 2tq + 1 of lanes tq ≥ 2 hold the low parts of the heads
// lanes tq − 2 hold: added there (the lanes tq ≥ 2 keep garbage, unused).
static __device__ __forceinline__ void xq_values_merge(float (&vo)[XQ_VMT][4]) {
    if constexpr (XQ_VMERGED) {
#pragma unroll
        for (int i = 0; i < XQ_VMT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) vo[i][e] += __shfl_down_sync(0xffffffffu, vo[i][e], 2);
    }
}

// Σ_t p_t·l̂_t over the tile's n tokens into the group's sums vsum [XQ_QH][XR] on CUDA cores: the
// group's thread gt takes channels XQ_VQ·(gt + XQ_GT·j) + [0, XQ_VQ). CROSS_LAYER: `base` holds
// the tile's rows of accumulator latents (f16, XR apart), added to each latent.
static __device__ __forceinline__ void xq_values_cuda(const XqLoc* vloc, const float (*p)[XQ_M], int n, const kvq_u16* base,
                                                      float* vsum, int gt) {
    constexpr int VJ = (XR + XQ_VQ * XQ_GT - 1) / (XQ_VQ * XQ_GT);
    constexpr int VB = 8 / VJ;   // tokens whose raw latents are loaded before any is used
    for (int tb = 0; tb < n; tb += VB) {
        XqVSpan raw[VB][VJ];
        // CROSS_LAYER: the accumulator latents of the same channels, loaded with the raw latents
        // (one 8-byte load a span) so that their latency overlaps.
        kvq_u32 braw[CROSS_LAYER ? VB : 1][CROSS_LAYER ? VJ : 1][XQ_VQ / 2];
#pragma unroll
        for (int u = 0; u < VB; ++u)
            if (tb + u < n) {
                const XqLoc l = vloc[tb + u];
#pragma unroll
                for (int j = 0; j < VJ; ++j) {
                    const int c0 = XQ_VQ * (gt + XQ_GT * j);
                    if (c0 < XR) {
                        raw[u][j].load(l, c0);
                        if constexpr (CROSS_LAYER)
                            kvq_load<XQ_VQ * 2>((const kvq_u8*)(base + (long)(tb + u) * XR + c0), braw[u][j]);
                    }
                }
            }
#pragma unroll
        for (int j = 0; j < VJ; ++j) {
            const int c0 = XQ_VQ * (gt + XQ_GT * j);
            if (c0 >= XR) continue;
            float acc[XQ_QH][XQ_VQ];
#pragma unroll
            for (int h = 0; h < XQ_QH; ++h)
#pragma unroll
                for (int e = 0; e < XQ_VQ; ++e) acc[h][e] = vsum[h * XQ_VSLD + c0 + e];
#pragma unroll
            for (int u = 0; u < VB; ++u)
                if (tb + u < n) {
                    float x[XQ_VQ];
#pragma unroll
                    for (int e = 0; e < XQ_VQ; ++e) {
                        x[e] = raw[u][j].value(c0, e);
                        if constexpr (CROSS_LAYER)
                            x[e] += kvq_f16_to_f32((kvq_u16)(braw[u][j][e / 2] >> (16 * (e % 2))));
                    }
#pragma unroll
                    for (int h = 0; h < XQ_QH; ++h)
#pragma unroll
                        for (int e = 0; e < XQ_VQ; ++e) acc[h][e] = fmaf(p[h][tb + u], x[e], acc[h][e]);
                }
#pragma unroll
            for (int h = 0; h < XQ_QH; ++h)
#pragma unroll
                for (int e = 0; e < XQ_VQ; ++e) vsum[h * XQ_VSLD + c0 + e] = acc[h][e];
        }
    }
}
