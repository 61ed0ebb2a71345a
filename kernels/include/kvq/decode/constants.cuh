#pragma once
// Compile-time constants of the tensor-core kernel derived from the unit's traits: tile geometry,
// code widths, the paths a scheme takes.
static constexpr int NSUB = TILE / 16;             // 16-token subtiles per chunk
// Two subtiles share a score fragment at GQA <= 4 (MmaCtx::pack_heads): column c of every score mma
// holds the query of head c % 4, so columns 4..7 of subtile 2i + 1 are heads 0..3 there and replace
// subtile 2i's columns 4..7, which would score heads past GQA. The softmax works on NPS fragments
// instead of NSUB; the accumulators' columns 4..7 sum heads 0..3 over the odd subtiles until the
// warp's end, when the CTA's merge adds them to heads 0..3.
// 8-head tiles a warp scores (MmaCtx::head_tiles): more than one where a CTA serves more than 8
// query heads of FP16 K and V (up to 2 at head_dim 128, 4 at 64), every K and V fragment it loads
// feeding every tile's mma. Tile t holds heads 8t .. 8t + 7 (columns past GQA score a zero query).
static_assert(HT == 1 || (!K_QUANT && !V_QUANT && !KVQ_PACK && KVQ_STAGES == 0),
              "several head tiles: FP16 K and V, read without the ring");
static_assert(!KVQ_PACK || (GQA <= 4 && NSUB % 2 == 0), "packed heads need GQA <= 4 and an even number of subtiles");
static constexpr int NPS = KVQ_PACK ? NSUB / 2 : NSUB;   // score fragments a chunk's softmax works on
// The query head of score column c (a column of a head past GQA scores a zero query).
static __host__ __device__ constexpr int kvq_col_head(int c) { return KVQ_PACK ? (c & 3) : c; }
// 1-bit keys on the f16 path enter the score mma as f16 subnormals (MmaCtx::k_subnormal).
// The range pass's f16 scores take the query's high and low halves in one mma (MmaCtx::range_packed):
// column c holds the high halves of head c for c < 4, the low halves of head c − 4 after.
// Kitty's boosted plane on the integer path (MmaCtx::k_high_int): KHSTEPS k-steps of 32 slots.
static constexpr int KHSTEPS = K_HIGH_WORDS > 1 ? (K_HIGH_WORDS + 1) / 2 : 1;
// 1- and 2-bit K and V: the instruction stream, not memory, limits these kernels.
static constexpr bool KVQ_LOW_BITS = K_QUANT && KBITS <= 2 && VBITS <= 2;
// Token-axis V codes enter P·V as f16 subnormals (`KvqPairs::get<true>`; MmaCtx::v_subnormal).
// Channel-axis V codes too, their page's scales applied to the accumulators (MmaCtx::v_channel_subnormal).
// DVK, DVV: the key and value channels the kernel computes over, D or more (kvq/decode/slabs.cuh).
static constexpr int KPAIRS = DVK / 8;               // f16 pairs of one token a thread holds (scores)
static constexpr int NT = DVV / 8;                   // V channels a thread owns (P·V)
static constexpr int MT = DVV / 16;                  // m-tiles of O^T
static constexpr float KVQ_LOG2E = 1.4426950408889634f;

// Where UNEVEN_GROUPS, row kvh's first query head, in the query's numbering: group kvh % HEAD_GROUPS of the cache's KV
// head kvh / HEAD_GROUPS, the last group starting early (decode.cu.tera, QHEADS).
static __device__ __forceinline__ long kvq_head_row(int seq, int kvh, int kv_heads) {
    const int group = kvh % HEAD_GROUPS;
    return ((long)seq * (kv_heads / HEAD_GROUPS) + kvh / HEAD_GROUPS) * QHEADS + min(group * GQA, QHEADS - GQA);
}
// Columns of row kvh whose heads the row before it writes (the last row's early start; 0 elsewhere).
static __device__ __forceinline__ int kvq_heads_shared(int kvh) {
    const int group = kvh % HEAD_GROUPS;
    return group * GQA - min(group * GQA, QHEADS - GQA);
}
static constexpr kvq_u32 KVQ_MAGIC = 0x64006400u;    // f16x2 (1024, 1024)
