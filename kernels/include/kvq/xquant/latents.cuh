#pragma once
// XQuant's latent rows (kvq/xquant/decode.cuh): where a token's latents live (an FP16 sink or tail
// row, or a row of a page block of docs/LAYOUT.md at width XR), and spans of consecutive latents
// loaded raw, then decoded exactly as kvq_page_value decodes them.

// Where a token's latent row lives: an f16 row (sink or tail ring) or row `row` of a page block.
struct XqLoc { bool page; const kvq_u16* f16; const kvq_u8* block; int row; };

template <class T>
static __device__ __forceinline__ XqLoc xq_locate(int tok, int len, int slot, const kvq_u8* pool, const kvq_i32* page_table,
                                                  int max_pages, const kvq_u16* sink, const kvq_u16* tail) {
    const int sink_end = min(SINK, len);
    const int qend = kvq_quant_end(len, sink_end, T::LOCAL);
    XqLoc l{false, nullptr, nullptr, 0};
    if (tok < sink_end) {
        l.f16 = sink + ((long)slot * SINK + tok) * XR;
    } else if (tok < qend) {
        l.page = true;
        l.row = (tok - sink_end) % PAGE;
        l.block = pool + (long)page_table[(long)slot * max_pages + (tok - sink_end) / PAGE] * T::BLOCK_BYTES;
    } else {
        l.f16 = tail + ((long)slot * T::TAIL_CAP + (tok - sink_end) % T::TAIL_CAP) * XR;
    }
    return l;
}

// ---- N consecutive latents of one row (channel c0, a multiple of N): raw words from global memory
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

    __device__ __forceinline__ void load(const XqLoc& l, int c0) {
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
