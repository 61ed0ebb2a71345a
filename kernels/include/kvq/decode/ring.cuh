#pragma once
// The per-warp cp.async ring that stages the next chunk while this one computes. KVQ_STAGES = 0: no ring
// (nothing here is used).
// ---- The per-warp cp.async ring: while a warp computes one chunk of quantized K and V pages, the
// next chunk's page bytes are already on their way into its next stage (shared memory, no
// registers held). Each stage holds one chunk's sections; chunks of FP16 rows (sink, tail ring)
// load straight from global memory and leave their stage empty.
static_assert(KVQ_STAGES == 0 || KVQ_STAGES >= 2, "no ring, or a ring of at least two stages");
static __device__ __forceinline__ int kvq_next_stage(int s) { return s + 1 == KVQ_STAGES ? 0 : s + 1; }
// Waits until the oldest chunk in flight has landed (KVQ_STAGES - 1 younger ones may still copy).
static __device__ __forceinline__ void kvq_wait_stage() {
    asm volatile("cp.async.wait_group %0;" ::"n"(KVQ_STAGES - 1) : "memory");
    __syncwarp();
}
// A stage's sections, each starting at a multiple of the plan's alignment (stage_plan in decode.rs).
static constexpr int ST_HDR = 0;
static constexpr int ST_K = ST_HDR + ST_HEADER_BYTES;
static constexpr int ST_KH = ST_K + ST_K_ROWS_BYTES;
static constexpr int ST_V = ST_KH + ST_K_HIGH_BYTES;
static constexpr int ST_VS = ST_V + ST_V_ROWS_BYTES;
static constexpr int ST_VZ = ST_VS + ST_V_SCALES_BYTES;
static constexpr int ST_KP = ST_VZ + ST_V_ZEROS_BYTES;
// With stored scores the decode kernel stages no K parameters; a new V page's parameters take their
// section instead (MmaCtx::stage_v_params).
static_assert(!KVQ_STAGE_VP || VTensor::BLOCK_BYTES - VTensor::SCALES_OFFSET <= ST_K_PARAMS_BYTES, "V parameters fit the K parameter section");

// What a stage holds, written by lane 0 when the chunk is staged and read back by every lane when
// it is used, so a chunk's sources are worked out once and cost no registers while it waits.
// A quantized tensor's page sections are in the stage, each at its section's start (see
// kvq_stage_aligned); an FP16 one's rows stay in global memory.
// KVQ_STORED adds the chunk's first token (where the range pass stores its scores); KVQ_SKEWS
// adds where each section's first byte landed past the section's start.
// Where each section's first byte landed past the section's start: always 0, as every section
// starts 16-byte aligned. Kept where the kernel has no short staging path (4-bit K and V):
// without them ptxas gave KIVI-4 168 registers instead of 176, so six CTAs fit an SM instead
// of four (twelve warps instead of eight: a warp's registers come from one of the SM's four
// 16K-register quarters), and it ran ×0.96 at B=16 L=32K on an H100 (×1.17 on an H200).
// A chunk's first token (KVQ_STORED) and the skews of its sections (KVQ_SKEWS) are members where
// the ring keeps them and constant zeros where it does not, so readers name them either way.
#define KVQ_CHUNK_NO_T0 static constexpr int t0 = 0;
#define KVQ_CHUNK_NO_SKEWS static constexpr kvq_u8 k_skew = 0, kh_skew = 0, v_skew = 0, vs_skew = 0, vz_skew = 0;
template <bool STORED, bool SKEWS>
struct KvqChunkT {
    const kvq_u8* k;   // K's first FP16 row (a quantized K page is all in the stage)
    const kvq_u8* v;   // V page block, or V's first FP16 row
    int n;             // tokens (0: past the warp's range)
    int k_page, v_page;  // page of the sequence, -1 for FP16 rows
    KVQ_CHUNK_NO_T0
    KVQ_CHUNK_NO_SKEWS
};
template <>
struct KvqChunkT<true, false> {
    const kvq_u8* k; const kvq_u8* v; int n; int k_page, v_page;
    int t0;
    KVQ_CHUNK_NO_SKEWS
};
template <>
struct KvqChunkT<false, true> {
    const kvq_u8* k; const kvq_u8* v; int n; int k_page, v_page;
    KVQ_CHUNK_NO_T0
    kvq_u8 k_skew, kh_skew, v_skew, vs_skew, vz_skew;
};
template <>
struct KvqChunkT<true, true> {
    const kvq_u8* k; const kvq_u8* v; int n; int k_page, v_page;
    int t0;
    kvq_u8 k_skew, kh_skew, v_skew, vs_skew, vz_skew;
};
#undef KVQ_CHUNK_NO_T0
#undef KVQ_CHUNK_NO_SKEWS
using KvqChunk = KvqChunkT<KVQ_STORED, KVQ_SKEWS>;
// The chunk descriptor as a type that depends on B, so that code naming a member only some
// configurations have compiles in the others inside a template.
template <bool B>
using KvqChunkOf = KvqChunkT<KVQ_STORED && (B || !B), KVQ_SKEWS>;
static_assert(KVQ_STAGES == 0 || sizeof(KvqChunk) <= ST_HEADER_BYTES, "the stage header holds a chunk descriptor");

// The shared-memory address of a generic pointer into shared memory. Worked out once per warp: per
// copy, the conversion cost a read of the CTA's shared window (S2R) and 64-bit arithmetic.
// Copies [src, src + bytes) to shared address dst in 16-byte pieces from the 16-byte boundary below
// src (the general staging path where the header keeps skews, see KvqChunk); returns where src's
// first byte lands (0, as sections start aligned).
template <int MAX_BYTES>
static __device__ __forceinline__ kvq_u8 kvq_stage_copy(unsigned dst, const kvq_u8* src, int bytes, int lane) {
    constexpr int PIECES = (MAX_BYTES + 15 + 32 * 16 - 1) / (32 * 16);  // per lane, at most
    const int skew = (int)((unsigned long long)src & 15ull);
    const kvq_u8* const from = src - skew + lane * 16;
    const unsigned to = dst + lane * 16;
    const int left = skew + bytes - lane * 16;  // bytes from this lane's first piece on
#pragma unroll
    for (int i = 0; i < PIECES; ++i)
        if (i * 32 * 16 < left) kvq_cp_async16(to + i * 32 * 16, from + i * 32 * 16);
    return (kvq_u8)skew;
}

// Copies [src, src + bytes) to shared address dst in 16-byte pieces spread over the lanes. Every
// staged section starts on a 16-byte boundary: page blocks and their sections are 16-byte
// multiples (docs/LAYOUT.md), and chunks start on the 16-token grid of their page, so a row
// offset is a multiple of 16 bytes for any row size. A piece past `bytes` may read the block's
// next bytes into the stage, rows a chunk masks. A whole section (bytes == MAX_BYTES, every chunk but
// a page's or a region's last) takes its pieces without predicates, each one instruction at a
// constant offset from the lane's first piece.
template <int MAX_BYTES>
static __device__ __forceinline__ void kvq_stage_aligned(unsigned dst, const kvq_u8* src, int bytes, int lane) {
    constexpr int STEP = 32 * 16;
    constexpr int WHOLE = MAX_BYTES / STEP, REST = MAX_BYTES % STEP;  // pieces every lane has; bytes past them
    const kvq_u8* from = src + lane * 16;
    // Opaque to the compiler from here: under the register cap it otherwise rebuilt the 64-bit
    // address from its parts for every piece.
    asm("" : "+l"(from));
    const unsigned to = dst + lane * 16;
    if (bytes == MAX_BYTES) {
#pragma unroll
        for (int i = 0; i < WHOLE; ++i) kvq_cp_async16(to + i * STEP, from + i * STEP);
        if (REST > 0 && lane * 16 < REST) kvq_cp_async16(to + WHOLE * STEP, from + WHOLE * STEP);
    } else {
        const int left = bytes - lane * 16;
#pragma unroll
        for (int i = 0; i < (MAX_BYTES + STEP - 1) / STEP; ++i)
            if (i * STEP < left) kvq_cp_async16(to + i * STEP, from + i * STEP);
    }
}

// Where a warp's ring stands: the next chunk to stage, the K page whose parameters were staged
// last and its physical page, and where the tokens whose K (and, with V, V) are both in quantized
// pages end (fixed per warp: the sequence's length does not change during a step).
// With KVQ_STAGE_VP, also the V page whose parameters were staged last (−1 after FP16 V rows: the
// decode kernel's `v_page` follows the same chunks, so both agree on which chunk brings them).
struct KvqRingPos { int next; int k_params_page; int k_phys; int quant_end; int v_params_page; };

template <bool WITH_V>
static __device__ __forceinline__ KvqRingPos kvq_ring_start(int w_begin, int len) {
    const int sink_end = min(SINK, len);
    int q = kvq_quant_end(len, sink_end, K_LOCAL);
    if constexpr (WITH_V) q = min(q, kvq_quant_end(len, sink_end, V_LOCAL));
    KvqRingPos pos;
    pos.next = w_begin; pos.k_params_page = -1; pos.k_phys = 0; pos.quant_end = q; pos.v_params_page = -1;
    return pos;
}

// A chunk's per-token V scales and zeros (n f16 each, from the page block's offset `row0`) in one
// copy instruction: the first lanes take the scales, the next ones the zeros. ptxas puts three
// never-executed `LDS` before every `LDGSTS`, so each copy instruction saved is four issue slots.
// (V_TOKEN_FOLD with asymmetric V; a template, instantiated only there.)
template <int UNUSED = 0>
static __device__ __forceinline__ void kvq_stage_scales_zeros(unsigned buf_s, const kvq_u8* row0, int n, int lane) {
    static_assert(TILE * 2 * 2 <= 32 * 16, "a chunk's scales and zeros fit one 16-byte piece a lane");
    constexpr int PIECES = (TILE * 2 + 15) / 16;   // of each section
    const bool zeros = lane >= PIECES;
    const int piece = zeros ? lane - PIECES : lane;
    const kvq_u8* const src = row0 + (zeros ? VTensor::ZEROS_OFFSET : VTensor::SCALES_OFFSET) + piece * 16;
    if (lane < 2 * PIECES && piece * 16 < n * 2) kvq_cp_async16(buf_s + (zeros ? ST_VZ : ST_VS) + piece * 16, src);
}

// kvq_stage_next for a chunk whose K and V (K alone without WITH_V) are all in quantized pages:
// nearly every chunk of a long sequence. The page table is read once per page, and nothing about
// the sink or the tail is worked out (measured on the H100: the general path took ~250
// instructions per chunk of kivi2, a fifth of the kernel's).
template <bool WITH_V>
static __device__ __forceinline__ void kvq_stage_quant(kvq_u8* buf, unsigned buf_s, KvqRingPos& pos, int w_end, int len, int slot, int seq, int kvh,
    int kv_heads, const kvq_u8* k_pool, const kvq_u8* v_pool, const kvq_i32* page_table, int max_pages, const float* scores, int lane)
{
    const int sink_end = min(SINK, len);
    const int rel = pos.next - sink_end;
    const int page = rel / PAGE, r0 = rel - page * PAGE;
    const int end = min(min(w_end, pos.next + TILE), min(pos.quant_end, pos.next + (PAGE - r0)));
    const int n = end - pos.next;
    const bool new_page = page != pos.k_params_page;
    if (new_page) {
        pos.k_phys = page_table[(long)slot * max_pages + page];
        pos.k_params_page = page;
    }
    const long head_block = (long)pos.k_phys * (kv_heads / HEAD_GROUPS) + kvh / HEAD_GROUPS;
    if (KVQ_STORED && WITH_V) {   // the decode kernel: the keys' stored scores take their rows' place
        kvq_stage_aligned<TILE * SCORE_ROW_BYTES>(buf_s + ST_K, (const kvq_u8*)kvq_score_row((float*)scores, seq, kvh, kv_heads, max_pages, rel),
                                                  n * SCORE_ROW_BYTES, lane);
    } else {
        const kvq_u8* const kb = k_pool + head_block * (long)K_BLOCK_BYTES;
        if (new_page)
            kvq_stage_aligned<KTensor::BLOCK_BYTES - KTensor::SCALES_OFFSET>(buf_s + ST_KP, kb + KTensor::SCALES_OFFSET, KTensor::BLOCK_BYTES - KTensor::SCALES_OFFSET, lane);
        kvq_stage_aligned<TILE * K_ROW_BYTES>(buf_s + ST_K, kb + KTensor::CODES_OFFSET + r0 * K_ROW_BYTES, n * K_ROW_BYTES, lane);
        if constexpr (KTensor::BOOST)
            kvq_stage_aligned<TILE * (KTensor::HIGH_ROW_WORDS * 4)>(buf_s + ST_KH, kb + KTensor::HIGH_OFFSET + r0 * (KTensor::HIGH_ROW_WORDS * 4),
                                                                    n * (KTensor::HIGH_ROW_WORDS * 4), lane);
    }
    const kvq_u8* vb = 0;
    if constexpr (WITH_V) {
        vb = v_pool + head_block * (long)V_BLOCK_BYTES;
        kvq_stage_aligned<TILE * V_ROW_BYTES>(buf_s + ST_V, vb + VTensor::CODES_OFFSET + r0 * V_ROW_BYTES, n * V_ROW_BYTES, lane);
        if constexpr (KVQ_STAGE_VP) {
        if (page != pos.v_params_page) {
            kvq_stage_aligned<VTensor::BLOCK_BYTES - VTensor::SCALES_OFFSET>(buf_s + ST_KP, vb + VTensor::SCALES_OFFSET, VTensor::BLOCK_BYTES - VTensor::SCALES_OFFSET, lane);
            pos.v_params_page = page;
        }
        }
        if constexpr (V_TOKEN_FOLD) {
        if constexpr (VTensor::SYMMETRIC) kvq_stage_aligned<TILE * 2>(buf_s + ST_VS, vb + VTensor::SCALES_OFFSET + r0 * 2, n * 2, lane);
        else kvq_stage_scales_zeros(buf_s, vb + r0 * 2, n, lane);
        }
    }
    if (lane == 0) {
        KvqChunkOf<WITH_V> c;
        c.k = 0; c.v = vb; c.n = n; c.k_page = page; c.v_page = WITH_V ? page : -1;
        if constexpr (KVQ_STORED) c.t0 = pos.next;
        *(KvqChunkOf<WITH_V>*)(buf + ST_HDR) = c;
    }
    pos.next = end;
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Stages the chunk starting at `pos.next` into buf — the page sections of whichever of K and V are
// quantized there (of K alone without WITH_V: the score-range pass) — writes its descriptor, and
// moves `pos.next` past it; past the warp's range it stages nothing (n = 0). Every call ends with one
// commit, so each chunk owns one cp.async group.
template <bool WITH_V>
static __device__ __forceinline__ void kvq_stage_next(kvq_u8* buf, unsigned buf_s, KvqRingPos& pos, int w_end, int len, int slot, int seq, int kvh,
    int kv_heads, const kvq_u8* k_pool, const kvq_u8* v_pool, const kvq_i32* page_table, int max_pages,
    const kvq_u16* k_sink, const kvq_u16* v_sink, const kvq_u16* k_tail, const kvq_u16* v_tail, const float* scores, int lane)
{
    if constexpr (KVQ_QUANT_FAST) {
    if (pos.next < w_end && pos.next >= min(SINK, len) && pos.next < pos.quant_end) {
        kvq_stage_quant<WITH_V>(buf, buf_s, pos, w_end, len, slot, seq, kvh, kv_heads, k_pool, v_pool, page_table, max_pages, scores, lane);
        return;
    }
    }
    int& next = pos.next;
    KvqChunkOf<WITH_V> c;
    c.n = 0; c.k = 0; c.v = 0; c.k_page = -1; c.v_page = -1;
    if constexpr (KVQ_STORED) c.t0 = next;
    if constexpr (KVQ_SKEWS) { c.k_skew = 0; c.kh_skew = 0; c.v_skew = 0; c.vs_skew = 0; c.vz_skew = 0; }
    if (next < w_end) {
        const int end = kvq_chunk_end(next, w_end, len);
        const KvqSrc ks = k_source(next, len, slot, kvh, kv_heads, k_pool, page_table, max_pages, k_sink, k_tail);
        const int n = end - next;
        c.n = n;
        if (KVQ_STORED && WITH_V && ks.quant) {   // the decode kernel: the keys' stored scores
            c.k_page = ks.page;
            const kvq_u8* const rows = (const kvq_u8*)kvq_score_row((float*)scores, seq, kvh, kv_heads, max_pages, next - min(SINK, len));
            if constexpr (KVQ_SKEWS) c.k_skew = kvq_stage_copy<TILE * SCORE_ROW_BYTES>(buf_s + ST_K, rows, n * SCORE_ROW_BYTES, lane);
            else kvq_stage_aligned<TILE * SCORE_ROW_BYTES>(buf_s + ST_K, rows, n * SCORE_ROW_BYTES, lane);
        } else if (ks.quant) {
            c.k_page = ks.page;
            if constexpr (KVQ_SKEWS) c.k_skew = kvq_stage_copy<TILE * K_ROW_BYTES>(buf_s + ST_K, ks.rows, n * K_ROW_BYTES, lane);
            else kvq_stage_aligned<TILE * K_ROW_BYTES>(buf_s + ST_K, ks.rows, n * K_ROW_BYTES, lane);
            if constexpr (KTensor::BOOST) {
            if constexpr (KVQ_SKEWS) c.kh_skew = kvq_stage_copy<TILE * (KTensor::HIGH_ROW_WORDS * 4)>(buf_s + ST_KH, ks.high, n * (KTensor::HIGH_ROW_WORDS * 4), lane);
            else kvq_stage_aligned<TILE * (KTensor::HIGH_ROW_WORDS * 4)>(buf_s + ST_KH, ks.high, n * (KTensor::HIGH_ROW_WORDS * 4), lane);
            }
            // The first chunk of a K page also brings the page's parameters, which the query is
            // folded with when that chunk's turn comes (the same condition: its page changed).
            if (ks.page != pos.k_params_page) {
                if constexpr (KVQ_SKEWS) kvq_stage_copy<KTensor::BLOCK_BYTES - KTensor::SCALES_OFFSET>(buf_s + ST_KP, ks.block + KTensor::SCALES_OFFSET,
                                                                                                 KTensor::BLOCK_BYTES - KTensor::SCALES_OFFSET, lane);
                else kvq_stage_aligned<KTensor::BLOCK_BYTES - KTensor::SCALES_OFFSET>(buf_s + ST_KP, ks.block + KTensor::SCALES_OFFSET,
                                                                                      KTensor::BLOCK_BYTES - KTensor::SCALES_OFFSET, lane);
                pos.k_params_page = ks.page;
                pos.k_phys = ks.phys;  // for kvq_stage_quant's next chunks of this page
            }
        } else {
            // FP16 rows (sink, tail ring) are read from global memory by the lean path when the
            // chunk's turn comes; asking L2 for them now takes DRAM's latency off that path.
            // (The range pass does not read them.)
            c.k = ks.rows;
            if constexpr (WITH_V) kvq_prefetch(ks.rows, n * D * 2, lane);
        }
        if constexpr (WITH_V) {
            const KvqSrc vs = v_source(next, len, slot, kvh, kv_heads, v_pool, page_table, max_pages, v_sink, v_tail);
            if (vs.quant) {
                c.v = vs.block; c.v_page = vs.page;
                if constexpr (KVQ_SKEWS) c.v_skew = kvq_stage_copy<TILE * V_ROW_BYTES>(buf_s + ST_V, vs.rows, n * V_ROW_BYTES, lane);
                else kvq_stage_aligned<TILE * V_ROW_BYTES>(buf_s + ST_V, vs.rows, n * V_ROW_BYTES, lane);
                if constexpr (KVQ_STAGE_VP) {
                if (vs.page != pos.v_params_page) {   // no K parameters are staged here (stored scores)
                    if constexpr (KVQ_SKEWS) kvq_stage_copy<VTensor::BLOCK_BYTES - VTensor::SCALES_OFFSET>(buf_s + ST_KP, vs.block + VTensor::SCALES_OFFSET,
                                                                                                     VTensor::BLOCK_BYTES - VTensor::SCALES_OFFSET, lane);
                    else kvq_stage_aligned<VTensor::BLOCK_BYTES - VTensor::SCALES_OFFSET>(buf_s + ST_KP, vs.block + VTensor::SCALES_OFFSET,
                                                                                          VTensor::BLOCK_BYTES - VTensor::SCALES_OFFSET, lane);
                    pos.v_params_page = vs.page;
                }
                }
                if constexpr (V_TOKEN_FOLD) {
                if constexpr (KVQ_SKEWS) c.vs_skew = kvq_stage_copy<TILE * 2>(buf_s + ST_VS, vs.scales, n * 2, lane);
                else kvq_stage_aligned<TILE * 2>(buf_s + ST_VS, vs.scales, n * 2, lane);
                if constexpr (!VTensor::SYMMETRIC) {
                if constexpr (KVQ_SKEWS) c.vz_skew = kvq_stage_copy<TILE * 2>(buf_s + ST_VZ, vs.zeros, n * 2, lane);
                else kvq_stage_aligned<TILE * 2>(buf_s + ST_VZ, vs.zeros, n * 2, lane);
                }
                }
            } else {
                c.v = vs.rows;
                kvq_prefetch(vs.rows, n * D * 2, lane);
                if constexpr (KVQ_STAGE_VP) pos.v_params_page = -1;   // as the decode kernel's v_page after FP16 rows
            }
        }
        next = end;
    }
    if (lane == 0) *(KvqChunkOf<WITH_V>*)(buf + ST_HDR) = c;
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// With stored scores the decode kernel stages nothing before the range grid is done (its first
// copies read the scores). Until then it reads its first chunk's page-table entry and asks L2 for
// that page's V bytes, so the first copies after the wait find them near. A first chunk outside
// the quantized pages takes the general path as before.
// (KVQ_STORED only; a template, instantiated only there.)
template <int UNUSED = 0>
static __device__ __forceinline__ void kvq_ring_warm(KvqRingPos& pos, int w_end, int len, int slot, int kvh, int kv_heads,
    const kvq_u8* v_pool, const kvq_i32* page_table, int max_pages, int lane)
{
    const int sink_end = min(SINK, len);
    if (pos.next >= w_end || pos.next < sink_end || pos.next >= pos.quant_end) return;
    const int rel = pos.next - sink_end, page = rel / PAGE, r0 = rel - page * PAGE;
    pos.k_phys = page_table[(long)slot * max_pages + page];
    pos.k_params_page = page;   // kvq_stage_quant reads no entry for this page again
    const kvq_u8* const vb = v_pool + ((long)pos.k_phys * (kv_heads / HEAD_GROUPS) + kvh / HEAD_GROUPS) * (long)V_BLOCK_BYTES;
    kvq_prefetch(vb + VTensor::CODES_OFFSET + r0 * V_ROW_BYTES, min(min(w_end - pos.next, KVQ_STAGES * TILE), PAGE - r0) * V_ROW_BYTES, lane);
    kvq_prefetch(vb + VTensor::SCALES_OFFSET, V_BLOCK_BYTES - VTensor::SCALES_OFFSET, lane);
}
