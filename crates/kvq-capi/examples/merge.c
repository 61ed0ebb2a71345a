/* kvq_merge from C on the engine's own stream and memory: two partial attention states of the same
 * query rows (in a context-parallel engine, one per GPU, gathered) merged into the whole, checked
 * against the same merge on the host. Build (after `cargo build -p kvq-capi --release`; CUDA_INC is
 * the folder with cuda.h, e.g. from `source .ci/cuda-env.sh`):
 *
 *   cc -std=c99 -I crates/kvq-capi/include -I "$CUDA_INC" crates/kvq-capi/examples/merge.c \
 *      -L target/release -lkvq_capi -Wl,-rpath,target/release -l:libcuda.so.1 -lm -o merge
 *   ./merge
 *
 * Prints the largest error against the host merge and exits 0 when it is within bf16 rounding. */
#include <cuda.h>
#include <math.h>
#include <stdio.h>
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

enum { HEAD_DIM = 128, Q_HEADS = 8, ROWS = Q_HEADS /* one query token */, PARTS = 2 };

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

int main(void) {
    static uint16_t out_parts[PARTS][ROWS][HEAD_DIM], out[ROWS][HEAD_DIM];
    static float lse_parts[PARTS][ROWS], lse[ROWS];
    for (int p = 0; p < PARTS; p++)
        for (int r = 0; r < ROWS; r++) {
            lse_parts[p][r] = 3.0f * sinf((float)(7 * p + r)) + (float)p;
            for (int c = 0; c < HEAD_DIM; c++)
                out_parts[p][r][c] = to_bf16(sinf(0.37f * (float)(c + 11 * r + 101 * p)));
        }
    lse_parts[1][3] = -INFINITY; /* part 1 saw none of row 3's tokens */

    KvqPlanLimits limits = {.head_dim = HEAD_DIM, .q_heads = Q_HEADS, .kv_heads = 2,
                            .dtype = KVQ_DTYPE_BF16, .max_seqs = 1, .max_seq_len = 4096,
                            .pool_pages = 64, .max_q_len = 1};
    KvqPlan *plan = NULL;
    KVQ(kvq_plan_create("kivi2", &limits, &plan));

    /* The engine's side: the device's primary context (as PyTorch uses), a stream, memory. */
    CUdevice dev;
    CUcontext ctx;
    CUstream stream;
    CUdeviceptr d_out_parts, d_lse_parts, d_out, d_lse;
    CU(cuInit(0));
    CU(cuDeviceGet(&dev, 0));
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CU(cuMemAlloc(&d_out_parts, sizeof out_parts));
    CU(cuMemAlloc(&d_lse_parts, sizeof lse_parts));
    CU(cuMemAlloc(&d_out, sizeof out));
    CU(cuMemAlloc(&d_lse, sizeof lse));
    CU(cuMemcpyHtoD(d_out_parts, out_parts, sizeof out_parts));
    CU(cuMemcpyHtoD(d_lse_parts, lse_parts, sizeof lse_parts));

    KVQ(kvq_plan_load(plan, 0)); /* compile now, e.g. before capturing a CUDA graph */
    KVQ(kvq_merge(plan, (void *)stream, (const void *)d_out_parts, (const float *)d_lse_parts,
                  PARTS, ROWS, (void *)d_out, (float *)d_lse));
    CU(cuStreamSynchronize(stream));
    CU(cuMemcpyDtoH(out, d_out, sizeof out));
    CU(cuMemcpyDtoH(lse, d_lse, sizeof lse));

    /* The same merge on the host: weights exp(LSE_p - max), outputs averaged with them. */
    double worst = 0.0, worst_lse = 0.0;
    for (int r = 0; r < ROWS; r++) {
        double m = -INFINITY, total = 0.0;
        for (int p = 0; p < PARTS; p++) m = fmax(m, lse_parts[p][r]);
        for (int p = 0; p < PARTS; p++) total += exp(lse_parts[p][r] - m);
        for (int c = 0; c < HEAD_DIM; c++) {
            double want = 0.0;
            for (int p = 0; p < PARTS; p++)
                want += exp(lse_parts[p][r] - m) * from_bf16(out_parts[p][r][c]);
            want /= total;
            worst = fmax(worst, fabs(from_bf16(out[r][c]) - want) / (fabs(want) + 1e-3));
        }
        worst_lse = fmax(worst_lse, fabs(lse[r] - (m + log(total))));
    }
    printf("merged %d rows of %d parts: largest relative error %.2e, LSE error %.2e\n", ROWS,
           PARTS, worst, worst_lse);
    cuMemFree(d_out_parts);
    cuMemFree(d_lse_parts);
    cuMemFree(d_out);
    cuMemFree(d_lse);
    cuStreamDestroy(stream);
    cuDevicePrimaryCtxRelease(dev);
    kvq_plan_destroy(plan);
    /* bf16 keeps 8 bits: its rounding of the output is at most 2^-8 relative. */
    if (worst > 1.0 / 256 || worst_lse > 1e-4) {
        printf("FAILED\n");
        return 1;
    }
    printf("ok\n");
    return 0;
}
