#pragma once
// Merges the split-K partial results (m, l, acc) of one query head into its output.
//
// The unit including this header defines D (head_dim) and KVQ_COMBINE_THREADS (the combine
// block, whole warps), then calls kvq_combine from its extern "C" entry point.
// Combine: grid (q_heads, batch), block KVQ_COMBINE_THREADS threads. A head's partials are its splits'
// followed by its pieces' (num_parts = num_splits + num_pieces of the decode launch), merged in that
// order whichever SM computed them, so the result does not depend on where a piece ran.
// part_ml[b][h][s] = (m, l): the split's running max (natural-log units) and its softmax denominator;
// part_acc[b][h][s][c]: the split's unnormalised output. Splits that saw no token have l = 0 (their
// partial output is never read into a sum, so it may hold anything).
// lse[b][h], where given (not null): the row's log-sum-exp, ln Σ exp(s) over every score it saw
// (natural log, s = q·k/√d as the scheme scores it), −inf for a row that saw no token. Engines
// merge partial results of one sequence across GPUs with it (context parallelism).
// Warp w merges splits w, w + WARPS, ... with an online softmax, each lane holding
// ceil(head_dim/32) channels (where head_dim is not a multiple of 32, the last lanes' channels
// past it read as zeros and are never stored); the warps then merge in warp order through shared
// memory (deterministic). Every load of a batch of KVQ_COMBINE_BATCH splits is issued before any
// is used, so a head costs a few memory round trips whatever the split count. (One CTA of head_dim threads that weighed all splits first
// and then summed them took 9.5 µs for 49 splits on an H100: three dependent round trips and
// a loop whose loads sat behind a branch.)
#include "kvq/common.cuh"

static constexpr int KVQ_COMBINE_WARPS = KVQ_COMBINE_THREADS / 32;
static constexpr int KVQ_COMBINE_CPL = (D + 31) / 32;   // channels per lane
// Lanes with channels past D (an enumerator: unlike a static constant it emits no PTX global).
enum : bool { KVQ_COMBINE_PAST = D % 32 != 0 };
static constexpr int KVQ_COMBINE_BATCH = KVQ_COMBINE_CPL <= 4 ? 8 : 4;

// Loads this lane's channels of one split's partial output (vectorised where the width allows).
static __device__ __forceinline__ void kvq_combine_load(const float* p, float (&x)[KVQ_COMBINE_CPL]) {
    if constexpr (KVQ_COMBINE_PAST) {
        // A vector of channels lies wholly before D or wholly past it (D is a multiple of 16).
        constexpr int V = KVQ_COMBINE_CPL % 4 == 0 ? 4 : KVQ_COMBINE_CPL % 2 == 0 ? 2 : 1;
        const int c0 = (threadIdx.x % 32) * KVQ_COMBINE_CPL;
#pragma unroll
        for (int i = 0; i < KVQ_COMBINE_CPL; i += V) {
            if (c0 + i >= D) {
#pragma unroll
                for (int e = 0; e < V; ++e) x[i + e] = 0.f;
            } else if constexpr (V == 4) {
                const float4 v = *(const float4*)(p + i);
                x[i] = v.x; x[i + 1] = v.y; x[i + 2] = v.z; x[i + 3] = v.w;
            } else if constexpr (V == 2) {
                const float2 v = *(const float2*)(p + i);
                x[i] = v.x; x[i + 1] = v.y;
            } else {
                x[i] = p[i];
            }
        }
    } else if constexpr (KVQ_COMBINE_CPL % 4 == 0) {
#pragma unroll
        for (int i = 0; i < KVQ_COMBINE_CPL; i += 4) {
            const float4 v = *(const float4*)(p + i);
            x[i] = v.x; x[i + 1] = v.y; x[i + 2] = v.z; x[i + 3] = v.w;
        }
    } else if constexpr (KVQ_COMBINE_CPL % 2 == 0) {
#pragma unroll
        for (int i = 0; i < KVQ_COMBINE_CPL; i += 2) {
            const float2 v = *(const float2*)(p + i);
            x[i] = v.x; x[i + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < KVQ_COMBINE_CPL; ++i) x[i] = p[i];
    }
}

static __device__ __forceinline__ void kvq_combine(
    const float* __restrict__ part_acc,
    const float* __restrict__ part_ml,
    kvq_u16* __restrict__ out,
    float* __restrict__ lse,
    int num_parts)
{
    __shared__ float s_m[KVQ_COMBINE_WARPS], s_l[KVQ_COMBINE_WARPS];
    __shared__ float s_acc[KVQ_COMBINE_WARPS][D];
    const int h = blockIdx.x, b = blockIdx.y, q_heads = gridDim.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long row = (long)b * q_heads + h;
    const float2* ml = (const float2*)part_ml + row * num_parts;
    const float* acc_row = part_acc + row * num_parts * D + lane * KVQ_COMBINE_CPL;
    kvq_wait_for_previous_grid();   // the decode grid may still be running (see launch.rs)

    // 1. This warp's splits, online: m the running max, l and acc scaled to it.
    float m = KVQ_NEG_INF, l = 0.f, acc[KVQ_COMBINE_CPL];
#pragma unroll
    for (int i = 0; i < KVQ_COMBINE_CPL; ++i) acc[i] = 0.f;
    for (int base = warp; base < num_parts; base += KVQ_COMBINE_WARPS * KVQ_COMBINE_BATCH) {
        float2 ms[KVQ_COMBINE_BATCH];
        float xs[KVQ_COMBINE_BATCH][KVQ_COMBINE_CPL];
#pragma unroll
        for (int j = 0; j < KVQ_COMBINE_BATCH; ++j) {
            const int s = base + j * KVQ_COMBINE_WARPS;
            ms[j] = s < num_parts ? ml[s] : make_float2(KVQ_NEG_INF, 0.f);
            if (s < num_parts) kvq_combine_load(acc_row + (long)s * D, xs[j]);
        }
#pragma unroll
        for (int j = 0; j < KVQ_COMBINE_BATCH; ++j) {
            if (ms[j].y > 0.f) {
                const float m_new = fmaxf(m, ms[j].x);
                const float keep = m == KVQ_NEG_INF ? 0.f : expf(m - m_new);
                const float w = expf(ms[j].x - m_new);
                l = l * keep + ms[j].y * w;
#pragma unroll
                for (int i = 0; i < KVQ_COMBINE_CPL; ++i) acc[i] = fmaf(xs[j][i], w, acc[i] * keep);
                m = m_new;
            }
        }
    }
    // 2. The warps, in warp order.
    if (lane == 0) { s_m[warp] = m; s_l[warp] = l; }
    if constexpr (KVQ_COMBINE_PAST) {
#pragma unroll
        for (int i = 0; i < KVQ_COMBINE_CPL; ++i)
            if (lane * KVQ_COMBINE_CPL + i < D) s_acc[warp][lane * KVQ_COMBINE_CPL + i] = acc[i];
    } else {
#pragma unroll
        for (int i = 0; i < KVQ_COMBINE_CPL; ++i) s_acc[warp][lane * KVQ_COMBINE_CPL + i] = acc[i];
    }
    __syncthreads();
    float mm = KVQ_NEG_INF;
#pragma unroll
    for (int w = 0; w < KVQ_COMBINE_WARPS; ++w) mm = fmaxf(mm, s_m[w]);
    for (int c = threadIdx.x; c < D; c += KVQ_COMBINE_WARPS * 32) {
        float total = 0.f, sum = 0.f;
#pragma unroll
        for (int w = 0; w < KVQ_COMBINE_WARPS; ++w) {
            if (s_l[w] > 0.f) {
                const float wt = expf(s_m[w] - mm);
                total += s_l[w] * wt;
                sum += s_acc[w][c] * wt;
            }
        }
        out[row * D + c] = kvq_output_value(sum, total);
    }
    if (lse != nullptr && threadIdx.x == 0) {
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < KVQ_COMBINE_WARPS; ++w)
            if (s_l[w] > 0.f) total += s_l[w] * expf(s_m[w] - mm);
        lse[row] = total > 0.f ? mm + logf(total) : KVQ_NEG_INF;
    }
}
