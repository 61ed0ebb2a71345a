#pragma once
// Merges attention states computed over disjoint parts of each query row's tokens into the state
// over all of them: what context parallelism needs, where each GPU attends its share of a
// sequence's cache and the shares are combined after an all-gather.
//
// A state is (O, LSE): O the softmax-weighted values over the part's tokens, LSE = ln Σ exp(s)
// over its scores (−inf for a part that saw none of the row's tokens). The merged state is
// O = Σ_p w_p·O_p / Σ_p w_p and LSE = M + ln Σ_p w_p, with w_p = exp(LSE_p − M), M = max_p LSE_p;
// a row no part saw gets zeros and −inf (kvq_reference::step::merge).
//
// Layout: out_parts [parts][rows][D] in IO, lse_parts [parts][rows] f32 (each part's buffers as
// its GPU wrote them, gathered one after another); out [rows][D] in IO; lse [rows] f32, written
// where not null. One warp a row, each lane holding channels lane, lane + 32, ...; parts are
// summed in part order, so the result does not depend on the launch.
#include "kvq/common.cuh"

template <KvqDtype IO, int D>
static __device__ __forceinline__ void kvq_merge_states(
    const kvq_u16* __restrict__ out_parts,
    const float* __restrict__ lse_parts,
    int parts,
    int rows,
    kvq_u16* __restrict__ out,
    float* __restrict__ lse)
{
    constexpr int CPL = (D + 31) / 32;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x % 32;
    float m = KVQ_NEG_INF;
    for (int p = 0; p < parts; ++p) m = fmaxf(m, lse_parts[(long)p * rows + row]);
    float acc[CPL], total = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) acc[i] = 0.f;
    if (m != KVQ_NEG_INF) {
        for (int p = 0; p < parts; ++p) {
            const float part_lse = lse_parts[(long)p * rows + row];
            if (part_lse == KVQ_NEG_INF) continue;   // saw none of the row's tokens
            const float w = expf(part_lse - m);
            total += w;
            const kvq_u16* o = out_parts + ((long)p * rows + row) * D;
#pragma unroll
            for (int i = 0; i < CPL; ++i) {
                const int c = lane + 32 * i;
                if (c < D) acc[i] = fmaf(w, kvq_to_f32<IO>(o[c]), acc[i]);
            }
        }
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
        const int c = lane + 32 * i;
        if (c < D) out[(long)row * D + c] = kvq_from_f32<IO>(acc[i] * inv);
    }
    if (lse != nullptr && lane == 0) lse[row] = total > 0.f ? m + logf(total) : KVQ_NEG_INF;
}
