extern "C" __global__ void probe(const unsigned short* A, const unsigned short* B, float* D) {
    const int lane = threadIdx.x, g = lane / 4, r = lane % 4;
    const int cs = blockIdx.x;
    A += cs * 256; B += cs * 128; D += cs * 128;
    auto pk = [](unsigned short lo, unsigned short hi) { return (unsigned)lo | ((unsigned)hi << 16); };
    unsigned a0 = pk(A[g * 16 + 2 * r], A[g * 16 + 2 * r + 1]);
    unsigned a1 = pk(A[(g + 8) * 16 + 2 * r], A[(g + 8) * 16 + 2 * r + 1]);
    unsigned a2 = pk(A[g * 16 + 2 * r + 8], A[g * 16 + 2 * r + 9]);
    unsigned a3 = pk(A[(g + 8) * 16 + 2 * r + 8], A[(g + 8) * 16 + 2 * r + 9]);
    unsigned b0 = pk(B[(2 * r) * 8 + g], B[(2 * r + 1) * 8 + g]);
    unsigned b1 = pk(B[(2 * r + 8) * 8 + g], B[(2 * r + 9) * 8 + g]);
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    D[g * 8 + 2 * r] = c[0]; D[g * 8 + 2 * r + 1] = c[1];
    D[(g + 8) * 8 + 2 * r] = c[2]; D[(g + 8) * 8 + 2 * r + 1] = c[3];
}
