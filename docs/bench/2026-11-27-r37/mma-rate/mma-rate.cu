// Issue rate of one warp-wide mma.sync shape on an SM: every warp runs ITERS rounds of CHAINS
// independent accumulator chains of one shape; the host divides the mma count by the time.
// Compiled with NVRTC (mma-rate.py); the A and B registers come from the thread index so nothing folds.
#define CHAINS 4
#define ITERS 4096

extern "C" __global__ void hmma_16816(unsigned* out) {
    unsigned a0 = threadIdx.x * 0x00010001u, a1 = a0 ^ 0x3c003c00u, a2 = a0 + 1u, a3 = a1 + 1u, b0 = a0 ^ 0x00400040u, b1 = b0 + 3u;
    float c[CHAINS][4] = {};
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
        for (int k = 0; k < CHAINS; ++k)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    float s = 0.f;
    for (int k = 0; k < CHAINS; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = __float_as_uint(s);
}

extern "C" __global__ void imma_16832(unsigned* out) {
    unsigned a0 = threadIdx.x * 0x01010101u, a1 = a0 ^ 0x5a5a5a5au, a2 = a0 + 7u, a3 = a1 + 9u, b0 = a0 ^ 0x33333333u, b1 = b0 + 5u;
    int c[CHAINS][4] = {};
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
        for (int k = 0; k < CHAINS; ++k)
            asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+r"(c[k][0]), "+r"(c[k][1]), "+r"(c[k][2]), "+r"(c[k][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    int s = 0;
    for (int k = 0; k < CHAINS; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = (unsigned)s;
}

extern "C" __global__ void bmma_168128(unsigned* out) {
    unsigned a0 = threadIdx.x * 0x9e3779b9u, a1 = a0 ^ 0x5a5a5a5au, b0 = a0 ^ 0x33333333u;
    int c[CHAINS][4] = {};
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
        for (int k = 0; k < CHAINS; ++k)
            asm volatile("mma.sync.aligned.m16n8k128.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                         : "+r"(c[k][0]), "+r"(c[k][1]), "+r"(c[k][2]), "+r"(c[k][3])
                         : "r"(a0), "r"(a1), "r"(b0));
    int s = 0;
    for (int k = 0; k < CHAINS; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = (unsigned)s;
}

extern "C" __global__ void bmma_168256(unsigned* out) {
    unsigned a0 = threadIdx.x * 0x9e3779b9u, a1 = a0 ^ 0x5a5a5a5au, a2 = a0 + 7u, a3 = a1 + 9u, b0 = a0 ^ 0x33333333u, b1 = b0 + 5u;
    int c[CHAINS][4] = {};
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
        for (int k = 0; k < CHAINS; ++k)
            asm volatile("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+r"(c[k][0]), "+r"(c[k][1]), "+r"(c[k][2]), "+r"(c[k][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    int s = 0;
    for (int k = 0; k < CHAINS; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = (unsigned)s;
}

// The 1-bit key conversion it would replace, for scale: one LOP3 a pair of codes (f16 subnormals).
extern "C" __global__ void lop3_and(unsigned* out) {
    unsigned w[CHAINS * 4];
#pragma unroll
    for (int k = 0; k < CHAINS * 4; ++k) w[k] = threadIdx.x * (k + 1);
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
        for (int k = 0; k < CHAINS * 4; ++k) asm volatile("lop3.b32 %0, %0, %1, %2, 0x6a;" : "+r"(w[k]) : "r"(0x00010001u << (k & 7)), "r"(it));
    unsigned s = 0;
    for (int k = 0; k < CHAINS * 4; ++k) s ^= w[k];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
