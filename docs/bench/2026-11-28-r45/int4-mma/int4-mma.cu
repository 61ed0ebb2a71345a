// Does sm_90a run a 4-bit integer mma natively? One m16n8k64 .u4.s4 mma.sync in a loop.
// python3 compile.py int4-mma.cu int4-mma.cubin (NVRTC 13.0, --gpu-architecture=sm_90a), then
// nvdisasm -c int4-mma.cubin: ptxas unpacks the nibbles into bytes (LOP3, SHF) and issues two
// IMMA.16832.U8.S8 per mma, so Hopper's densest native integer mma operand is 8 bits.
extern "C" __global__ void k(const unsigned* a, const unsigned* b, int* c) {
    int t = threadIdx.x;
    unsigned a0 = a[t], a1 = a[t + 32], b0 = b[t];
    int d0 = 0, d1 = 0, d2 = 0, d3 = 0;
    for (int i = 0; i < 8; ++i) {
        asm volatile("mma.sync.aligned.m16n8k64.row.col.s32.u4.s4.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+r"(d0), "+r"(d1), "+r"(d2), "+r"(d3) : "r"(a0), "r"(a1), "r"(a0^b0), "r"(a1+1), "r"(b0), "r"(b0*7));
        a0 = a0 * 3 + 1; b0 ^= a1;
    }
    c[t] = d0 + d1 + d2 + d3;
}
