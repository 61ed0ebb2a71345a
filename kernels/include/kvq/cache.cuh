// kvq/cache.cuh — the cache-maintenance kernels of the integer and FP16 schemes (docs/CACHE.md):
// append, commit, prefill copy, and the page quantizers, from a prefill's input or from the tail
// ring when an append fills a page. Layout: docs/LAYOUT.md (page blocks, FP16 sink buffer, FP16
// tail ring).
//
// The including unit defines D, PAGE, SINK, IO and the tensors' traits KTensor and VTensor
// (kvq/tensor.cuh), and for each integer tensor its quantizer traits (kvq/quantize.cuh), then
// includes this header and declares the entry points, each calling one function here.
#pragma once
#include "kvq/common.cuh"
#include "kvq/tensor.cuh"
#include "kvq/quantize.cuh"
#include "kvq/quantize_regs.cuh"

// The new K/V the engine hands in, in the unit's input format (the cache's FP16 regions are f16).
static __device__ __forceinline__ float kvq_in_to_f32(kvq_u16 x) { return kvq_io_to_f32(x); }

// Stores one value of a new token of tensor T where the layout keeps token `tok` of a sequence whose
// length is already past it: the sink, the tail ring, or (FP16 tensors) its FP16 page.
template <class T>
static __device__ __forceinline__ void kvq_store_f16(int tok, int slot, int kvh, int kv_heads, int c, kvq_u16 h,
    kvq_u8* pool, const kvq_i32* page_table, int max_pages, kvq_u16* sink, kvq_u16* tail) {
    if constexpr (T::KIND == KvqKind::Fp16) {
        const long phys = page_table[(long)slot * max_pages + tok / PAGE];
        ((kvq_u16*)(pool + (phys * kv_heads + kvh) * (long)T::BLOCK_BYTES))[(tok % PAGE) * D + c] = h;
    } else {
        if (tok < SINK) sink[(((long)slot * kv_heads + kvh) * SINK + tok) * D + c] = h;
        else tail[(((long)slot * kv_heads + kvh) * T::TAIL_CAP + (tok - SINK) % T::TAIL_CAP) * D + c] = h;
    }
}

// Append: grid (n, kv_heads), 128 threads. Writes token seq_lens[slots[i]] of each listed
// sequence, from row i·stride of the new rows (stride > 1: one token of a step of several, the
// caller's rows [n][stride][kv_heads][head_dim]); the commit kernel adds it to the length after
// the page quantizers ran. A slot of -1
// is a padding row (an engine's graph padded to a captured batch size): every kernel of the step
// skips it.
static __device__ __forceinline__ void kvq_append(
    const kvq_u16* __restrict__ k_new, const kvq_u16* __restrict__ v_new, int stride,
    const kvq_i32* __restrict__ slots, const kvq_i32* __restrict__ seq_lens,
    kvq_u8* __restrict__ k_pool, kvq_u8* __restrict__ v_pool,
    const kvq_i32* __restrict__ page_table, int max_pages,
    kvq_u16* __restrict__ k_sink, kvq_u16* __restrict__ v_sink,
    kvq_u16* __restrict__ k_tail, kvq_u16* __restrict__ v_tail)
{
    const int i = blockIdx.x, kvh = blockIdx.y, kv_heads = gridDim.y;
    const int slot = slots[i];
    if (slot < 0) return;
    const int tok = seq_lens[slot];
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        const long src = ((long)i * stride * kv_heads + kvh) * D + c;
        kvq_store_f16<KTensor>(tok, slot, kvh, kv_heads, c, kvq_f32_to_f16(kvq_in_to_f32(k_new[src])), k_pool, page_table, max_pages, k_sink, k_tail);
        kvq_store_f16<VTensor>(tok, slot, kvh, kv_heads, c, kvq_f32_to_f16(kvq_in_to_f32(v_new[src])), v_pool, page_table, max_pages, v_sink, v_tail);
    }
}

// Commit: seq_lens[slots[i]] += 1, after append and page quantization of the step.
static __device__ __forceinline__ void kvq_commit(const kvq_i32* __restrict__ slots, int n, kvq_i32* __restrict__ seq_lens) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && slots[i] >= 0) seq_lens[slots[i]] += 1;
}

// Whether the prefill copy writes token `tok` of tensor T in FP16: every token of an FP16 tensor;
// of an integer one the sink and the tokens after its last whole page (the local window and the
// rest of the tail).
template <class T>
static __device__ __forceinline__ bool kvq_prefill_copies(int tok, int tokens, int sink_end) {
    if constexpr (T::KIND == KvqKind::Fp16) return true;
    const int rest = tokens - sink_end - T::LOCAL;
    const int qend = sink_end + (rest > 0 ? rest / PAGE : 0) * PAGE;
    return tok < sink_end || tok >= qend;
}

// Prefill copy: grid (tokens, kv_heads), 128 threads. The FP16 part of a prompt of `tokens` tokens
// into slot `slot`: sink tokens, the tail after the last whole page (into the ring), and FP16
// tensors' pages.
static __device__ __forceinline__ void kvq_prefill_copy(
    const kvq_u16* __restrict__ k_in, const kvq_u16* __restrict__ v_in,
    int tokens, int slot,
    kvq_u8* __restrict__ k_pool, kvq_u8* __restrict__ v_pool,
    const kvq_i32* __restrict__ page_table, int max_pages,
    kvq_u16* __restrict__ k_sink, kvq_u16* __restrict__ v_sink,
    kvq_u16* __restrict__ k_tail, kvq_u16* __restrict__ v_tail)
{
    const int tok = blockIdx.x, kvh = blockIdx.y, kv_heads = gridDim.y;
    const int sink_end = min(SINK, tokens);
    const bool k_copy = kvq_prefill_copies<KTensor>(tok, tokens, sink_end);
    const bool v_copy = kvq_prefill_copies<VTensor>(tok, tokens, sink_end);
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        const long src = ((long)tok * kv_heads + kvh) * D + c;
        if (k_copy) kvq_store_f16<KTensor>(tok, slot, kvh, kv_heads, c, kvq_f32_to_f16(kvq_in_to_f32(k_in[src])), k_pool, page_table, max_pages, k_sink, k_tail);
        if (v_copy) kvq_store_f16<VTensor>(tok, slot, kvh, kv_heads, c, kvq_f32_to_f16(kvq_in_to_f32(v_in[src])), v_pool, page_table, max_pages, v_sink, v_tail);
    }
}

// ---- Page quantizers. Shared memory of the naive and tiled forms (kvq-codegen's cache.rs sizes
// it the same way): raw values u16 [PAGE][D] (tiled), codes u8 [PAGE][D] (when needed), min/max
// partials, boost scores, f16 scales and zeros, f32 (scale, reciprocal, zero) per group, boost
// ranks and flag words, the boost map.
template <class Q, bool BF16, class Src>
static __device__ __forceinline__ void kvq_quantize_with(const Src& src, kvq_u8* smem, kvq_u8* block) {
    // The code buffer is needed by the generic packer and by the boost high plane only.
    constexpr int CODE_BYTES = Q::NEEDS_CODE_BUFFER ? PAGE * D : 0;
    kvq_u8* s_codes = smem;
    constexpr int PARTIALS = Q::SCALE_COUNT > Q::THREADS ? Q::SCALE_COUNT : Q::THREADS;
    float* s_lo = (float*)(s_codes + CODE_BYTES);
    float* s_hi = s_lo + PARTIALS;
    float* s_score = s_hi + PARTIALS;
    kvq_u16* s_scale = (kvq_u16*)(s_score + D);
    kvq_u16* s_zero = s_scale + Q::SCALE_COUNT;
    float* s_group = (float*)(s_zero + Q::SCALE_COUNT);  // 4·count bytes in: 4-aligned
    int* s_rank = (int*)(s_group + 3 * Q::SCALE_COUNT);  // boost ranks and flag words
    kvq_u8* s_map = Q::BOOST ? (kvq_u8*)(s_rank + KVQ_RANK_PARTS * D + (D + 31) / 32) : (kvq_u8*)s_rank;
    kvq_quantize_page<Q, BF16>(src, block, s_scale, s_zero, s_codes, s_lo, s_hi, s_score, s_map, s_group, s_rank);
}

// 16-byte copies of a page's rows into shared memory (D is a multiple of 8; rows 16-byte aligned).
static __device__ __forceinline__ void kvq_stage_rows(kvq_u8* smem, const KvqRows& src) {
    uint4* dst = (uint4*)smem;
#pragma unroll 4
    for (int i = threadIdx.x; i < PAGE * D / 8; i += blockDim.x) {
        const int r = (i * 8) / D, c = (i * 8) % D;
        dst[i] = *(const uint4*)(src.row(r) + c);
    }
    __syncthreads();
}

// Quantizes the page `src` of one KV head into `block`, in Q's form.
template <class Q, bool BF16>
static __device__ __forceinline__ void kvq_quantize(const KvqRows& src, kvq_u8* block) {
    if constexpr (Q::FORM == KvqForm::Tiled) {
        extern __shared__ __align__(16) kvq_u8 smem[];
        kvq_stage_rows(smem, src);
        kvq_quantize_with<Q, BF16>(KvqSmemRows{(const kvq_u16*)smem}, smem + PAGE * D * 2, block);
    } else if constexpr (Q::FORM == KvqForm::Naive) {
        extern __shared__ __align__(16) kvq_u8 smem[];
        kvq_quantize_with<Q, BF16>(src, smem, block);
    } else {
        kvq_quantize_regs<Q, BF16, Q::FORM == KvqForm::Vectorized>(src, block);
    }
}

// Pages of a prefill: grid (kv_heads, jobs); job j = (first input token, page-table entry: the
// sequence slot times max_pages plus the logical page), so the caller needs no physical page. The KV
// heads of a page are neighbouring CTAs: CTAs that run together read whole input rows (every head
// of the same tokens) and write neighbouring page blocks. (Indices straight from blockIdx: a
// division by a parameter here made Kitty-Pro's key quantizer spill, 12% slower.)
template <class Q>
static __device__ __forceinline__ void kvq_quantize_input(const kvq_u16* __restrict__ x, const kvq_i32* __restrict__ jobs,
                                                         const kvq_i32* __restrict__ page_table, kvq_u8* __restrict__ pool) {
    const int kvh = blockIdx.x, kv_heads = gridDim.x, job = blockIdx.y;
    const long first = jobs[2 * job], phys = page_table[jobs[2 * job + 1]];
    const KvqRows src{x + (first * kv_heads + kvh) * D, (long)kv_heads * D, 0, 0};
    kvq_quantize<Q, IO == KvqDtype::Bf16>(src, pool + (phys * kv_heads + kvh) * (long)Q::BLOCK_BYTES);
}

// The page an append step completes: grid (n, kv_heads). After appending, a sequence whose tail
// holds local + page tokens quantizes its oldest page from the ring (graph-friendly: the kernel
// decides from seq_lens; the host only keeps page_table ahead). The ring is always f16.
template <class Q>
static __device__ __forceinline__ void kvq_quantize_ring(const kvq_i32* __restrict__ slots, const kvq_i32* __restrict__ seq_lens,
                                                        kvq_u8* __restrict__ pool, const kvq_i32* __restrict__ page_table,
                                                        int max_pages, const kvq_u16* __restrict__ tail) {
    const int kvh = blockIdx.y, kv_heads = gridDim.y;
    const int slot = slots[blockIdx.x];
    if (slot < 0) return;   // a padding row, the whole CTA
    const int len = seq_lens[slot] + 1;   // the step's token is appended, not yet committed
    const int rest = len - SINK - Q::LOCAL;
    if (rest <= 0 || rest % PAGE != 0) return;
    const int j = rest / PAGE - 1;
    const long phys = page_table[(long)slot * max_pages + j];
    const KvqRows src{tail + ((long)slot * kv_heads + kvh) * Q::TAIL_CAP * D, (long)D, j * PAGE, Q::TAIL_CAP};
    kvq_quantize<Q, false>(src, pool + (phys * kv_heads + kvh) * (long)Q::BLOCK_BYTES);
}
