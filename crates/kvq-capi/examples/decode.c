/* A minimal C engine decoding through kvq on its own memory and stream: a plan, the plan's buffers
 * from cuMemAlloc, a block table, prompts stored with kvq_prefill, then decode steps of
 * kvq_append + kvq_attend, each output checked against attention computed on the host. Build (after
 * `cargo build -p kvq-capi --release`; CUDA_INC is the folder with cuda.h, e.g. from
 * `source .ci/cuda-env.sh`):
 *
 *   cc -std=c99 -I crates/kvq-capi/include -I "$CUDA_INC" crates/kvq-capi/examples/decode.c \
 *      -L target/release -lkvq_capi -Wl,-rpath,target/release -l:libcuda.so.1 -lm -o decode
 *   ./decode [scheme]        # default fp16; any built-in's name or scheme text
 *
 * Prints each step's relative error against the host and exits 0 when the FP16 scheme stays within
 * bf16 rounding (a quantized scheme's error is printed, not judged). */
#include <cuda.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvq.h"

#define CU(call)                                                                     \
    do {                                                                             \
        CUresult r_ = (call);                                                        \
        if (r_ != CUDA_SUCCESS) {                                                    \
            const char *s_ = "?";                                                    \
            cuGetErrorString(r_, &s_);                                               \
            fprintf(stderr, "%s: %s\n", #call, s_);                                  \
            return 1;                                                                \
        }                                                                            \
    } while (0)
#define KVQ(call)                                                                    \
    do {                                                                             \
        KvqStatus s_ = (call);                                                       \
        if (s_ != KVQ_STATUS_OK) {                                                   \
            fprintf(stderr, "%s: %s: %s\n", #call, kvq_status_name(s_),              \
                    kvq_last_error_message());                                       \
            return 1;                                                                \
        }                                                                            \
    } while (0)

enum { D = 128, KV = 2, GQA = 4, QH = KV * GQA, SEQS = 2, PROMPT = 300, STEPS = 20 };
enum { TOKENS = PROMPT + STEPS, ROW = KV * D };

/* bf16 <-> f32: the upper half of the f32 bits, rounded to nearest even. */
static uint16_t to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
static float from_bf16(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}
/* A fixed pseudo-random value in [-1, 1), as bf16. */
static uint16_t noise(unsigned *state) {
    *state = *state * 1664525u + 1013904223u;
    return to_bf16((float)(*state >> 8) / 8388608.0f - 1.0f);
}

/* Host attention of one query row (QH heads) over a sequence's first n tokens, into want. */
static void attend_host(const uint16_t *q, const uint16_t *k, const uint16_t *v, int n,
                        double *want) {
    static double scores[TOKENS];
    for (int h = 0; h < QH; h++) {
        const int kvh = h / GQA;
        double m = -INFINITY, z = 0.0;
        for (int t = 0; t < n; t++) {
            double s = 0.0;
            for (int c = 0; c < D; c++)
                s += (double)from_bf16(q[h * D + c]) * from_bf16(k[(t * KV + kvh) * D + c]);
            scores[t] = s / sqrt((double)D);
            if (scores[t] > m) m = scores[t];
        }
        for (int t = 0; t < n; t++) z += exp(scores[t] - m);
        for (int c = 0; c < D; c++) {
            double o = 0.0;
            for (int t = 0; t < n; t++)
                o += exp(scores[t] - m) / z * from_bf16(v[(t * KV + kvh) * D + c]);
            want[h * D + c] = o;
        }
    }
}

int main(int argc, char **argv) {
    const char *scheme = argc > 1 ? argv[1] : "fp16";
    /* The engine's side: the device's primary context (the one kvq and PyTorch use) and a stream. */
    CUdevice dev;
    CUcontext ctx;
    CUstream stream;
    CU(cuInit(0));
    CU(cuDeviceGet(&dev, 0));
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));

    KvqPlanLimits limits = {.head_dim = D, .q_heads = QH, .kv_heads = KV,
                            .dtype = KVQ_DTYPE_BF16, .max_seqs = SEQS, .max_seq_len = 1024,
                            .pool_pages = 1, .max_q_len = 1};
    KvqPlan *plan = NULL;
    KVQ(kvq_plan_create(scheme, &limits, &plan));
    KvqPlanInfo info;
    KVQ(kvq_plan_info(plan, &info));
    kvq_plan_destroy(plan);
    /* Enough pages for every slot's whole block table, mapped slot by slot. */
    limits.pool_pages = SEQS * info.max_pages_per_seq;
    KVQ(kvq_plan_create(scheme, &limits, &plan));
    KVQ(kvq_plan_load(plan, 0));

    CUdeviceptr bufs[14];
    uint32_t count = 0;
    KVQ(kvq_plan_buffer_count(plan, &count));
    for (uint32_t i = 0; i < count && i < 14; i++) {
        KvqBuffer b;
        KVQ(kvq_plan_buffer(plan, i, &b));
        CU(cuMemAlloc(&bufs[i], b.bytes > 0 ? b.bytes : 1));
        CU(cuMemsetD8Async(bufs[i], 0, b.bytes > 0 ? b.bytes : 1, stream));
    }
    KvqCache cache = {(void *)bufs[0], (void *)bufs[1], (void *)bufs[2],  (void *)bufs[3],
                      (void *)bufs[4], (void *)bufs[5], (void *)bufs[6],  (void *)bufs[7],
                      (void *)bufs[8], (void *)bufs[9], (void *)bufs[10], (void *)bufs[11],
                      (void *)bufs[12], (void *)bufs[13]};
    int32_t table[SEQS * 1024];
    for (uint32_t e = 0; e < SEQS * info.max_pages_per_seq; e++) table[e] = (int32_t)e;
    CU(cuMemcpyHtoDAsync(bufs[7], table, sizeof(int32_t) * SEQS * info.max_pages_per_seq, stream));
    uint64_t ws_bytes = 0;
    KVQ(kvq_plan_workspace_bytes(plan, 0, &ws_bytes));
    CUdeviceptr workspace;
    CU(cuMemAlloc(&workspace, ws_bytes));

    /* Every token's K and V on the host, [seq][token][kv_head][D], for the checks. */
    static uint16_t k[SEQS][TOKENS * ROW], v[SEQS][TOKENS * ROW];
    unsigned state = 1;
    for (int s = 0; s < SEQS; s++)
        for (int i = 0; i < TOKENS * ROW; i++) {
            k[s][i] = noise(&state);
            v[s][i] = noise(&state);
        }
    /* Prefill: both prompts packed back to back. */
    static uint16_t packed_k[SEQS * PROMPT * ROW], packed_v[SEQS * PROMPT * ROW];
    for (int s = 0; s < SEQS; s++) {
        memcpy(packed_k + s * PROMPT * ROW, k[s], sizeof(uint16_t) * PROMPT * ROW);
        memcpy(packed_v + s * PROMPT * ROW, v[s], sizeof(uint16_t) * PROMPT * ROW);
    }
    CUdeviceptr dk, dv, dq, dout, dslots, dnew_k, dnew_v;
    CU(cuMemAlloc(&dk, sizeof packed_k));
    CU(cuMemAlloc(&dv, sizeof packed_v));
    CU(cuMemcpyHtoDAsync(dk, packed_k, sizeof packed_k, stream));
    CU(cuMemcpyHtoDAsync(dv, packed_v, sizeof packed_v, stream));
    const int32_t slots[SEQS] = {0, 1};
    const uint32_t tokens[SEQS] = {PROMPT, PROMPT};
    KVQ(kvq_prefill(plan, &cache, stream, SEQS, slots, tokens, (void *)dk, (void *)dv,
                    (void *)workspace));

    CU(cuMemAlloc(&dslots, sizeof slots));
    CU(cuMemcpyHtoDAsync(dslots, slots, sizeof slots, stream));
    CU(cuMemAlloc(&dnew_k, sizeof(uint16_t) * SEQS * ROW));
    CU(cuMemAlloc(&dnew_v, sizeof(uint16_t) * SEQS * ROW));
    CU(cuMemAlloc(&dq, sizeof(uint16_t) * SEQS * QH * D));
    CU(cuMemAlloc(&dout, sizeof(uint16_t) * SEQS * QH * D));
    static uint16_t new_k[SEQS * ROW], new_v[SEQS * ROW], q[SEQS * QH * D], out[SEQS * QH * D];
    static double want[QH * D];
    double worst = 0.0;
    for (int step = 0; step < STEPS; step++) {
        const int len = PROMPT + step + 1;
        for (int s = 0; s < SEQS; s++) {
            memcpy(new_k + s * ROW, k[s] + (len - 1) * ROW, sizeof(uint16_t) * ROW);
            memcpy(new_v + s * ROW, v[s] + (len - 1) * ROW, sizeof(uint16_t) * ROW);
        }
        for (int i = 0; i < SEQS * QH * D; i++) q[i] = noise(&state);
        CU(cuMemcpyHtoDAsync(dnew_k, new_k, sizeof new_k, stream));
        CU(cuMemcpyHtoDAsync(dnew_v, new_v, sizeof new_v, stream));
        CU(cuMemcpyHtoDAsync(dq, q, sizeof q, stream));
        KVQ(kvq_append(plan, &cache, stream, SEQS, 1, (const int32_t *)dslots, (void *)dnew_k,
                       (void *)dnew_v));
        KVQ(kvq_attend(plan, &cache, stream, SEQS, 1, (const int32_t *)dslots, (void *)dq,
                       (void *)dout, NULL, (void *)workspace));
        CU(cuMemcpyDtoHAsync(out, dout, sizeof out, stream));
        CU(cuStreamSynchronize(stream));
        for (int s = 0; s < SEQS; s++) {
            attend_host(q + s * QH * D, k[s], v[s], len, want);
            double err = 0.0, norm = 0.0;
            for (int i = 0; i < QH * D; i++) {
                const double d = from_bf16(out[s * QH * D + i]) - want[i];
                err += d * d;
                norm += want[i] * want[i];
            }
            const double rel = sqrt(err / norm);
            if (!(rel <= worst)) worst = rel; /* NaN sticks */
        }
    }
    const int exact = strcmp(scheme, "fp16") == 0;
    printf("%s: %d sequences x (%d + %d) tokens, decoded through kvq; largest relative error "
           "against the host %.2e\n", scheme, SEQS, PROMPT, STEPS, worst);
    kvq_plan_destroy(plan);
    if (exact && !(worst < 1e-2)) return 1;
    printf("ok\n");
    return 0;
}
