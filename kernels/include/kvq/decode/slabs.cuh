#pragma once
// Head sizes that are not a power of two: a row's channels read as slabs (docs/LAYOUT.md §9).
//
// The kernel's thread layout is written for a row of a power-of-two size S: quad lane r takes the
// contiguous quarter [r·S/4, (r + 1)·S/4) of a row's K channels, lane group g the eighth
// [g·S/8, (g + 1)·S/8) of its V channels. Other head sizes are read as slabs of such sizes,
// largest first (`slabs` in kvq-codegen's decode.rs): a lane's block of a row is its share of
// each slab in turn, so everything after the loads (code conversion, the fold, the mma chains,
// the softmax) runs over DVK key and DVV value channels in this "block order" as it runs over a
// power-of-two row. Only what touches memory maps block order to channels: the loads of rows,
// queries and per-channel parameters, and the output. A side whose code path cannot read slabs
// of 16 channels may end in a slab reaching past the row (DVK > D): its channels there load as
// zeros (a zero query and zero scales make their scores nothing), and loads that would cross the
// row's end are skipped. At D = 64, 128 and 256 there is one slab a side and every loader below
// is the plain load it was.
// K and V have their slabs each (KVQ_KSLAB0..3 and KVQ_VSLAB0..3, summing to DVK and DVV): a
// side's slabs are as small as its code path reads (decode.rs `slab_granularity`). Every helper
// below takes the side as the lane parts it divides a row among: PARTS = 4 is K, 8 is V.
template <int PARTS>
static __host__ __device__ constexpr int kvq_slab_size(int i) {
    return PARTS == 4 ? (i == 0 ? KVQ_KSLAB0 : i == 1 ? KVQ_KSLAB1 : i == 2 ? KVQ_KSLAB2 : i == 3 ? KVQ_KSLAB3 : 0)
                      : (i == 0 ? KVQ_VSLAB0 : i == 1 ? KVQ_VSLAB1 : i == 2 ? KVQ_VSLAB2 : i == 3 ? KVQ_VSLAB3 : 0);
}
template <int PARTS>
static __host__ __device__ constexpr int kvq_slab_count() {
    return (kvq_slab_size<PARTS>(0) > 0) + (kvq_slab_size<PARTS>(1) > 0) + (kvq_slab_size<PARTS>(2) > 0) + (kvq_slab_size<PARTS>(3) > 0);
}
// Sums in closed form, not recursion: called with a loop's index, a recursive form was left to
// run as a loop at run time (at head_dim 112 it put a thousand selects into KIVI-4's kernel).
template <int PARTS>
static __host__ __device__ constexpr int kvq_slab_start(int i) {
    return (i > 0 ? kvq_slab_size<PARTS>(0) : 0) + (i > 1 ? kvq_slab_size<PARTS>(1) : 0) + (i > 2 ? kvq_slab_size<PARTS>(2) : 0) +
           (i > 3 ? kvq_slab_size<PARTS>(3) : 0);
}
// One slab: a row read as it always was.
static constexpr bool KVQ_K_ONE_SLAB = kvq_slab_count<4>() == 1 && DVK == D;
static constexpr bool KVQ_V_ONE_SLAB = kvq_slab_count<8>() == 1 && DVV == D;
template <int PARTS>
static __host__ __device__ constexpr bool kvq_one_slab() { return PARTS == 4 ? KVQ_K_ONE_SLAB : KVQ_V_ONE_SLAB; }
static_assert(kvq_slab_count<4>() >= 1 && kvq_slab_start<4>(kvq_slab_count<4>()) == DVK && DVK >= D && DVK - D < D, "the K slabs cover the row");
static_assert(kvq_slab_count<8>() >= 1 && kvq_slab_start<8>(kvq_slab_count<8>()) == DVV && DVV >= D && DVV - D < D, "the V slabs cover the row");

// Slab I of a side as types, for loads whose widths are template arguments (each loader below
// recurses over I: NVRTC's JIT mode takes no lambdas in device code).
template <int PARTS, int I>
struct KvqSlab {
    static constexpr int S = kvq_slab_size<PARTS>(I), C0 = kvq_slab_start<PARTS>(I);
    static constexpr bool WHOLE = C0 + S <= D;   // every channel inside the row
};

// Where a part's shares of a row of BITS-bit codes sit in registers, from bit kvq_share_at(I)
// of its block, in slab order. A share of 16 bits or more is contiguous bits, as the row holds
// them, in whole 16-bit halves. A smaller one (V codes of 1, 2 and 4 bits in slabs of 16 to 64
// channels; 1-bit K codes in 16- and 32-channel slabs) starts a half of its own on the K side;
// on the V side it follows the previous small share in the same half where it fits (1-bit V at
// head_dim 112: 8 + 4 + 2 codes in one half, not three), so a half converts as many codes as it
// can hold.
template <int PARTS, int BITS>
static __host__ __device__ constexpr int kvq_share_bits(int i) { return kvq_slab_size<PARTS>(i) / PARTS * BITS; }
// The first bit at or after `at` where a share of `bits` may start.
template <int PARTS>
static __host__ __device__ constexpr int kvq_share_fit(int at, int bits) {
    return bits == 0 ? at : (PARTS == 4 || bits >= 16 || at % 16 + bits > 16) ? (at + 15) / 16 * 16 : at;
}
// The bit after a share of `bits` placed from `at`: a K share smaller than a half takes all of it.
template <int PARTS>
static __host__ __device__ constexpr int kvq_share_end(int at, int bits) {
    return kvq_share_fit<PARTS>(at, bits) + (PARTS == 4 && bits > 0 && bits < 16 ? 16 : bits);
}
// Share i's first bit; i = kvq_slab_count gives the bit after the last. Straight-line, no
// recursion: called with an unrolled loop's index, a recursive form was left to run as a loop.
template <int PARTS, int BITS>
static __host__ __device__ constexpr int kvq_share_at(int i) {
    const int e0 = kvq_share_end<PARTS>(0, kvq_share_bits<PARTS, BITS>(0));
    const int e1 = kvq_share_end<PARTS>(e0, kvq_share_bits<PARTS, BITS>(1));
    const int e2 = kvq_share_end<PARTS>(e1, kvq_share_bits<PARTS, BITS>(2));
    const int e3 = kvq_share_end<PARTS>(e2, kvq_share_bits<PARTS, BITS>(3));
    return i == 0 ? kvq_share_fit<PARTS>(0, kvq_share_bits<PARTS, BITS>(0))
         : i == 1 ? kvq_share_fit<PARTS>(e0, kvq_share_bits<PARTS, BITS>(1))
         : i == 2 ? kvq_share_fit<PARTS>(e1, kvq_share_bits<PARTS, BITS>(2))
         : i == 3 ? kvq_share_fit<PARTS>(e2, kvq_share_bits<PARTS, BITS>(3)) : e3;
}
template <int PARTS, int BITS>
static __host__ __device__ constexpr int kvq_share_half0(int i) { return kvq_share_at<PARTS, BITS>(i) / 16; }
// Halves a part's block of a row takes.
template <int PARTS, int BITS>
static __host__ __device__ constexpr int kvq_block_halves() { return (kvq_share_at<PARTS, BITS>(4) + 15) / 16; }

// Largest power of two, at most 16, dividing `bytes` (16 for 0): the alignment an offset keeps.
static __host__ __device__ constexpr int kvq_align_of(int bytes) {
    return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : bytes % 2 == 0 ? 2 : 1;
}
// Loads BYTES (a multiple of 4) from an address aligned to ALIGN into words, in the widest
// vectors both allow.
template <int BYTES, int ALIGN>
static __device__ __forceinline__ void kvq_load_words(const kvq_u8* p, kvq_u32* w) {
    constexpr int V = kvq_align_of(BYTES) < ALIGN ? kvq_align_of(BYTES) : ALIGN;
    static_assert(BYTES % 4 == 0 && V >= 4, "whole, aligned words");
#pragma unroll
    for (int i = 0; i < BYTES / V; ++i) kvq_load<V>(p + i * V, w + i * (V / 4));
}

// ---- Where the kernel finds each channel in a part's registers (host-checked by
// crates/kvq/tests/host_layout.rs, which compiles this header with the host's C++ compiler).

// Bit position, in its 16-bit half, of pair q's field (the order of `KvqPairs::get`).
template <int BITS>
static __host__ __device__ constexpr int kvq_pair_pos(int q) {
    return BITS == 4 ? 4 * ((q % 4) & 1)
         : BITS == 2 ? (q % 8 < 5 ? 2 * (q % 8) : 2 * (q % 8 - 5))
         : BITS == 1 ? (q % 16 < 10 ? q % 16 : q % 16 - 10) : 0;
}
// The pairs of a thread's block of a K row on the f16 path (BITS-bit codes, DVK / 4 channels):
// halves [0, kvq_kf_whole) hold the shares of whole halves, contiguous; each share smaller than a
// half (1-bit keys in 16- and 32-channel slabs) has a half of its own after them. A whole word
// yields 16/BITS pairs, channel f of its low half with channel f of its high half. Every other
// half is *spread* (its upper half of codes moved to bit 16: kvq_spread_half_word, kvq_spread_codes)
// and yields n/2 pairs of its n codes, channel f with channel f + n/2: spread half 0 is an odd
// last whole half (4-bit keys in 16-channel slabs, 1-bit keys at head_dim 64), spread halves 1
// and 2 the shares smaller than a half. Closed forms throughout: called with an unrolled loop's
// index, a loop here would be left to run at run time.
template <int BITS>
static __host__ __device__ constexpr int kvq_kf_sub() {
    return (kvq_share_bits<4, BITS>(kvq_slab_count<4>() - 1) < 16 ? 1 : 0) +
           (kvq_slab_count<4>() > 1 && kvq_share_bits<4, BITS>(kvq_slab_count<4>() - 2) < 16 ? 1 : 0);
}
template <int BITS>
static __host__ __device__ constexpr int kvq_kf_whole() { return kvq_share_half0<4, BITS>(kvq_slab_count<4>() - kvq_kf_sub<BITS>()); }
template <int BITS>
static __host__ __device__ constexpr int kvq_k_word_pairs() { return kvq_kf_whole<BITS>() / 2 * (16 / BITS); }
// Codes of spread half s (0 where there is none), its half in the block and its first channel.
template <int BITS>
static __host__ __device__ constexpr int kvq_kf_spread_codes(int s) {
    return s == 0 ? (kvq_kf_whole<BITS>() % 2 == 1 ? 16 / BITS : 0)
                  : s <= kvq_kf_sub<BITS>() ? kvq_share_bits<4, BITS>(kvq_slab_count<4>() - kvq_kf_sub<BITS>() + s - 1) / BITS : 0;
}
template <int BITS>
static __host__ __device__ constexpr int kvq_kf_spread_half(int s) { return s == 0 ? kvq_kf_whole<BITS>() - 1 : kvq_kf_whole<BITS>() + s - 1; }
template <int BITS>
static __host__ __device__ constexpr int kvq_kf_spread_base(int s) {
    return s == 0 ? (kvq_kf_whole<BITS>() - 1) * (16 / BITS) : kvq_slab_start<4>(kvq_slab_count<4>() - kvq_kf_sub<BITS>() + s - 1) / 4;
}
// First pair of spread half s.
template <int BITS>
static __host__ __device__ constexpr int kvq_kf_spread_pair0(int s) {
    return kvq_k_word_pairs<BITS>() + (s > 0 ? kvq_kf_spread_codes<BITS>(0) / 2 : 0) + (s > 1 ? kvq_kf_spread_codes<BITS>(1) / 2 : 0);
}
// The spread half pair p (>= the words' pairs) belongs to.
template <int BITS>
static __host__ __device__ constexpr int kvq_kf_spread_of(int p) {
    return p < kvq_kf_spread_pair0<BITS>(1) ? 0 : p < kvq_kf_spread_pair0<BITS>(2) ? 1 : 2;
}
template <int BITS>
static __host__ __device__ constexpr int kvq_pair_lo(int p) {
    return p < kvq_k_word_pairs<BITS>() ? (p / (16 / BITS)) * (32 / BITS) + p % (16 / BITS)
                                        : kvq_kf_spread_base<BITS>(kvq_kf_spread_of<BITS>(p)) + (p - kvq_kf_spread_pair0<BITS>(kvq_kf_spread_of<BITS>(p)));
}
template <int BITS>
static __host__ __device__ constexpr int kvq_pair_hi(int p) {
    return kvq_pair_lo<BITS>(p) + (p < kvq_k_word_pairs<BITS>() ? 16 / BITS : kvq_kf_spread_codes<BITS>(kvq_kf_spread_of<BITS>(p)) / 2);
}
// Bit position, in its half, of pair p's field (as kvq_pair_pos for a word's pairs; field f of a
// spread half is at f·BITS, from bit 0 of each half).
template <int BITS>
static __host__ __device__ constexpr int kvq_k_pair_pos(int p) {
    return p < kvq_k_word_pairs<BITS>() ? kvq_pair_pos<BITS>(p) : kvq_pair_pos<BITS>(p - kvq_kf_spread_pair0<BITS>(kvq_kf_spread_of<BITS>(p)));
}
// A 16-bit block of codes (low half of w) with its high byte moved to the high half: the codes
// of channels 8..15 then sit at the bit positions of channels 0..7, each pair one channel of each.
static __device__ __forceinline__ kvq_u32 kvq_spread_half_word(kvq_u32 w) {
    return kvq_prmt(w, 0u, 0x4140u);
}
// A half of n BITS-bit codes (low bits of h) spread over a word: its first n/2 codes stay, the
// rest move to bit 16.
template <int BITS, int N>
static __host__ __device__ constexpr kvq_u32 kvq_spread_codes(kvq_u32 h) {
    return (h & ((1u << (N / 2 * BITS)) - 1u)) | ((h >> (N / 2 * BITS)) << 16);
}
// Spread half S of a K block (`w`: its halves as kvq_load_share places them) as the word whose
// field f of each half is its pair f.
template <int BITS, int S>
static __device__ __forceinline__ kvq_u32 kvq_spread_word(const kvq_u32* w) {
    constexpr int H = kvq_kf_spread_half<BITS>(S);
    if constexpr (S == 0) return kvq_spread_half_word(w[H / 2]);
    else return kvq_spread_codes<BITS, kvq_kf_spread_codes<BITS>(S)>((w[H / 2] >> (16 * (H % 2))) & 0xffffu);
}
// The halves of a lane group's block of a V row of BITS-bit codes (kvq_share_at), as constants:
// the pairs (one channel of two tokens each) half H yields, the fields from its bit 0 up, and the
// block-order channel of its first. Static members, so that every one is worked out by the
// compiler's front end: a pair index left to the optimiser became select chains over the pairs.
// Channels of V share i that lie before half H.
template <int BITS>
static __host__ __device__ constexpr int kvq_v_share_before(int h, int i) {
    return (16 * h <= kvq_share_at<8, BITS>(i) ? 0
            : 16 * h >= kvq_share_at<8, BITS>(i) + kvq_share_bits<8, BITS>(i) ? kvq_share_bits<8, BITS>(i)
                                                                               : 16 * h - kvq_share_at<8, BITS>(i)) / BITS;
}
template <int BITS>
static __host__ __device__ constexpr int kvq_v_half_first(int h) {
    return kvq_v_share_before<BITS>(h, 0) + kvq_v_share_before<BITS>(h, 1) + kvq_v_share_before<BITS>(h, 2) +
           kvq_v_share_before<BITS>(h, 3);
}
template <int BITS, int H>
struct KvqVHalfOf {
    static constexpr int FIRST = kvq_v_half_first<BITS>(H);
    static constexpr int PAIRS = kvq_v_half_first<BITS>(H + 1) - FIRST;
};
// Bit position in its half of block-order V channel j's field (KvqPairs::get's order), in closed
// form: channel o of share i is the field at bit kvq_share_at(i) + o·BITS of the block.
template <int BITS>
static __host__ __device__ constexpr int kvq_v_share_pos(int o, int i) {
    return kvq_pair_pos<BITS>((kvq_share_at<8, BITS>(i) + o * BITS) % 16 / BITS);
}
template <int BITS>
static __host__ __device__ constexpr int kvq_v_pair_pos(int j) {
    return j < kvq_slab_start<8>(1) / 8 || kvq_slab_count<8>() == 1 ? kvq_v_share_pos<BITS>(j, 0)
         : j < kvq_slab_start<8>(2) / 8 || kvq_slab_count<8>() == 2 ? kvq_v_share_pos<BITS>(j - kvq_slab_start<8>(1) / 8, 1)
         : j < kvq_slab_start<8>(3) / 8 || kvq_slab_count<8>() == 3 ? kvq_v_share_pos<BITS>(j - kvq_slab_start<8>(2) / 8, 2)
                                                                     : kvq_v_share_pos<BITS>(j - kvq_slab_start<8>(3) / 8, 3);
}
// 2^(24 − pos): a subnormal pair's code in units of block-order V channel j's field, back to the code.
template <int BITS>
static __host__ __device__ constexpr float kvq_v_pair_units(int j) {
    return (float)(1u << (24 - kvq_v_pair_pos<BITS>(j)));
}
// Byte planes of a word of BITS-bit codes (channels packed from bit 0 up): plane j holds in byte i
// the code of channel PLANES·i + j of the word times kvq_plane_scale(j), unsigned. Planes are
// masked in place in groups of K_PLANES_IN_PLACE (MmaCtx::k_planes_in_place): one shift a group
// instead of one a plane, plane j's bytes then worth 2^(BITS·(j mod K_PLANES_IN_PLACE)) codes,
// which the fold takes out of that plane's query limbs.
// The codes' worth of a byte in plane j, or in byte register x of a row (plane x mod PLANES,
// kvq_byte_channel): the same, since PLANES is a multiple of K_PLANES_IN_PLACE.
template <int BITS>
static __host__ __device__ constexpr int kvq_plane_scale(int j) { return 1 << (BITS * (j % K_PLANES_IN_PLACE)); }
template <int BITS>
struct KvqBytes {
    static constexpr int PLANES = 8 / BITS;
    static constexpr kvq_u32 MASK = ((1u << BITS) - 1u) * 0x01010101u;
    static_assert(PLANES % K_PLANES_IN_PLACE == 0, "planes masked in place come in whole groups");
    static __device__ __forceinline__ void get(kvq_u32 w, kvq_u32* o) {
#pragma unroll
        for (int j = 0; j < PLANES; ++j) {
            const int in_group = j % K_PLANES_IN_PLACE;
            o[j] = (w >> (BITS * (j - in_group))) & (MASK << (BITS * in_group));
        }
    }
};
// Keys on the integer path: a thread's block of a K row is W whole words (its shares of slabs
// whose share is 32 bits or more), then KVQ_K_INT_UNITS sub-word units: 2-bit keys' shares of a
// 32-channel slab (a half word, 8 codes) and of a 16-channel one (a byte, 4 codes, alone in its
// half: kvq_share_half0). A word yields PLANES byte registers (2 k-steps of 2-bit codes); a unit
// yields 2 (one k-step), t = h | h << 12 of its half h cut into channels {0, 4, 2, 6} and
// {1, 5, 3, 7} of the unit (a byte's slots past its 4 codes hold zeros and fold zero limbs).
static constexpr int KVQ_K_INT_UNITS = (kvq_share_bits<4, KBITS>(kvq_slab_count<4>() - 1) < 32 ? 1 : 0) +
    (kvq_slab_count<4>() > 1 && kvq_share_bits<4, KBITS>(kvq_slab_count<4>() - 2) < 32 ? 1 : 0);
static constexpr int KVQ_K_INT_WORDS = kvq_share_half0<4, KBITS>(kvq_slab_count<4>() - KVQ_K_INT_UNITS) / 2;
static constexpr int KVQ_K_INT_STEPS = KBITS <= 2 ? KVQ_K_INT_WORDS * (32 / KBITS) / 8 + KVQ_K_INT_UNITS : DVK / 32;
// Block channel of channel c of sub-word unit u (-1 past the unit's codes).
template <int BITS>
static __host__ __device__ constexpr int kvq_unit_channel(int u, int c) {
    return c < kvq_share_bits<4, BITS>(kvq_slab_count<4>() - KVQ_K_INT_UNITS + u) / BITS
        ? KVQ_K_INT_WORDS * (32 / BITS) + 8 * u + c : -1;
}
// Channel, within a thread's block of DVK/4 channels (block order), of byte i of byte register x
// of a BITS-bit row: in a word, plane x % PLANES of word x / PLANES; in a unit, as above; -1 for a
// slot no channel holds. The query limbs follow the same order.
template <int BITS>
static __host__ __device__ constexpr int kvq_byte_channel(int x, int i) {
    return x < KVQ_K_INT_WORDS * (8 / BITS)
        ? (x / (8 / BITS)) * (32 / BITS) + (8 / BITS) * i + x % (8 / BITS)
        : kvq_unit_channel<BITS>((x - KVQ_K_INT_WORDS * (8 / BITS)) / 2, (x - KVQ_K_INT_WORDS * (8 / BITS)) % 2 + (i == 1 ? 4 : i == 2 ? 2 : i == 3 ? 6 : 0));
}

// The byte registers of a thread's block of one K row (`w`: its halves as kvq_load_share
// places them): PLANES a word, then 2 a sub-word unit.
template <int U = 0>
static __device__ __forceinline__ void kvq_int_key_regs(const kvq_u32* w, kvq_u32* kb) {
    if constexpr (U == 0) {
#pragma unroll
        for (int i = 0; i < KVQ_K_INT_WORDS; ++i) KvqBytes<KBITS>::get(w[i], &kb[i * KvqBytes<KBITS>::PLANES]);
    }
    if constexpr (U < KVQ_K_INT_UNITS) {
        static_assert(U >= 0 && KBITS == 2 && K_PLANES_IN_PLACE <= 2, "sub-word units: 2-bit keys, planes in place in pairs at most");
        constexpr int H = 2 * KVQ_K_INT_WORDS + U;   // the unit's half
        const kvq_u32 h = (w[H / 2] >> (16 * (H % 2))) & 0xffffu;
        const kvq_u32 t = h | (h << 12);
        kvq_u32* o = kb + KVQ_K_INT_WORDS * KvqBytes<KBITS>::PLANES + 2 * U;
        o[0] = t & 0x03030303u;
        o[1] = K_PLANES_IN_PLACE >= 2 ? t & 0x0c0c0c0cu : (t >> 2) & 0x03030303u;
        kvq_int_key_regs<U + 1>(w, kb);
    }
}

// Channel of block-order channel `v` of part p's block (PARTS as above).
template <int PARTS>
static __device__ __forceinline__ int kvq_share_channel(int v, int p) {
    int c = 0;
#pragma unroll
    for (int i = 0; i < kvq_slab_count<PARTS>(); ++i)
        if (v >= kvq_slab_start<PARTS>(i) / PARTS && v < kvq_slab_start<PARTS>(i + 1) / PARTS)
            c = kvq_slab_start<PARTS>(i) + p * (kvq_slab_size<PARTS>(i) / PARTS) + (v - kvq_slab_start<PARTS>(i) / PARTS);
    return c;
}
// Where V channel c sits: lane group `grp`, block-order channel `j` there.
static __device__ __forceinline__ void kvq_v_owner(int c, int& grp, int& j) {
    if constexpr (KVQ_V_ONE_SLAB) {
        grp = c / (D / 8); j = c % (D / 8);
    } else {
#pragma unroll
        for (int i = 0; i < kvq_slab_count<8>(); ++i)
            if (c >= kvq_slab_start<8>(i) && c < kvq_slab_start<8>(i + 1)) {
                grp = (c - kvq_slab_start<8>(i)) / (kvq_slab_size<8>(i) / 8);
                j = kvq_slab_start<8>(i) / 8 + (c - kvq_slab_start<8>(i)) % (kvq_slab_size<8>(i) / 8);
            }
    }
}

// Block-order channels [V0, V0 + N) of part p's block of a row (PARTS as for kvq_share_channel)
// whose channel c starts at bit c·BITS (BITS = 16: f16 rows, queries, per-channel scales), rows
// ROW_ALIGN-aligned, into 16-bit halves (pairs of halves in words, low half first) as
// kvq_share_half0 places them: its share of each slab in turn. Halves past the row load as
// zeros. With one slab, the plain load at p·D·BITS/(8·PARTS) + V0·BITS/8.
// PAST: the bytes after the row are readable and what they load is never used, so a slab reaching
// past the row loads whole, unguarded. Quantized K and V rows: a page block's codes are followed
// by its parameters, a staged chunk's rows by more sections of the stage; K channels past D meet
// zero query limbs or zero scales, V channels past D are output columns never written.
template <int PARTS, int BITS, int ROW_ALIGN, int V0 = 0, int N = (PARTS == 4 ? DVK : DVV) / PARTS, int I = 0, bool PAST = false>
static __device__ __forceinline__ void kvq_load_share(const kvq_u8* row, int p, kvq_u32* w) {
    if constexpr (kvq_one_slab<PARTS>()) {
        kvq_load<N * BITS / 8>(row + p * (D / PARTS * BITS / 8) + V0 * BITS / 8, w);
    } else if constexpr (I < kvq_slab_count<PARTS>()) {
        using L = KvqSlab<PARTS, I>;
        constexpr int B0 = L::C0 / PARTS, B1 = (L::C0 + L::S) / PARTS;   // the slab's share in block order
        constexpr int LO = B0 > V0 ? B0 : V0, HI = B1 < V0 + N ? B1 : V0 + N;
        constexpr int SHARE = kvq_share_bits<PARTS, BITS>(I);
        if constexpr (SHARE < 16) {
            // A share smaller than a half, from bit kvq_share_at(I) of the block (the low bits of
            // a half of its own on the K side). In a slab reaching past the row, a share starting
            // past it loads as zeros unless PAST.
            static_assert(V0 == 0 && N == (PARTS == 4 ? DVK : DVV) / PARTS && SHARE <= 8 && (L::C0 * BITS) % 8 == 0,
                          "shares smaller than a half: whole blocks of slabs, within a byte");
            constexpr int AT = kvq_share_at<PARTS, BITS>(I);
            const int bit = p * SHARE;
            const kvq_u32 b = L::WHOLE || PAST || L::C0 + p * (L::S / PARTS) < D
                ? ((kvq_u32)row[L::C0 * BITS / 8 + (bit >> 3)] >> (bit & 7)) & ((1u << SHARE) - 1u) : 0u;
            if constexpr (AT % 32 == 0) w[AT / 32] = b;
            else w[AT / 32] |= b << (AT % 32);
        } else if constexpr (LO < HI) {
            constexpr int BYTES = (HI - LO) * BITS / 8;
            constexpr int H0 = kvq_share_half0<PARTS, BITS>(I) + (LO - B0) * BITS / 16 - V0 * BITS / 16;   // its first half in `w`
            constexpr int OFF = (L::C0 + LO - B0) * BITS / 8;  // its bytes in the row, for part 0
            constexpr int STRIDE = L::S / PARTS * BITS / 8;    // bytes between parts' shares
            constexpr int CH = 16 / BITS;                      // channels a half holds
            static_assert(BYTES % 2 == 0, "a share of a slab is whole halves");
            const kvq_u8* at = row + OFF + p * STRIDE;
            if constexpr (BYTES % 4 == 0 && H0 % 2 == 0) {
                constexpr int A0 = kvq_align_of(OFF) < kvq_align_of(STRIDE) ? kvq_align_of(OFF) : kvq_align_of(STRIDE);
                constexpr int A = A0 < ROW_ALIGN ? A0 : ROW_ALIGN;
                if constexpr (L::WHOLE || PAST) {
                    kvq_load_words<BYTES, A>(at, w + H0 / 2);
                } else {
                    // Word by word: a word starting inside the row is inside its padded words.
#pragma unroll
                    for (int i = 0; i < BYTES / 4; ++i) w[H0 / 2 + i] = L::C0 + p * (L::S / PARTS) + (LO - B0) + 2 * i * CH < D ? ((const kvq_u32*)at)[i] : 0u;
                }
            } else {
#pragma unroll
                for (int i = 0; i < BYTES / 2; ++i) {
                    const kvq_u32 h = L::WHOLE || PAST || L::C0 + p * (L::S / PARTS) + (LO - B0) + i * CH < D ? (kvq_u32)((const kvq_u16*)at)[i] : 0u;
                    if ((H0 + i) % 2 == 0) w[(H0 + i) / 2] = h;
                    else w[(H0 + i) / 2] |= h << 16;
                }
            }
        }
        kvq_load_share<PARTS, BITS, ROW_ALIGN, V0, N, I + 1, PAST>(row, p, w);
    }
}
