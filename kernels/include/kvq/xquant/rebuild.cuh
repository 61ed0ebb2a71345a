#pragma once
// K's rebuild for the XQuant decode (kvq/xquant/decode.cuh) on mma.sync: the tile's latents times
// up_k's slice of the KV head on tensor cores, through a two-stage shared-memory pipeline over the
// latent channels; then, on both paths, RoPE in registers.

// Column of this warp's n-tile nt: tiles [0, XQ_NH) in the first RoPE half, the rest in the second.
static __device__ __forceinline__ int xq_col(int wn, int nt) {
    return (nt / XQ_NH) * (D / 2) + wn * XQ_HC + (nt % XQ_NH) * 8;
}

// Everything up to RoPE serves the mma.sync path only (the warpgroup path decodes its own
// fragments, kvq/xquant/warpgroup.cuh).
#if !KVQ_XQ_WGMMA
// ---- A thread's XQ_APT latents of its row for the next chunk. Only the codes wait in registers
// through the current chunk's products; the scales and zeros (or an FP16 row's values), shared by
// a page's rows, are read when the codes are decoded. Everything is asked of L1 a chunk earlier.
static constexpr int XQ_CODE_WORDS = KTensor::BITS == 3 ? 2 : (XQ_APT * KTensor::BITS + 31) / 32;
struct XqCodes { kvq_u32 w[XQ_CODE_WORDS]; };
static_assert(KTensor::BITS != 3 || XQ_APT <= 16, "3-bit spans within one low-plane word");

static __device__ __forceinline__ void xq_prefetch_l1(const void* p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// Asks L1 for the lines of a span's codes and parameters (no registers held), a chunk before
// xq_load_codes reads them, so the loads that must wait in registers find them close.
static __device__ __forceinline__ void xq_prefetch_span(const XqLoc& row_loc, int c_row, const kvq_u16* base) {
    using T = KTensor;
    if constexpr (CROSS_LAYER) xq_prefetch_l1(base + c_row);
    const XqLoc l = xq_head<T>(row_loc, c_row);
    const int c0 = c_row % XW;
    if (!l.page) {
        xq_prefetch_l1(l.f16 + c0);
        return;
    }
    xq_prefetch_l1(l.block + T::CODES_OFFSET + (l.row * T::ROW_WORDS + c0 * (T::BITS == 3 ? 2 : T::BITS) / 32) * 4);
    if constexpr (T::BITS == 3) xq_prefetch_l1(l.block + T::CODES_OFFSET + (l.row * T::ROW_WORDS + T::LOW_PLANE_WORDS + c0 / 32) * 4);
    if constexpr (T::AXIS == KvqAxis::Channel) {
        xq_prefetch_l1(l.block + T::SCALES_OFFSET + 2 * c0);
        if constexpr (!T::SYMMETRIC) xq_prefetch_l1(l.block + T::ZEROS_OFFSET + 2 * c0);
    }
}

static __device__ __forceinline__ void xq_load_codes(const XqLoc& row_loc, int c_row, XqCodes& r) {
    using T = KTensor;
    if (!row_loc.page) return;
    const XqLoc l = xq_head<T>(row_loc, c_row);
    const int c0 = c_row % XW;
    const kvq_u32* row = (const kvq_u32*)(l.block + T::CODES_OFFSET) + l.row * T::ROW_WORDS;
    if constexpr (T::BITS == 3) {
        // 2-bit low plane (16 a word) and 1-bit high plane (32 a word).
        r.w[0] = row[c0 / 16];
        r.w[1] = row[T::LOW_PLANE_WORDS + c0 / 32];
    } else {
#pragma unroll
        for (int i = 0; i < XQ_CODE_WORDS; ++i) r.w[i] = row[c0 * T::BITS / 32 + i];
    }
}

// Code k of the span starting at channel c0 (of the row or of its store head: the same bits).
static __device__ __forceinline__ kvq_u32 xq_code(const XqCodes& r, int c0, int k) {
    using T = KTensor;
    if constexpr (T::BITS == 3) {
        const int c = c0 + k;
        return ((r.w[0] >> ((c & 15) * 2)) & 3u) | (((r.w[1] >> (c & 31)) & 1u) << 2);
    } else if constexpr (XQ_APT * T::BITS < 32) {
        return (r.w[0] >> ((c0 * T::BITS) % 32 + k * T::BITS)) & T::MASK;
    } else {
        return (r.w[k * T::BITS / 32] >> ((k * T::BITS) % 32)) & T::MASK;
    }
}

// Codes k and k + 1 of the span as an exact f16 pair (k low): 1024 + code in f16 is
// 0x6400 | code, and one f16x2 subtraction of 1024 leaves the code.
static __device__ __forceinline__ kvq_u32 xq_code_pair(const XqCodes& r, int c0, int k) {
    using T = KTensor;
    kvq_u32 x;
    if constexpr (XQ_APT * T::BITS < 32) x = r.w[0] >> ((c0 * T::BITS) % 32 + k * T::BITS);
    else x = r.w[k * T::BITS / 32] >> ((k * T::BITS) % 32);
    constexpr kvq_u32 MASK = T::MASK, MASK_HI = MASK << 16;
    const kvq_u32 pair = (x & MASK) | ((x << (16 - T::BITS)) & MASK_HI) | 0x64006400u;
    return kvq_h2_sub(pair, 0x64006400u);
}

// The span's values as f16 pairs into `hi` (and what rounding left into `lo` when PASSES = 3):
// a page's codes decoded, an FP16 row as it is, a dead row (past the tile's tokens) as zeros,
// eight values at a time. PASSES = 3 decodes as kvq_page_value (fma(scale, code, zero) in f32)
// and splits; PASSES = 1 takes one f16x2 fma of the f16 scale and zero pairs (the exact value
// rounded once to f16; 3-bit codes, which span two planes, decode in f32 first).
// PAGE_ONLY: every row of the tile is a live page row (no branch on the row's kind). CROSS_LAYER:
// `base` is the row's accumulator latents (f16), added to every value before it is rounded.
template <bool PAGE_ONLY>
static __device__ __forceinline__ void xq_store_a(const XqCodes& r, const XqLoc& row_loc, bool live, int c0, const kvq_u16* base,
                                                  kvq_u16* hi, kvq_u16* lo) {
    using T = KTensor;
    // The span's store head; c0 stays the row's channel (code bits and `base` follow it).
    const XqLoc l = xq_head<T>(row_loc, c0);
    const int hc = c0 % XW;
    constexpr bool PACKED = PASSES == 1 && T::BITS != 3 && !CROSS_LAYER;
    if constexpr (PAGE_ONLY) live = true;
#pragma unroll
    for (int o = 0; o < XQ_APT; o += 8) {
        kvq_u32 h[4] = {0u, 0u, 0u, 0u}, g[4] = {0u, 0u, 0u, 0u};
        // The 8 channels' accumulator latents in one 16-byte load (the row is 64-byte aligned,
        // c0 + o a multiple of 8), issued before the codes are decoded.
        kvq_u32 b[4] = {0u, 0u, 0u, 0u};
        if constexpr (CROSS_LAYER) {
            if (PAGE_ONLY || live) kvq_load<16>((const kvq_u8*)(base + c0 + o), b);
        }
        const auto base_at = [&](int k) { return kvq_f16_to_f32((kvq_u16)(b[k / 2] >> (16 * (k % 2)))); };
        if (!PAGE_ONLY && live && !l.page) {
            const uint4 x = *(const uint4*)(l.f16 + hc + o);
            h[0] = x.x; h[1] = x.y; h[2] = x.z; h[3] = x.w;
            if constexpr (CROSS_LAYER) {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float x0 = kvq_f16_to_f32((kvq_u16)h[k]) + base_at(2 * k);
                    const float x1 = kvq_f16_to_f32((kvq_u16)(h[k] >> 16)) + base_at(2 * k + 1);
                    h[k] = kvq_h2_pack(x0, x1);
                    if constexpr (PASSES == 3)
                        g[k] = kvq_h2_pack(x0 - kvq_f16_to_f32((kvq_u16)h[k]), x1 - kvq_f16_to_f32((kvq_u16)(h[k] >> 16)));
                }
            }
        } else if (PAGE_ONLY || live) {
            // Scale and zero pairs (f16x2) of the 8 channels: per channel, or one per row group.
            kvq_u32 sw[4], zw[4];
            if constexpr (T::AXIS == KvqAxis::Channel) {
                kvq_load<16>(l.block + T::SCALES_OFFSET + 2 * (hc + o), sw);
                if constexpr (!T::SYMMETRIC) kvq_load<16>(l.block + T::ZEROS_OFFSET + 2 * (hc + o), zw);
            } else {
                const int i = l.row * T::GROUPS_PER_TOKEN + (hc + o) / T::GROUP;
                sw[0] = sw[1] = sw[2] = sw[3] = ((const kvq_u16*)(l.block + T::SCALES_OFFSET))[i] * 0x10001u;
                if constexpr (!T::SYMMETRIC) zw[0] = zw[1] = zw[2] = zw[3] = ((const kvq_u16*)(l.block + T::ZEROS_OFFSET))[i] * 0x10001u;
            }
            if constexpr (T::SYMMETRIC) {
                // zero = −offset·scale, exact in f16 (the offset is a power of two).
#pragma unroll
                for (int k = 0; k < 4; ++k) zw[k] = kvq_h2_mul(sw[k], kvq_h2_int(T::OFFSET) ^ KVQ_H2_SIGN);
            }
#pragma unroll
            for (int k = 0; k < 8; k += 2) {
                if constexpr (PACKED) {
                    h[k / 2] = kvq_h2_fma(sw[k / 2], xq_code_pair(r, c0, o + k), zw[k / 2]);
                } else {
                    float x[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        // The code as f32 by its bits (2^23 + code), not a conversion instruction.
                        const float code = __int_as_float(0x4B000000 | (int)xq_code(r, c0, o + k + e)) - 8388608.f;
                        const float sc = kvq_f16_to_f32((kvq_u16)(sw[k / 2] >> (16 * e)));
                        if constexpr (T::SYMMETRIC) x[e] = sc * (code - (float)T::OFFSET);
                        else x[e] = fmaf(sc, code, kvq_f16_to_f32((kvq_u16)(zw[k / 2] >> (16 * e))));
                        if constexpr (CROSS_LAYER) x[e] += base_at(k + e);
                    }
                    h[k / 2] = kvq_h2_pack(x[0], x[1]);
                    if constexpr (PASSES == 3)
                        g[k / 2] = kvq_h2_pack(x[0] - kvq_f16_to_f32((kvq_u16)h[k / 2]),
                                               x[1] - kvq_f16_to_f32((kvq_u16)(h[k / 2] >> 16)));
                }
            }
        }
        ((uint4*)(hi + o))[0] = make_uint4(h[0], h[1], h[2], h[3]);
        if constexpr (PASSES == 3) ((uint4*)(lo + o))[0] = make_uint4(g[0], g[1], g[2], g[3]);
    }
}

// ---- The mma.sync pipeline (every warp copies, decodes and multiplies).
// A thread's fixed addresses in the pipeline, worked out once: its ldmatrix rows in stage 0 (A per
// m-tile, B per pair of n-tiles), and its pieces of up_k's chunk copies.
static constexpr int XQ_B_PIECES = D * XQ_KC / 8;                            // 16-byte pieces a part
static constexpr int XQ_B_PIECES_PT = (XQ_B_PIECES + THREADS - 1) / THREADS;
static_assert(THREADS % (XQ_KC / 8) == 0, "a thread's pieces keep one column offset");
struct XqAddrs {
    unsigned a[XQ_MT], b[XQ_NT / 2];
    int copy_col;     // the first piece's up_k row (a K column of the KV head)
    int copy_k;       // its latent offset in the chunk
};

static __device__ __forceinline__ XqAddrs xq_addrs(const kvq_u16* stages, int wm, int wn, int lane) {
    XqAddrs r;
    const unsigned base = kvq_smem_u32(stages);
#pragma unroll
    for (int mt = 0; mt < XQ_MT; ++mt) {
        const int row = wm * XQ_MT * 16 + mt * 16 + lane % 16;
        r.a[mt] = base + (row * XQ_LD + (lane / 16) * 8) * 2;
    }
#pragma unroll
    for (int p = 0; p < XQ_NT / 2; ++p) {
        const int m = lane / 8, n = xq_col(wn, 2 * p + m / 2) + lane % 8;
        r.b[p] = base + XQ_B_OFFSET + (n * XQ_LD + (m % 2) * 8) * 2;
    }
    r.copy_col = threadIdx.x / (XQ_KC / 8);
    r.copy_k = (threadIdx.x % (XQ_KC / 8)) * 8;
    return r;
}

// up_k's chunk [c0, c0 + XQ_KC) of this KV head's D columns into stage `stage` (rows are columns,
// latents contiguous) by cp.async, then commits the group.
static __device__ __forceinline__ void xq_copy_b(const XqAddrs& ad, const kvq_u16* up_hi, const kvq_u16* up_lo, int kvh,
                                                 int c0, unsigned stage_u32) {
#pragma unroll
    for (int part = 0; part < XQ_PARTS; ++part) {
        const kvq_u16* src = (part == 0 ? up_hi : up_lo) + ((long)kvh * D + ad.copy_col) * XR + c0 + ad.copy_k;
        const unsigned dst = stage_u32 + XQ_B_OFFSET + part * XQ_B_HALVES * 2 + (ad.copy_col * XQ_LD + ad.copy_k) * 2;
#pragma unroll
        for (int j = 0; j < XQ_B_PIECES_PT; ++j) {
            constexpr int COLS = THREADS / (XQ_KC / 8);   // columns between a thread's pieces
            if (XQ_B_PIECES % THREADS == 0 || ad.copy_col + j * COLS < D)
                kvq_cp_async16(dst + j * COLS * XQ_LD * 2, (const kvq_u8*)(src + (long)j * COLS * XR));
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// acc += stage `stage_off` (bytes from stage 0)'s latents · up_k chunk, for the warp's XQ_MT × XQ_NT tiles.
static __device__ __forceinline__ void xq_mma_chunk(float (&acc)[XQ_MT][XQ_NT][4], const XqAddrs& ad, unsigned stage_off) {
#pragma unroll
    for (int ks = 0; ks < XQ_KC / 16; ++ks) {
        kvq_u32 a[XQ_PARTS][XQ_MT][4];
#pragma unroll
        for (int part = 0; part < XQ_PARTS; ++part)
#pragma unroll
            for (int mt = 0; mt < XQ_MT; ++mt) kvq_ldsm_x4(a[part][mt], ad.a[mt] + stage_off + part * XQ_A_HALVES * 2 + ks * 32);
#pragma unroll
        for (int p = 0; p < XQ_NT / 2; ++p) {
            // n-tiles 2p and 2p + 1.
            kvq_u32 b[XQ_PARTS][4];
#pragma unroll
            for (int part = 0; part < XQ_PARTS; ++part) kvq_ldsm_x4(b[part], ad.b[p] + stage_off + part * XQ_B_HALVES * 2 + ks * 32);
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int mt = 0; mt < XQ_MT; ++mt) {
                    float (&c)[4] = acc[mt][2 * p + h];
                    const kvq_u32(&ah)[4] = a[0][mt];
                    if constexpr (PASSES == 3) {
                        const kvq_u32(&al)[4] = a[1][mt];
                        kvq_mma(c, al[0], al[1], al[2], al[3], b[0][2 * h], b[0][2 * h + 1]);
                        kvq_mma(c, ah[0], ah[1], ah[2], ah[3], b[1][2 * h], b[1][2 * h + 1]);
                    }
                    kvq_mma(c, ah[0], ah[1], ah[2], ah[3], b[0][2 * h], b[0][2 * h + 1]);
                }
        }
    }
}

#endif

// RoPE at each row's position, in registers: the warp holds columns j and j + D/2 in n-tiles nt
// and nt + XQ_NH, and each lane rows r0 + 8k (k < 2·XQ_MT). The angle of row r0 comes from f64,
// reduced to [-π, π], where the special-function unit's sine and cosine err by under 2⁻²¹
// (absolute: far below the f16 rounding of the rebuilt K, and a few instructions where sincosf
// takes dozens);
// each next row's turns by 8·f_j more, a complex product with `step[j]` = (cos 8f_j, sin 8f_j).
// The CTA's KV heads turn alike: one angle a row and column rotates each head's K.
static __device__ __forceinline__ void xq_rope(float (&acc)[XQ_KH][XQ_MT][XQ_NT][4], const double* rope_freq,
                                               const float2* step, int t0, int wm, int wn, int lane) {
    const int g = lane / 4, tq = lane % 4;
#pragma unroll
    for (int nt = 0; nt < XQ_NH; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int j = wn * XQ_HC + nt * 8 + 2 * tq + e;
            const double th = (double)(t0 + wm * XQ_MT * 16 + g) * rope_freq[j];
            const double red = fma(-rint(th * 0.15915494309189535), 6.283185307179586, th);
            float sn, cs;
            __sincosf((float)red, &sn, &cs);
            const float2 d = step[j];
#pragma unroll
            for (int k = 0; k < 2 * XQ_MT; ++k) {
                if (k > 0) {
                    const float c2 = fmaf(cs, d.x, -sn * d.y);
                    sn = fmaf(sn, d.x, cs * d.y);
                    cs = c2;
                }
#pragma unroll
                for (int kh = 0; kh < XQ_KH; ++kh) {
                    float& a = acc[kh][k / 2][nt][(k % 2) * 2 + e];
                    float& b = acc[kh][k / 2][nt + XQ_NH][(k % 2) * 2 + e];
                    const float x = a, y = b;
                    a = fmaf(x, cs, -y * sn);
                    b = fmaf(x, sn, y * cs);
                }
            }
        }
}
