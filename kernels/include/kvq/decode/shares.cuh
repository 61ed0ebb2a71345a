#pragma once
// Split-K work division: each warp's share of a (sequence, KV head) by cost, and a CTA's part.

// ---- Split-K work division. The num_splits × WARPS warps of a (sequence, KV head) each take a
// contiguous share of equal cost. A quantized token costs the bytes read for it (its K and V rows
// with their page parameters: a block's bytes over its tokens); an FP16 row of the sink or the
// tail window costs its bytes too, but at most K_ROW_CAP / V_ROW_CAP quantized rows of its tensor:
// the low-bit paths spend more time per byte on conversion than the FP16 rows' path, which takes a
// round trip a subtile (3; 4.5 for 1- and 2-bit codes in CTAs of at most four warps;
// `fp16_row_cap` in kvq-codegen). Dividing by tokens alone left the warp
// holding a kivi4 sequence's FP16 tail the last of the grid to finish. The arithmetic is in float: it sits
// on every warp's critical path before the first load, and 64-bit divisions cost a B=1 step up
// to 3 µs; float's rounding moves a boundary by at most a token before the grid rounding below.
// Costs per token, in bytes × PAGE (K_ROW_CAP and V_ROW_CAP: the unit's caps of an FP16 row).
static constexpr float KQ_COST = KTensor::KIND == KvqKind::Int ? (float)K_BLOCK_BYTES : 2.f * D * PAGE;
static constexpr float VQ_COST = VTensor::KIND == KvqKind::Int ? (float)V_BLOCK_BYTES : 2.f * D * PAGE;
static constexpr float KF_COST = 2.f * D * PAGE < K_ROW_CAP * KQ_COST ? 2.f * D * PAGE : K_ROW_CAP * KQ_COST;
static constexpr float VF_COST = 2.f * D * PAGE < V_ROW_CAP * VQ_COST ? 2.f * D * PAGE : V_ROW_CAP * VQ_COST;

// The token at which the cost of [0, t) reaches c, over the regions [b[i], b[i+1]) of per-token
// cost w[i].
static __device__ __forceinline__ int kvq_token_at_cost(float c, const int (&b)[5], const float (&w)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float region = (float)(b[i + 1] - b[i]) * w[i];
        if (c <= region) return b[i] + __float2int_rn(__fdividef(c, w[i]));
        c -= region;
    }
    return b[4];
}

// Share `index` of a (sequence, KV head): tokens [begin, end). The first `fixed` shares divide
// `1 − permille/1000` of the sequence's cost (warp w of split s holds share s·WARPS + w); the
// `pieces` shares after them divide the rest (warp w of piece CTA p holds share fixed + p·WARPS + w).
// Where K and V are both quantized, boundaries fall on the chunk grid (TILE tokens from the sink's
// end), so a share adds no partial chunk; inside the sink and from the first FP16 tail row on, on
// subtiles (on the chunk grid, a sequence's FP16 tail went to one or two warps while their
// neighbours got none). Each rule keeps to its side of the region edges, so edges never decrease
// with the index; neighbouring shares compute their common boundary with the same operations, so
// shares tile the sequence exactly.
// The regions are those of the sequence's `len` tokens; a row that sees only the first `seen` of
// them (a query token of a multi-token step) shares out [0, seen) on the same edges.
static __device__ __forceinline__ void kvq_share_range(int len, int seen, int index, int fixed, int pieces, int permille,
                                                       int& begin, int& end) {
    const int sink_end = min(SINK, len);
    const int qk = KTensor::KIND == KvqKind::Int ? kvq_quant_end(len, sink_end, K_LOCAL) : len;
    const int qv = VTensor::KIND == KvqKind::Int ? kvq_quant_end(len, sink_end, V_LOCAL) : len;
    const int b[5] = {0, min(sink_end, seen), min(min(qk, qv), seen), min(max(qk, qv), seen), seen};
    const float w[4] = {
        (KTensor::KIND == KvqKind::Int ? KF_COST : KQ_COST) + (VTensor::KIND == KvqKind::Int ? VF_COST : VQ_COST),
        KQ_COST + VQ_COST,
        qk < qv ? KF_COST + VQ_COST : KQ_COST + VF_COST,
        KF_COST + VF_COST};
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) total += (float)(b[i + 1] - b[i]) * w[i];
    const float fixed_cost = pieces > 0 ? total * (float)(1000 - permille) * 1e-3f : total;
    const float per_fixed = __fdividef(fixed_cost, (float)fixed);
    const float per_piece = pieces > 0 ? __fdividef(total - fixed_cost, (float)pieces) : 0.f;
    int edge[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int j = index + e;
        if (j >= fixed + pieces) { edge[e] = seen; continue; }
        const float c = j <= fixed ? per_fixed * (float)j : fmaf(per_piece, (float)(j - fixed), fixed_cost);
        const int t = kvq_token_at_cost(c, b, w);
        if (t < b[1]) edge[e] = min(b[1], (t + 8) / 16 * 16);
        else if (t < b[2]) edge[e] = min(b[2], sink_end + (t - sink_end + TILE / 2) / TILE * TILE);
        else edge[e] = min(seen, max(b[2], sink_end + (t - sink_end + 8) / 16 * 16));
    }
    begin = edge[0];
    end = edge[1];
}

// Warp `warp` of split `split` when every share is fixed (the score-range pass).
static __device__ __forceinline__ void kvq_warp_range(int len, int seen, int split, int num_splits, int warp, int& w_begin, int& w_end) {
    kvq_share_range(len, seen, split * WARPS + warp, num_splits * WARPS, 0, 0, w_begin, w_end);
}

// Which (part, KV head, sequence) a decode CTA works on. The grid is (num_splits + num_pieces,
// kv_heads, batch), read in launch order (x fastest): the first num_splits·kv_heads·batch CTAs
// are the splits of every (sequence, KV head), the rest its pieces (part num_splits + piece). The
// GPU starts CTAs in that order as others end, so the pieces — small, the last `permille` of each
// sequence's cost — go to the SMs that finish their splits first: some SMs run 15–30% faster than
// others whatever they hold (measured on an H100), and a fixed division waits for the slowest.
// Kernels generated without pieces (MmaCtx::pieces) take the grid as it is: their piece CTAs, if
// launched, find their shares empty (kvq_share_range) and write empty partials.
struct KvqPart { int part, kvh, seq; };
static __device__ __forceinline__ KvqPart kvq_cta_part(int num_pieces) {
    KvqPart p;
    if (!KVQ_RUNS_PIECES || num_pieces == 0) { p.part = blockIdx.x; p.kvh = blockIdx.y; p.seq = blockIdx.z; return p; }
    const int num_splits = gridDim.x - num_pieces;
    const int linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int split_ctas = num_splits * gridDim.y * gridDim.z;
    const bool is_piece = linear >= split_ctas;
    const int per_pair = is_piece ? num_pieces : num_splits;
    const int i = is_piece ? linear - split_ctas : linear;
    const int pair = i / per_pair;
    p.part = (is_piece ? num_splits : 0) + (i - pair * per_pair);
    p.kvh = pair % gridDim.y;
    p.seq = pair / gridDim.y;
    return p;
}
