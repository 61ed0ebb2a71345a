#pragma once
// Where a chunk comes from: FP16 rows (sink, tail ring, FP16 page) or a quantized page, and its L2
// prefetch. `T` is a tensor's layout (KTensor or VTensor, kvq/tensor.cuh).

// One (K or V) chunk source: f16 rows (sink, tail ring, FP16 page) or rows of a quantized page.
// Rows of a chunk are contiguous (chunks never cross a page, region or ring wrap), and so are the
// chunk's rows of a page's per-token sections (K high plane, token-axis V scales and zeros), which
// `high`, `scales` and `zeros` point at (row r0). `block` is the page block (per-page parameters),
// in physical page `phys`.
// The cache holds a block or row a KV head; grid row `kvh` of `kv_heads` reads KV head
// kvh / HEAD_GROUPS of kv_heads / HEAD_GROUPS (decode.cu.tera). Written out at each use: behind an
// inline helper, ptxas compiled kivi2's kernel without head groups to other code (16 more
// instructions); inline, the kernels with HEAD_GROUPS = 1 compile to the SASS they had before.
struct KvqSrc {
    const kvq_u8* rows; const kvq_u8* block; const kvq_u8* high; const kvq_u8* scales; const kvq_u8* zeros;
    int r0; int page; int phys; bool quant;
};
template <class T>
static __device__ __forceinline__ KvqSrc kvq_source(
    int t0, int len, int seq, int kvh, int kv_heads,
    const kvq_u8* pool, const kvq_i32* page_table, int max_pages,
    const kvq_u16* sink, const kvq_u16* tail)
{
    KvqSrc s;
    if constexpr (T::KIND == KvqKind::Fp16) {
    s.page = t0 / PAGE; s.r0 = t0 % PAGE; s.quant = false;
    s.high = 0; s.scales = 0; s.zeros = 0;
    s.phys = page_table[(long)seq * max_pages + s.page];
    s.block = pool + ((long)s.phys * (kv_heads / HEAD_GROUPS) + kvh / HEAD_GROUPS) * (long)T::BLOCK_BYTES;
    s.rows = s.block + (long)s.r0 * D * 2;
    } else {
    const int sink_end = min(SINK, len);
    const int qend = kvq_quant_end(len, sink_end, T::LOCAL);
    s.block = 0; s.high = 0; s.scales = 0; s.zeros = 0; s.r0 = 0; s.page = -1; s.phys = 0; s.quant = false;
    if (t0 < sink_end) {
        s.rows = (const kvq_u8*)(sink + (((long)seq * (kv_heads / HEAD_GROUPS) + kvh / HEAD_GROUPS) * SINK + t0) * D);
    } else if (t0 < qend) {
        s.quant = true;
        s.page = (t0 - sink_end) / PAGE; s.r0 = (t0 - sink_end) % PAGE;
        s.phys = page_table[(long)seq * max_pages + s.page];
        s.block = pool + ((long)s.phys * (kv_heads / HEAD_GROUPS) + kvh / HEAD_GROUPS) * (long)T::BLOCK_BYTES;
        s.rows = s.block + T::CODES_OFFSET + (long)s.r0 * (T::ROW_WORDS * 4);
        if constexpr (T::BOOST) s.high = s.block + T::HIGH_OFFSET + s.r0 * (T::HIGH_ROW_WORDS * 4);
        if constexpr (T::AXIS == KvqAxis::Token) {
        s.scales = s.block + T::SCALES_OFFSET + s.r0 * 2;
        if constexpr (!T::SYMMETRIC) s.zeros = s.block + T::ZEROS_OFFSET + s.r0 * 2;
        }
    } else {
        const int slot = (t0 - sink_end) % T::TAIL_CAP;
        s.rows = (const kvq_u8*)(tail + (((long)seq * (kv_heads / HEAD_GROUPS) + kvh / HEAD_GROUPS) * T::TAIL_CAP + slot) * D);
    }
    }
    return s;
}
static __device__ __forceinline__ KvqSrc k_source(
    int t0, int len, int seq, int kvh, int kv_heads,
    const kvq_u8* pool, const kvq_i32* page_table, int max_pages,
    const kvq_u16* sink, const kvq_u16* tail)
{
    return kvq_source<KTensor>(t0, len, seq, kvh, kv_heads, pool, page_table, max_pages, sink, tail);
}
static __device__ __forceinline__ KvqSrc v_source(
    int t0, int len, int seq, int kvh, int kv_heads,
    const kvq_u8* pool, const kvq_i32* page_table, int max_pages,
    const kvq_u16* sink, const kvq_u16* tail)
{
    return kvq_source<VTensor>(t0, len, seq, kvh, kv_heads, pool, page_table, max_pages, sink, tail);
}

// Prefetches what the chunk [t0, t1) of this tensor will read: its rows, and for a quantized page the
// parameters the kernel reads with them (whole metadata sections: a few lines per page).
template <class T>
static __device__ __forceinline__ void kvq_prefetch_source(const KvqSrc& s, int n, int lane) {
    if constexpr (T::KIND == KvqKind::Fp16) {
    kvq_prefetch(s.rows, n * D * 2, lane);
    } else {
    if (s.quant) {
        kvq_prefetch(s.rows, n * (T::ROW_WORDS * 4), lane);
        if constexpr (T::AXIS == KvqAxis::Token) {
        kvq_prefetch(s.block + T::SCALES_OFFSET + s.r0 * 2, n * 2, lane);
        if constexpr (!T::SYMMETRIC) kvq_prefetch(s.block + T::ZEROS_OFFSET + s.r0 * 2, n * 2, lane);
        } else {
        if (s.r0 == 0) kvq_prefetch(s.block + T::SCALES_OFFSET, T::BLOCK_BYTES - T::SCALES_OFFSET, lane);
        }
        if constexpr (T::BOOST)
            kvq_prefetch(s.block + T::HIGH_OFFSET + s.r0 * (T::HIGH_ROW_WORDS * 4), n * (T::HIGH_ROW_WORDS * 4), lane);
    } else {
        kvq_prefetch(s.rows, n * D * 2, lane);
    }
    }
}
static __device__ __forceinline__ void k_prefetch(const KvqSrc& s, int n, int lane) { kvq_prefetch_source<KTensor>(s, n, lane); }
static __device__ __forceinline__ void v_prefetch(const KvqSrc& s, int n, int lane) { kvq_prefetch_source<VTensor>(s, n, lane); }

// End of the chunk starting at t0: at most TILE tokens, never across a region, page or ring wrap of
// K or V, so each chunk has one K source and one V source. (Written out for K and V: through a
// shared helper NVVM ordered the mins differently.)
static __device__ __forceinline__ int kvq_chunk_end(int t0, int t_end, int len) {
    int t1 = min(t_end, t0 + TILE);
    const int sink_end = min(SINK, len);
    if constexpr (KTensor::KIND == KvqKind::Fp16) {
    t1 = min(t1, (t0 / PAGE + 1) * PAGE);
    } else {
        const int qend = kvq_quant_end(len, sink_end, K_LOCAL);
        if (t0 < sink_end) t1 = min(t1, sink_end);
        else if (t0 < qend) t1 = min(t1, min(qend, sink_end + ((t0 - sink_end) / PAGE + 1) * PAGE));
        else t1 = min(t1, t0 + K_TAIL_CAP - (t0 - sink_end) % K_TAIL_CAP);
    }
    if constexpr (VTensor::KIND == KvqKind::Fp16) {
    t1 = min(t1, (t0 / PAGE + 1) * PAGE);
    } else {
        const int qend = kvq_quant_end(len, sink_end, V_LOCAL);
        if (t0 < sink_end) t1 = min(t1, sink_end);
        else if (t0 < qend) t1 = min(t1, min(qend, sink_end + ((t0 - sink_end) / PAGE + 1) * PAGE));
        else t1 = min(t1, t0 + V_TAIL_CAP - (t0 - sink_end) % V_TAIL_CAP);
    }
    return t1;
}

// Bytes between consecutive rows of a source.
static constexpr int K_ROW_BYTES = KTensor::KIND == KvqKind::Int ? KTensor::ROW_WORDS * 4 : D * 2;
static constexpr int V_ROW_BYTES = VTensor::KIND == KvqKind::Int ? VTensor::ROW_WORDS * 4 : D * 2;

// Stored scores (MmaCtx::stored_scores): the range pass leaves every quantized key's scores, in
// natural units and before calibration, at [sequence][KV head][row past the sink][query head] of
// `scores` (max_pages·PAGE rows a KV head), and the decode kernel reads them back instead of K.
static constexpr int SCORE_ROW_BYTES = GQA * 4;
static_assert(!KVQ_STORED || !KVQ_PACK, "stored scores are kept one subtile a fragment");
// Where the scores of row `rel` (tokens past the sink) of a sequence's KV head are.
static __device__ __forceinline__ float* kvq_score_row(float* scores, int seq, int kvh, int kv_heads, int max_pages, int rel) {
    return scores + (((long)seq * kv_heads + kvh) * ((long)max_pages * PAGE) + rel) * GQA;
}