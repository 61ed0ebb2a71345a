/* A minimal engine-side program against kvq.h: make a plan, print what to allocate, and show how a
 * refused scheme or limit reads. Build (after `cargo build -p kvq-capi --release`):
 *
 *   cc -I crates/kvq-capi/include crates/kvq-capi/examples/plan.c \
 *      -L target/release -lkvq_capi -Wl,-rpath,target/release -o plan
 *   ./plan kivi2 128
 *
 * Arguments: a scheme (built-in name or scheme text; default kivi2) and head_dim (default 128).
 * Prints one `key value` line per fact, then the buffers, then the two refused plans. */
#include <stdio.h>
#include <stdlib.h>

#include "kvq.h"

/* Prints a failed call's status and message; returns 1 so main can count failures. */
static int report(const char *what, KvqStatus status) {
    fprintf(stderr, "%s: %s: %s\n", what, kvq_status_name(status), kvq_last_error_message());
    return 1;
}

int main(int argc, char **argv) {
    const char *scheme = argc > 1 ? argv[1] : "kivi2";
    KvqPlanLimits limits = {
        .head_dim = argc > 2 ? (uint32_t)atoi(argv[2]) : 128,
        .q_heads = 32,
        .kv_heads = 8,
        .dtype = KVQ_DTYPE_F16,
        .max_seqs = 16,
        .max_seq_len = 32768,
        .pool_pages = 16 * 256,
        .max_q_len = 1,
    };
    KvqPlan *plan = NULL;
    KvqStatus status = kvq_plan_create(scheme, &limits, &plan);
    if (status != KVQ_STATUS_OK) return report("kvq_plan_create", status);

    KvqPlanInfo info;
    if ((status = kvq_plan_info(plan, &info)) != KVQ_STATUS_OK) return report("kvq_plan_info", status);
    printf("version %s\n", kvq_version());
    printf("scheme %s\n", kvq_plan_scheme(plan));
    printf("page_tokens %u\n", info.page_tokens);
    printf("max_pages_per_seq %u\n", info.max_pages_per_seq);
    printf("page_bytes %llu\n", (unsigned long long)info.page_bytes);
    printf("state_bytes_per_seq %llu\n", (unsigned long long)info.state_bytes_per_seq);
    printf("total_bytes %llu\n", (unsigned long long)info.total_bytes);

    uint32_t count = 0;
    if ((status = kvq_plan_buffer_count(plan, &count)) != KVQ_STATUS_OK)
        return report("kvq_plan_buffer_count", status);
    unsigned long long sum = 0;
    for (uint32_t i = 0; i < count; i++) {
        KvqBuffer b;
        if ((status = kvq_plan_buffer(plan, i, &b)) != KVQ_STATUS_OK)
            return report("kvq_plan_buffer", status);
        printf("buffer %s %llu align %llu\n", b.name, (unsigned long long)b.bytes,
               (unsigned long long)b.alignment);
        sum += b.bytes;
    }
    printf("buffers_sum %llu\n", sum);
    KvqBuffer past;
    status = kvq_plan_buffer(plan, count, &past);
    printf("past_the_end %s\n", kvq_status_name(status));
    kvq_plan_destroy(plan);

    /* Refusals: a misspelt scheme, and heads that do not divide. */
    KvqPlan *none = NULL;
    status = kvq_plan_create("k = int(3, chanel), v = int(2, token)", &limits, &none);
    printf("bad_scheme %s %s\n", kvq_status_name(status), none == NULL ? "null" : "set");
    printf("bad_scheme_message %s\n", kvq_last_error_message());
    limits.kv_heads = 6;
    status = kvq_plan_create(scheme, &limits, &none);
    printf("bad_heads %s %s\n", kvq_status_name(status), none == NULL ? "null" : "set");
    printf("bad_heads_message %s\n", kvq_last_error_message());
    return 0;
}
