#pragma once
// XQuant-CL's cache writes (docs/CODEBOOKS.md §3.1): the steps around the projection
// (kvq/xquant/project.cuh) for a layer's new tokens, given the accumulator X̂_{i−1} the engine
// carries from the previous layer (zeros at the first):
//  - kvq_xcl_delta: δ = X − X̂_{i−1}, rounded to X's format: the rows the projection turns into
//    the delta latents the integer store keeps;
//  - kvq_xcl_base: the accumulator's latents X̂_{i−1}·down (projected like X, f16 rows) into the
//    cache's rows [slot][base_rows][XR], which the decode adds to the stored deltas;
//  - kvq_xcl_lift (and its reduce): the next accumulator X̂_i = X̂_{i−1} + [Δ_k | Δ_v]·lift, the
//    f16 delta latents (before any page quantizes them) times the layer's lift matrix
//    [2·XR][XD] f32, summed in f32 on CUDA cores in a fixed order, rounded to X's format.
// Every token's values depend on its own rows only, so a prefill and token-by-token appends
// write the same cache. The including unit defines IO (X's dtype), XD (d_model) and XR (the
// latent width).

// δ for n rows of XD; any grid, any block.
static __device__ __forceinline__ void kvq_xcl_delta(const kvq_u16* __restrict__ x, const kvq_u16* __restrict__ x_hat,
                                                     int n, kvq_u16* __restrict__ delta) {
    const long total = (long)n * XD;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x)
        delta[i] = kvq_f32_to_io(kvq_io_to_f32(x[i]) - kvq_io_to_f32(x_hat[i]));
}

// The accumulator's latent rows of n new tokens to the cache's rows, `rows_a_slot` a sequence
// slot. An append (slots non-null) puts token i at its slot's next position, read from seq_lens
// before the store's append counts the token (a slot of −1 is padding, a full slot is left to
// the store's refusal); a prefill (slots null) writes consecutive rows from row0. Any grid, any
// block.
static __device__ __forceinline__ void kvq_xcl_base(const kvq_u16* __restrict__ lat_k, const kvq_u16* __restrict__ lat_v,
                                                    const int* __restrict__ slots, const int* __restrict__ seq_lens,
                                                    int rows_a_slot, long row0, int n,
                                                    kvq_u16* __restrict__ base_k, kvq_u16* __restrict__ base_v) {
    const long total = (long)n * XR;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int r = (int)(i / XR);
        long row = row0 + r;
        if (slots) {
            const int s = slots[r];
            if (s < 0) continue;
            const int at = seq_lens[s];
            if (at < 0 || at >= rows_a_slot) continue;
            row = (long)s * rows_a_slot + at;
        }
        base_k[row * XR + i % XR] = lat_k[i];
        base_v[row * XR + i % XR] = lat_v[i];
    }
}

// The lift: a CTA of XCL_THREADS computes a tile of XCL_M tokens × XCL_N columns of X̂_i, each
// thread 4 × 4 of them (rows ty + 8p, columns tx + 32q), staging XCL_K latents of the tokens and
// the same rows of the lift matrix a step. The 2·XR latents are cut into XCL_P partitions; a
// partition's products accumulate from zero in ascending order and the partition sums add in
// order, (s0 + s1) + s2 + ..., before X̂_{i−1} joins them. A launch of few tokens takes one
// partition a CTA (grid z = XCL_P, f32 sums [XCL_P][n][XD] for kvq_xcl_lift_reduce), so the lift
// matrix streams through many SMs (sixteen partitions of 2,048 latents: 512 CTAs at 4,096 columns); either way a token's accumulator does not depend on its batch.
// Grid (ceil(n / XCL_M), ceil(XD / XCL_N), 1 or XCL_P). x_hat_next may be x_hat (each value is
// read just before the same thread writes it).
static constexpr int XCL_M = 32, XCL_N = 128, XCL_K = 32, XCL_THREADS = 256;
static constexpr int XCL_P = (2 * XR) % (16 * XCL_K) == 0 ? 16 : (2 * XR) % (8 * XCL_K) == 0 ? 8 : ((2 * XR) % (4 * XCL_K) == 0 ? 4 : 2);
static_assert(XR % XCL_K == 0 && (2 * XR) % (XCL_P * XCL_K) == 0, "whole latent chunks a partition");

static __device__ __forceinline__ void kvq_xcl_lift(const kvq_u16* x_hat, const kvq_u16* __restrict__ lat_k,
                                                    const kvq_u16* __restrict__ lat_v, const float* __restrict__ lift,
                                                    int n, kvq_u16* x_hat_next, float* __restrict__ partial) {
    __shared__ float s_lat[XCL_M][XCL_K + 1];
    __shared__ float s_lift[XCL_K][XCL_N];
    constexpr int PART = 2 * XR / XCL_P;   // latents a partition
    const bool split = gridDim.z > 1;
    const int p_begin = split ? blockIdx.z : 0, p_end = split ? p_begin + 1 : XCL_P;
    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    const int row0 = blockIdx.x * XCL_M, col0 = blockIdx.y * XCL_N;
    float total[4][4];
    for (int part = p_begin; part < p_end; ++part) {
        float acc[4][4] = {};
        for (int k0 = part * PART; k0 < (part + 1) * PART; k0 += XCL_K) {
            const kvq_u16* const lat = k0 < XR ? lat_k : lat_v;
            const int c0 = k0 % XR;
            for (int i = threadIdx.x; i < XCL_M * XCL_K; i += XCL_THREADS) {
                const int r = i / XCL_K, c = i % XCL_K;
                s_lat[r][c] = row0 + r < n ? kvq_f16_to_f32(lat[(long)(row0 + r) * XR + c0 + c]) : 0.f;
            }
            for (int i = threadIdx.x; i < XCL_K * XCL_N; i += XCL_THREADS) {
                const int k = i / XCL_N, c = i % XCL_N;
                s_lift[k][c] = col0 + c < XD ? lift[(long)(k0 + k) * XD + col0 + c] : 0.f;
            }
            __syncthreads();
#pragma unroll 8
            for (int k = 0; k < XCL_K; ++k) {
                float b[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) b[q] = s_lift[k][tx + 32 * q];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    const float a = s_lat[ty + 8 * p][k];
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[p][q] = fmaf(a, b[q], acc[p][q]);
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int p = 0; p < 4; ++p)
#pragma unroll
            for (int q = 0; q < 4; ++q) total[p][q] = part == p_begin ? acc[p][q] : total[p][q] + acc[p][q];
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int r = row0 + ty + 8 * p;
        if (r >= n) continue;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int c = col0 + tx + 32 * q;
            if (c >= XD) continue;
            const long at = (long)r * XD + c;
            if (split) partial[(long)blockIdx.z * n * XD + at] = total[p][q];
            else x_hat_next[at] = kvq_f32_to_io(kvq_io_to_f32(x_hat[at]) + total[p][q]);
        }
    }
}

// A split lift's partition sums [XCL_P][n][XD] added in order, then X̂_{i−1}, rounded to X's
// format: a thread a value, grid ceil(n·XD / 256) of 256 threads.
static __device__ __forceinline__ void kvq_xcl_lift_reduce(const kvq_u16* x_hat, const float* __restrict__ partial,
                                                           int n, kvq_u16* x_hat_next) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x, all = (long)n * XD;
    if (i >= all) return;
    float t = partial[i];
#pragma unroll
    for (int p = 1; p < XCL_P; ++p) t = t + partial[p * all + i];
    x_hat_next[i] = kvq_f32_to_io(kvq_io_to_f32(x_hat[i]) + t);
}
