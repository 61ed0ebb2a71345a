#pragma once
// XQuant's cache writes, first step (docs/CODEBOOKS.md §3.1): the new tokens' latents
// L = X·[down_k | down_v] on tensor cores, rounded to nearest f16 into the rows the integer
// store's append and prefill take ([tokens][XR] each: XR / XW store heads of XW channels, the
// [tokens][kv_heads][head_dim] input of kvq/cache.cuh). The page quantizers then pack them exactly
// as they pack K and V.
//
// down arrives transposed, [2·XR][XD] (a latent column's d_model weights contiguous; K's columns,
// then V's), in X's own 16-bit format and split in two parts, down ≈ hi + lo (each rounded to
// nearest): two products keep the weights to about 2⁻²² (f16) or 2⁻¹⁶ (bf16) of their size, while
// X is exact in its format.
//
// Summation order, the same for every batch: d_model is cut into XP_P partitions; a partition's
// products accumulate from zero, 16 channels at a time in ascending order (hi's product, then
// lo's), and the partition sums add in order, (s0 + s1) + s2 + .... The wide tile (128 tokens ×
// 64 latents a CTA, eight warps 4 × 2 of 32 × 32, two CTAs an SM; prefills) walks every partition, then rounds its
// sums; the narrow one (32 × 16, two warps of 16 × 16; a decode step's few tokens, where the time
// is streaming down and wide CTAs would leave most SMs idle) takes one partition a CTA (grid z =
// XP_P) and leaves f32 sums that kvq_xquant_project_reduce adds in the same order. Either way a
// token's latents do not depend on the batch it came in.
//
// The including unit defines IO (X's dtype, kvq/common.cuh), XD (d_model), XR (the latent width,
// a multiple of 32) and XP_P (XD a multiple of 64·XP_P). Grid (ceil(n / Tile::M), 2·XR / Tile::N,
// 1 or XP_P), block Tile::THREADS, dynamic shared memory Tile::SMEM_BYTES; a Tile::STAGES-deep
// cp.async pipeline.
static_assert(XD % (64 * XP_P) == 0 && XR % 32 == 0, "d_model in whole partitions of chunks, whole column tiles");

template <int M_, int N_, int WARPS_M_, int WARPS_N_, int K_, int STAGES_>
struct XpTile {
    static constexpr int M = M_, N = N_, K = K_, STAGES = STAGES_, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_;
    static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    static constexpr int MT = M / WARPS_M / 16, NT = N / WARPS_N / 8;   // mma tiles a warp
    static constexpr int LD = K + 8;                                    // staged row stride (halves)
    static constexpr int STAGE_HALVES = (M + 2 * N) * LD;               // X's rows, down's two parts
    static constexpr int TOTALS = MT * NT * 4;                          // a thread's latent sums
    // The stages, then the sums of the partitions done so far (shared memory, not registers: the
    // wide tile's accumulators already fill most of a thread's registers).
    static constexpr int SMEM_BYTES = STAGES * STAGE_HALVES * 2 + TOTALS * THREADS * 4;
    static_assert(MT >= 1 && NT % 2 == 0 && XD % (K * XP_P) == 0 && K % 16 == 0, "whole mma tiles and chunks");
};
using XpWide = XpTile<128, 64, 4, 2, 32, 3>;
using XpNarrow = XpTile<32, 16, 2, 1, 64, 6>;

// D += A·B, m16n8k16 in X's format (f16 or bf16), f32 accumulators.
static __device__ __forceinline__ void xp_mma(float (&c)[4], const kvq_u32 (&a)[4], kvq_u32 b0, kvq_u32 b1) {
    if constexpr (IO == KvqDtype::F16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 { %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global → shared, asynchronously; `bytes` 0 fills zeros (rows past the tokens).
static __device__ __forceinline__ void xp_cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

// Chunk `chunk` of X's rows and down's columns into stage `stage`, 16-byte pieces spread over the
// threads.
template <class T>
static __device__ __forceinline__ void xp_load(unsigned stages, int stage, int chunk, const kvq_u16* x, int n, int row0,
                                               const kvq_u16* down_hi, const kvq_u16* down_lo, int col0) {
    constexpr int PER_ROW = T::K / 8;
    const unsigned base = stages + stage * T::STAGE_HALVES * 2;
    const int k0 = chunk * T::K;
    for (int i = threadIdx.x; i < T::M * PER_ROW; i += T::THREADS) {
        const int r = i / PER_ROW, k = (i % PER_ROW) * 8;
        const bool live = row0 + r < n;
        xp_cp_async16(base + (r * T::LD + k) * 2, x + (long)(live ? row0 + r : 0) * XD + k0 + k, live ? 16 : 0);
    }
    for (int i = threadIdx.x; i < 2 * T::N * PER_ROW; i += T::THREADS) {
        const int part = i / (T::N * PER_ROW), c = (i / PER_ROW) % T::N, k = (i % PER_ROW) * 8;
        const kvq_u16* src = (part == 0 ? down_hi : down_lo) + (long)(col0 + c) * XD + k0 + k;
        xp_cp_async16(base + ((T::M + part * T::N + c) * T::LD + k) * 2, src, 16);
    }
}

template <class T>
static __device__ __forceinline__ void kvq_xquant_project(const kvq_u16* __restrict__ x, int n,
                                                          const kvq_u16* __restrict__ down_hi,
                                                          const kvq_u16* __restrict__ down_lo,
                                                          kvq_u16* __restrict__ lat_k, kvq_u16* __restrict__ lat_v,
                                                          float* __restrict__ partial) {
    extern __shared__ __align__(16) kvq_u16 xp_smem[];
    constexpr int PART_CHUNKS = XD / T::K / XP_P;   // chunks a partition
    // One partition (grid z = XP_P) or all of them.
    const bool split = gridDim.z > 1;
    const int c_begin = split ? blockIdx.z * PART_CHUNKS : 0;
    const int c_end = split ? c_begin + PART_CHUNKS : XP_P * PART_CHUNKS;
    const unsigned stages = kvq_smem_u32(xp_smem);
    const int row0 = blockIdx.x * T::M, col0 = blockIdx.y * T::N;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int wm = warp / T::WARPS_N, wn = warp % T::WARPS_N;
    // ldmatrix row addresses (bytes into a stage): A rows at k (lane / 16)·8; B's columns (rows
    // of the staged part) at k ((lane / 8) % 2)·8, two 8-column tiles an x4.
    unsigned a_at[T::MT], b_at[2][T::NT / 2];
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
        a_at[mt] = (((wm * T::MT + mt) * 16 + lane % 16) * T::LD + (lane / 16) * 8) * 2;
#pragma unroll
    for (int part = 0; part < 2; ++part)
#pragma unroll
        for (int p = 0; p < T::NT / 2; ++p)
            b_at[part][p] = ((T::M + part * T::N + (wn * T::NT + 2 * p) * 8 + (lane / 16) * 8 + lane % 8) * T::LD +
                             ((lane / 8) % 2) * 8) * 2;
    // Sum j of this thread at total[j·THREADS + thread]: conflict-free, and only its own.
    float* const total = (float*)(xp_smem + T::STAGES * T::STAGE_HALVES) + threadIdx.x;
    float acc[T::MT][T::NT][4];
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < T::NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

#pragma unroll
    for (int s = 0; s < T::STAGES - 1; ++s) {
        if (c_begin + s < c_end) xp_load<T>(stages, s, c_begin + s, x, n, row0, down_hi, down_lo, col0);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    for (int kc = c_begin; kc < c_end; ++kc) {
        const int i = kc - c_begin;
        asm volatile("cp.async.wait_group %0;" ::"n"(T::STAGES - 2) : "memory");
        __syncthreads();
        if (kc + T::STAGES - 1 < c_end)
            xp_load<T>(stages, (i + T::STAGES - 1) % T::STAGES, kc + T::STAGES - 1, x, n, row0, down_hi, down_lo, col0);
        asm volatile("cp.async.commit_group;" ::: "memory");
        const unsigned stage = stages + (i % T::STAGES) * T::STAGE_HALVES * 2;
#pragma unroll
        for (int ks = 0; ks < T::K; ks += 16) {
            kvq_u32 a[T::MT][4], b[2][T::NT / 2][4];
#pragma unroll
            for (int mt = 0; mt < T::MT; ++mt) kvq_ldsm_x4(a[mt], stage + a_at[mt] + ks * 2);
#pragma unroll
            for (int part = 0; part < 2; ++part)
#pragma unroll
                for (int p = 0; p < T::NT / 2; ++p) kvq_ldsm_x4(b[part][p], stage + b_at[part][p] + ks * 2);
#pragma unroll
            for (int part = 0; part < 2; ++part)
#pragma unroll
                for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < T::NT; ++nt)
                        xp_mma(acc[mt][nt], a[mt], b[part][nt / 2][2 * (nt % 2)], b[part][nt / 2][2 * (nt % 2) + 1]);
        }
        // A partition's end: its sums join the total (the CTA's first partition is the total).
        if ((i + 1) % PART_CHUNKS == 0) {
            const bool first = i + 1 == PART_CHUNKS;
#pragma unroll
            for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < T::NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float& t = total[((mt * T::NT + nt) * 4 + e) * T::THREADS];
                        t = first ? acc[mt][nt][e] : t + acc[mt][nt][e];
                        acc[mt][nt][e] = 0.f;
                    }
        }
    }
    // Rows g and g + 8 of each 16-row tile, columns 2·tq and 2·tq + 1 of each 8-column tile.
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < T::NT; ++nt) {
            const int c = col0 + (wn * T::NT + nt) * 8 + 2 * tq;
            kvq_u16* const dst = c < XR ? lat_k + c : lat_v + (c - XR);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = row0 + (wm * T::MT + mt) * 16 + g + 8 * half;
                if (r >= n) continue;
                const float v0 = total[((mt * T::NT + nt) * 4 + 2 * half) * T::THREADS];
                const float v1 = total[((mt * T::NT + nt) * 4 + 2 * half + 1) * T::THREADS];
                if (split)
                    *(float2*)(partial + ((long)blockIdx.z * n + r) * 2 * XR + c) = make_float2(v0, v1);
                else
                    *(kvq_u32*)(dst + (long)r * XR) = (kvq_u32)kvq_f32_to_f16(v0) | ((kvq_u32)kvq_f32_to_f16(v1) << 16);
            }
        }
}

// The partitions' f32 sums [XP_P][n][2·XR] added in order, then rounded to the latent rows: a thread a
// latent, grid ceil(n·2·XR / 256) of 256 threads.
static __device__ __forceinline__ void kvq_xquant_project_reduce(const float* __restrict__ partial, int n,
                                                                 kvq_u16* __restrict__ lat_k, kvq_u16* __restrict__ lat_v) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x, all = (long)n * 2 * XR;
    if (i >= all) return;
    float t = partial[i];
#pragma unroll
    for (int p = 1; p < XP_P; ++p) t = t + partial[p * all + i];
    const long r = i / (2 * XR);
    const int c = (int)(i % (2 * XR));
    if (c < XR) lat_k[r * XR + c] = kvq_f32_to_f16(t);
    else lat_v[r * XR + c - XR] = kvq_f32_to_f16(t);
}
