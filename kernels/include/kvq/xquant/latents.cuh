#pragma once
// XQuant's latent rows (kvq/xquant/decode.cuh): where a token's latents live (FP16 sink or tail
// rows, or rows of page blocks of docs/LAYOUT.md; a row of XR latents is XH store heads of XW
// channels), and spans of consecutive latents loaded raw, then decoded exactly as kvq_page_value
// decodes them.
static constexpr int XH = XR / XW;
static_assert(XR % XW == 0 && XW % 32 == 0, "latent rows of whole store heads, whole words each");

// Where a token's latent row lives: f16 rows (sink or tail ring; store head h at f16 + h·hstride)
// or row `row` of page blocks (store head h's block at block + h·T::BLOCK_BYTES).
struct XqLoc { bool page; const kvq_u16* f16; const kvq_u8* block; int row; int hstride; };

// The location moved to the store head of latent channel c; the channel within it is c % XW.
template <class T>
static __device__ __forceinline__ XqLoc xq_head(XqLoc l, int c) {
    if constexpr (XH > 1) {
        const int h = c / XW;
        if (l.page) l.block += (long)h * T::BLOCK_BYTES;
        else l.f16 += (long)h * l.hstride;
    }
    return l;
}

// The block (its first store head's) of page `page` of a sequence whose page-table row is `pages`.
template <class T>
static __device__ __forceinline__ const kvq_u8* xq_page_block(const kvq_u8* pool, const kvq_i32* pages, int page) {
    return pool + (long)pages[page] * XH * T::BLOCK_BYTES;
}

template <class T>
static __device__ __forceinline__ XqLoc xq_locate(int tok, int len, int slot, const kvq_u8* pool, const kvq_i32* page_table,
                                                  int max_pages, const kvq_u16* sink, const kvq_u16* tail) {
    const int sink_end = min(SINK, len);
    const int qend = kvq_quant_end(len, sink_end, T::LOCAL);
    XqLoc l{false, nullptr, nullptr, 0, 0};
    if (tok < sink_end) {
        l.f16 = sink + ((long)slot * XH * SINK + tok) * XW;
        l.hstride = SINK * XW;
    } else if (tok < qend) {
        l.page = true;
        l.row = (tok - sink_end) % PAGE;
        l.block = xq_page_block<T>(pool, page_table + (long)slot * max_pages, (tok - sink_end) / PAGE);
    } else {
        l.f16 = tail + ((long)slot * XH * T::TAIL_CAP + (tok - sink_end) % T::TAIL_CAP) * XW;
        l.hstride = T::TAIL_CAP * XW;
    }
    return l;
}

// ---- N consecutive latents of one row (channel c0, a multiple of N, so a span lies in one store
// head; the bit positions of codes depend on c0 modulo 32 only): raw words from global memory
// first, so a batch of loads is in flight before any is used, then decoded as kvq_page_value does.
template <class T, int N>
struct XqSpan {
    static_assert(N == 4 || N == 8 || N == 16, "spans of 4, 8 or 16 channels");
    static_assert(T::AXIS == KvqAxis::Channel || T::GROUP % N == 0, "token groups of whole spans");
    static constexpr int WORDS = T::BITS == 3 ? 2 : (N * T::BITS + 31) / 32;
    static constexpr int PARAMS = T::AXIS == KvqAxis::Channel ? N / 2 : 1;
    bool page;
    kvq_u32 code[WORDS];
    kvq_u32 s[N / 2];   // scales (f16 bits; a pair a word on the channel axis), or an f16 row's values
    kvq_u32 z[PARAMS];  // zeros (asymmetric codes)

    __device__ __forceinline__ void load(const XqLoc& row_loc, int c_row) {
        const XqLoc l = xq_head<T>(row_loc, c_row);
        const int c0 = c_row % XW;
        page = l.page;
        if (!l.page) {
            kvq_load<N * 2>((const kvq_u8*)(l.f16 + c0), s);
            return;
        }
        const kvq_u32* row = (const kvq_u32*)(l.block + T::CODES_OFFSET) + l.row * T::ROW_WORDS;
        if constexpr (T::BITS == 3) {
            code[0] = row[c0 / 16];
            code[1] = row[T::LOW_PLANE_WORDS + c0 / 32];
        } else {
#pragma unroll
            for (int i = 0; i < WORDS; ++i) code[i] = row[c0 * T::BITS / 32 + i];
        }
        const kvq_u16* scales = (const kvq_u16*)(l.block + T::SCALES_OFFSET);
        const kvq_u16* zeros = (const kvq_u16*)(l.block + T::ZEROS_OFFSET);
        if constexpr (T::AXIS == KvqAxis::Channel) {
            kvq_load<N * 2>((const kvq_u8*)(scales + c0), s);
            if constexpr (!T::SYMMETRIC) kvq_load<N * 2>((const kvq_u8*)(zeros + c0), z);
        } else {
            const int i = l.row * T::GROUPS_PER_TOKEN + c0 / T::GROUP;
            s[0] = scales[i];
            if constexpr (!T::SYMMETRIC) z[0] = zeros[i];
        }
    }
    static __device__ __forceinline__ float half(const kvq_u32* w, int k) {
        return kvq_f16_to_f32((kvq_u16)(w[k / 2] >> ((k & 1) * 16)));
    }
    __device__ __forceinline__ kvq_u32 code_at(int c0, int k) const {
        if constexpr (T::BITS == 3) {
            const int c = c0 + k;
            return ((code[0] >> ((c & 15) * 2)) & 3u) | (((code[1] >> (c & 31)) & 1u) << 2);
        } else if constexpr (N * T::BITS < 32) {
            return (code[0] >> ((c0 * T::BITS) % 32 + k * T::BITS)) & T::MASK;
        } else {
            return (code[k * T::BITS / 32] >> ((k * T::BITS) % 32)) & T::MASK;
        }
    }
    // Latent k of the span: fma(scale, code, zero) in f32 (symmetric: scale·(code − offset)), or
    // the f16 row's value.
    __device__ __forceinline__ float value(int c0, int k) const {
        if (!page) return half(s, k);
        const float c = (float)code_at(c0, k);
        const float sc = half(s, T::AXIS == KvqAxis::Channel ? k : 0);
        if constexpr (T::SYMMETRIC) return sc * (c - (float)T::OFFSET);
        else return fmaf(sc, c, half(z, T::AXIS == KvqAxis::Channel ? k : 0));
    }
};
