#pragma once
// The decode unit's traits read by both decode kernels, as the unit states them:
//   GQA          query heads a CTA scores (a KV head's, or a group of them);
//   HEAD_GROUPS  grid rows a KV head of the cache (head_groups.rs in kvq-codegen): row kvh scores
//                query heads [kvh·GQA, (kvh + 1)·GQA) against the cache's KV head kvh / HEAD_GROUPS;
//   QHEADS       a KV head's query heads; where fewer than its rows' columns (UNEVEN_GROUPS), the
//                last row starts early, at QHEADS − GQA (kvq_head_row, kvq_heads_shared).
static constexpr int CPL = (D + 31) / 32;                            // channels per lane (scores)
static constexpr int TGROUPS = D >= THREADS ? 1 : THREADS / D;       // token groups (P·V)
static constexpr int CPT = (D + THREADS - 1) / THREADS;              // channels per thread (P·V)
static constexpr int KIND_F16_ROW = 0, KIND_PAGE = 1;

// A query row's sequence and what it sees. Rows are `q_len` query tokens a sequence: row r is
// token r % q_len of sequence r / q_len, whose cache slot (page-table row, FP16 sink and tail,
// length) is seq_slots[r / q_len] (without a list, sequence i is slot i). The step's tokens are
// the slot's last q_len, so token j sees the first len − (q_len − 1 − j) tokens: causal among
// them, on the regions of the whole length. A negative slot is a padding sequence (an engine's
// graph padded to a captured batch size): length 0, so its rows are zeros and read nothing.
struct KvqSlot { int slot, len, seen; };
static __device__ __forceinline__ KvqSlot kvq_seq_slot(const kvq_i32* seq_slots, const kvq_i32* seq_lens, int row, int q_len) {
    const int i = q_len == 1 ? row : row / q_len;
    const int s = seq_slots ? seq_slots[i] : i;
    if (s < 0) return KvqSlot{0, 0, 0};
    const int len = seq_lens[s];
    return KvqSlot{s, len, q_len == 1 ? len : max(len - (q_len - 1 - (row - i * q_len)), 0)};
}

// Per-sequence token split of a quantized tensor (mirrors kvq_reference::regions::TokenRegions).
static __device__ __forceinline__ int kvq_quant_end(int len, int sink_end, int local) {
    const int rest = len - sink_end - local;
    return sink_end + (rest > 0 ? rest / PAGE : 0) * PAGE;
}

// A split's tokens for the CUDA-core kernels (generic, codebook): whole tiles of the sequence, as
// evenly as possible.
static __device__ __forceinline__ void kvq_split_range(int len, int split, int num_splits, int& t_begin, int& t_end) {
    const int per = (len + num_splits - 1) / num_splits;
    const int chunk = (per + TILE - 1) / TILE * TILE;
    t_begin = min(len, split * chunk);
    t_end = min(len, t_begin + chunk);
}
