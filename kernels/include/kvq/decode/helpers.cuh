#pragma once
// PTX helpers, vector loads and code pairs: a word of 1- to 8-bit codes as exact f16 pairs.

// ---- small PTX helpers (header-free)
static __device__ __forceinline__ kvq_u32 kvq_prmt(kvq_u32 a, kvq_u32 b, kvq_u32 sel) {
    kvq_u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
static __device__ __forceinline__ kvq_u32 kvq_h2_sub(kvq_u32 a, kvq_u32 b) {
    kvq_u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
static __device__ __forceinline__ kvq_u32 kvq_h2_mul(kvq_u32 a, kvq_u32 b) {
    kvq_u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
static __device__ __forceinline__ kvq_u32 kvq_h2_fma(kvq_u32 a, kvq_u32 b, kvq_u32 c) {
    kvq_u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// (a & MASK) | c in one lop3: written as C, ptxas emits an AND and an OR, since a SASS lop3 holds
// only one immediate (it cost 256 instructions per 64-token 2-bit chunk, 13% of the kernel).
template <kvq_u32 MASK>
static __device__ __forceinline__ kvq_u32 kvq_and_or(kvq_u32 a, kvq_u32 c) {
    kvq_u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(c));
    return d;
}
// The same with the mask in a register (one that differs by lane).
static __device__ __forceinline__ kvq_u32 kvq_and_or(kvq_u32 a, kvq_u32 mask, kvq_u32 c) {
    kvq_u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(c));
    return d;
}
// f16x2 from two f32 (lo in the low half), round to nearest.
static __device__ __forceinline__ kvq_u32 kvq_h2_pack(float lo, float hi) {
    kvq_u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
// f16x2 constant of (±2^e, ±2^e).
static __host__ __device__ constexpr kvq_u32 kvq_h2_pow2(int e, bool negative) {
    return ((((kvq_u32)(15 + e)) << 10) | (negative ? 0x8000u : 0u)) * 0x10001u;
}
// f16x2 constant of (v, v) for an integer 1 <= v < 2048 (exact in f16).
static __host__ __device__ constexpr kvq_u32 kvq_h2_int(int v) {
    int e = 0;
    while ((2 << e) <= v) ++e;
    return ((((kvq_u32)(15 + e)) << 10) | (((kvq_u32)v << (10 - e)) & 0x3ffu)) * 0x10001u;
}
static constexpr kvq_u32 KVQ_H2_SIGN = 0x80008000u;
static constexpr kvq_u32 KVQ_H2_ONE = 0x3c003c00u;    // f16x2 (1, 1)
// A value as an array of one: how a single head tile meets the helpers that take one per tile (HT).
template <class T>
static __device__ __forceinline__ T (&kvq_one(T& x))[1] { return *reinterpret_cast<T (*)[1]>(&x); }
// D += A·B, m16n8k16, f16 inputs, f32 accumulators.
static __device__ __forceinline__ void kvq_mma(float (&c)[4], kvq_u32 a0, kvq_u32 a1, kvq_u32 a2, kvq_u32 a3,
                                               kvq_u32 b0, kvq_u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 { %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// D += A·B, m16n8k8 on TF32: the f32 registers as they are, of which the tensor cores read the
// top 19 bits (sign, exponent, 10 of the mantissa's bits).
static __device__ __forceinline__ void kvq_mma_tf32(float (&c)[4], kvq_u32 a0, kvq_u32 a1, kvq_u32 a2, kvq_u32 a3,
                                                    kvq_u32 b0, kvq_u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 { %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Transposes an 8x8 matrix of 16-bit values held as mma fragments (row lane/4, cols 2(lane%4)+{0,1}).
static __device__ __forceinline__ kvq_u32 kvq_trans8x8(kvq_u32 x) {
    kvq_u32 y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}
// Named barrier `id` (1 to 15) among `threads` threads of the CTA.
static __device__ __forceinline__ void kvq_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Shared-memory address of a generic pointer into shared memory, and a 16-byte asynchronous copy to it.
static __device__ __forceinline__ unsigned kvq_smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
static __device__ __forceinline__ void kvq_cp_async16(unsigned dst, const kvq_u8* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// Four 8x8 matrices of 16-bit values from shared memory as mma fragments: lane l gives the row
// address of matrix l / 8, row l % 8, and receives row l / 4, columns 2(l % 4) + {0, 1} of each.
static __device__ __forceinline__ void kvq_ldsm_x4(kvq_u32 (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
static __device__ __forceinline__ float kvq_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Asks L2 for the 128-byte lines of [p, p + bytes), spread over the warp's lanes: the chunks a warp
// will read next are in flight while it computes the current one, at no register cost.
static __device__ __forceinline__ void kvq_prefetch(const void* p, int bytes, int lane) {
    const unsigned long long a = (unsigned long long)p;
    const unsigned long long base = a & ~127ull;
    const int span = (int)(a - base) + bytes;
    for (int o = lane * 128; o < span; o += 32 * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(base + o));
}

// Loads BYTES (a power of two, aligned to min(BYTES, 16)) into 32-bit words; 2 bytes fill a low
// half, 1 byte the low byte.
template <int BYTES>
static __device__ __forceinline__ void kvq_load(const kvq_u8* p, kvq_u32* w) {
    if constexpr (BYTES >= 16) {
#pragma unroll
        for (int i = 0; i < BYTES / 16; ++i) {
            const uint4 x = ((const uint4*)p)[i];
            w[4 * i] = x.x; w[4 * i + 1] = x.y; w[4 * i + 2] = x.z; w[4 * i + 3] = x.w;
        }
    } else if constexpr (BYTES == 8) {
        const uint2 x = *(const uint2*)p;
        w[0] = x.x; w[1] = x.y;
    } else if constexpr (BYTES == 4) {
        w[0] = *(const kvq_u32*)p;
    } else if constexpr (BYTES == 2) {
        w[0] = *(const kvq_u16*)p;
    } else {
        w[0] = *p;
    }
}

// Words [W0, W0 + N) of this lane's row of a staged query table (N a multiple of 4).
template <int W0, int N, class T>
static __device__ __forceinline__ void kvq_query_read(const T& t, int lane, kvq_u32* out) {
    static_assert(W0 % 4 == 0 && N % 4 == 0, "whole 16-byte groups");
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        const uint4 x = *(const uint4*)&t.w[W0 / 4 + i][lane][0];
        out[4 * i] = x.x; out[4 * i + 1] = x.y; out[4 * i + 2] = x.z; out[4 * i + 3] = x.w;
    }
}

// Codes -> exact f16 pairs. A 32-bit word is two 16-bit halves; pair i is (code i of the low half,
// code i of the high half) minus OFF, so PER_WORD = 16 / BITS pairs per word. `(w & mask) | 0x6400`
// is 1024 + m·code in f16 (m = 2^position), and one exact f16x2 fma maps it back to code − OFF.
// SUB (V_SUBNORMAL): the field masked in place, not ORed, is the f16 subnormal 2^(POS−24)·code,
// exact, in one AND with no offset to remove (the `fma` was 128 of a 2-bit chunk's instructions);
// each channel's codes then sum in units of 2^(POS−24) from 0, which `kvq_chunk_pv` centres per
// chunk and the epilogue undoes.
// A half may hold fewer codes (an odd half of a K block: kvq_pair_lo, kvq_spread_half_word; a
// V half of shares smaller than a half: kvq_share_at): `get` then takes only its first N pairs.
template <int BITS, int OFF>
struct KvqPairs {
    static constexpr int PER_WORD = 16 / BITS;
    // Pair for the field at bit `pos` of each half (1024 + 2^pos·code): exact code − OFF.
    template <int POS, bool SUB>
    static __device__ __forceinline__ kvq_u32 field(kvq_u32 w) {
        constexpr kvq_u32 mask = (((1u << BITS) - 1u) << POS) * 0x10001u;
        if constexpr (SUB) return w & mask;
        const kvq_u32 v = kvq_and_or<mask>(w, KVQ_MAGIC);
        if constexpr (POS == 0) return kvq_h2_sub(v, kvq_h2_int(1024 + OFF));
        else return kvq_h2_fma(v, kvq_h2_pow2(-POS, false), kvq_h2_int((1024 >> POS) + OFF) ^ KVQ_H2_SIGN);
    }
    // Field Q of a half sits at bit Q·BITS; `get` reads it at bit POS of the half shifted right
    // by SHIFT, so that every field's POS stays within the magic number's exact range.
    template <int Q>
    static constexpr int SHIFT = BITS == 4 ? (Q >= 2 ? 8 : 0) : BITS == 2 ? (Q >= 5 ? 10 : 0) : BITS == 1 ? (Q >= 10 ? 10 : 0) : 0;
    template <bool SUB, int N, int Q = 0>
    static __device__ __forceinline__ void fields(kvq_u32 w, kvq_u32* o) {
        if constexpr (Q < N) {
            o[Q] = field<Q * BITS - SHIFT<Q>, SUB>(w >> SHIFT<Q>);
            fields<SUB, N, Q + 1>(w, o);
        }
    }
    template <bool SUB = false, int N = PER_WORD>
    static __device__ __forceinline__ void get(kvq_u32 w, kvq_u32* o) {
        static_assert(!SUB || BITS <= 4, "subnormal pairs hold 1-, 2- or 4-bit codes");
        static_assert(N == PER_WORD || (BITS <= 4 && N > 0 && N < PER_WORD), "a half holds a half of codes, or its first N");
        if constexpr (BITS == 16) {
            o[0] = w;
        } else if constexpr (BITS == 8) {
            constexpr kvq_u32 sub = kvq_h2_int(1024 + OFF);
            o[0] = kvq_h2_sub(kvq_prmt(w, 0x64646464u, 0x4240u), sub);
            o[1] = kvq_h2_sub(kvq_prmt(w, 0x64646464u, 0x4341u), sub);
        } else {
            fields<SUB, N>(w, o);
        }
    }
};
// f16x2 of halves `lo` and `hi` of a word array.
static __device__ __forceinline__ kvq_u32 kvq_half_pair(const kvq_u32* w, int lo, int hi) {
    const kvq_u32 sel = ((lo & 1) ? 0x32u : 0x10u) | (((hi & 1) ? 0x76u : 0x54u) << 8);
    return kvq_prmt(w[lo >> 1], w[hi >> 1], sel);
}
