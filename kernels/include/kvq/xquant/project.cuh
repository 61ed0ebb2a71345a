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
// X is exact in its format. Each latent is a sum over d_model in a fixed order (chunks of XP_K,
// hi before lo), whatever the rows beside it: a token's latents do not depend on the batch.
//
// The including unit defines IO (X's dtype, kvq/common.cuh), XD (d_model, a multiple of 32) and
// XR (the latent width, a multiple of 32). Grid (ceil(n / XP_M), 2·XR / XP_N), block XP_THREADS:
// four warps, each 16 rows × the CTA's XP_N columns.
static_assert(XD % 32 == 0 && XR % 32 == 0, "d_model and the latent width in whole chunks");

static constexpr int XP_THREADS = 128;
static constexpr int XP_M = 64;          // rows (tokens) a CTA
static constexpr int XP_N = 32;          // latent columns a CTA
static constexpr int XP_K = 32;          // d_model a chunk
static constexpr int XP_LD = XP_K + 8;   // staged row stride (halves): fragments' rows on distinct banks
static constexpr int XP_NT = XP_N / 8;   // 8-column mma tiles a warp

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

static __device__ __forceinline__ void kvq_xquant_project(const kvq_u16* __restrict__ x, int n,
                                                          const kvq_u16* __restrict__ down_hi,
                                                          const kvq_u16* __restrict__ down_lo,
                                                          kvq_u16* __restrict__ lat_k, kvq_u16* __restrict__ lat_v) {
    __shared__ __align__(16) kvq_u16 s_x[XP_M * XP_LD];
    __shared__ __align__(16) kvq_u16 s_b[2][XP_N * XP_LD];
    const int row0 = blockIdx.x * XP_M, col0 = blockIdx.y * XP_N;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    float acc[XP_NT][4];
#pragma unroll
    for (int nt = 0; nt < XP_NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    for (int k0 = 0; k0 < XD; k0 += XP_K) {
        // X's chunk: XP_M rows × XP_K halves, 16 bytes a piece (rows past n are zeros).
        for (int i = threadIdx.x; i < XP_M * XP_K / 8; i += XP_THREADS) {
            const int r = i / (XP_K / 8), k = (i % (XP_K / 8)) * 8;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (row0 + r < n) v = *(const uint4*)(x + (long)(row0 + r) * XD + k0 + k);
            *(uint4*)(s_x + r * XP_LD + k) = v;
        }
        // down's chunk: XP_N columns × XP_K, both parts.
        for (int i = threadIdx.x; i < 2 * XP_N * XP_K / 8; i += XP_THREADS) {
            const int part = i / (XP_N * XP_K / 8), j = i % (XP_N * XP_K / 8);
            const int c = j / (XP_K / 8), k = (j % (XP_K / 8)) * 8;
            const kvq_u16* src = (part == 0 ? down_hi : down_lo) + (long)(col0 + c) * XD + k0 + k;
            *(uint4*)(s_b[part] + c * XP_LD + k) = *(const uint4*)src;
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < XP_K; ks += 16) {
            const kvq_u16* ar = s_x + (warp * 16 + g) * XP_LD + ks + 2 * tq;
            const kvq_u32 a[4] = {*(const kvq_u32*)ar, *(const kvq_u32*)(ar + 8 * XP_LD), *(const kvq_u32*)(ar + 8),
                                  *(const kvq_u32*)(ar + 8 * XP_LD + 8)};
#pragma unroll
            for (int part = 0; part < 2; ++part)
#pragma unroll
                for (int nt = 0; nt < XP_NT; ++nt) {
                    const kvq_u16* br = s_b[part] + (nt * 8 + g) * XP_LD + ks + 2 * tq;
                    xp_mma(acc[nt], a, *(const kvq_u32*)br, *(const kvq_u32*)(br + 8));
                }
        }
        __syncthreads();
    }
    // Rows g and g + 8 of the warp's 16, columns 2·tq and 2·tq + 1 of each 8-column tile.
#pragma unroll
    for (int nt = 0; nt < XP_NT; ++nt) {
        const int c = col0 + nt * 8 + 2 * tq;
        kvq_u16* const dst = c < XR ? lat_k + c : lat_v + (c - XR);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row0 + warp * 16 + g + 8 * half;
            if (r < n) {
                const kvq_u32 pair = (kvq_u32)kvq_f32_to_f16(acc[nt][2 * half]) |
                                     ((kvq_u32)kvq_f32_to_f16(acc[nt][2 * half + 1]) << 16);
                *(kvq_u32*)(dst + (long)r * XR) = pair;
            }
        }
    }
}
