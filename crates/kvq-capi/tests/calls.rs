//! The calls that run on a GPU, as far as a machine without one (or without its driver) can take
//! them: arguments are checked before the driver is touched, and a missing driver or GPU is
//! `KVQ_STATUS_CUDA` with a message, never a crash. tests/gpu.rs runs them on a GPU.

use std::ffi::{c_void, CStr, CString};
use std::ptr;

use kvq_capi::*;

fn plan() -> KvqPlan {
    let limits = KvqPlanLimits {
        head_dim: 128,
        q_heads: 32,
        kv_heads: 8,
        dtype: KVQ_DTYPE_F16,
        max_seqs: 4,
        max_seq_len: 4096,
        pool_pages: 64,
        max_q_len: 4,
        rope_theta: 0.0,
        d_model: 0,
    };
    KvqPlan::new("kivi2", &limits).unwrap()
}

fn last_message() -> String {
    unsafe { CStr::from_ptr(kvq_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Whether this machine's driver loads and has a GPU.
fn has_gpu() -> bool {
    kvq::runtime::device_count().is_ok_and(|n| n > 0)
}

/// `kvq_merge` on the legacy stream with `parts` parts of 4 rows, fake (never dereferenced)
/// buffers and `out` as given; the status and this thread's message.
fn merge_fake(plan: *const KvqPlan, parts: u32, out: *mut c_void) -> (KvqStatus, String) {
    let fake = 0x1000 as *mut c_void;
    let status = unsafe {
        kvq_merge(
            plan,
            ptr::null_mut(),
            fake,
            fake.cast(),
            parts,
            4,
            out,
            ptr::null_mut(),
        )
    };
    (status, last_message())
}

#[test]
fn merge_arguments_are_checked_before_the_driver() {
    let plan = plan();
    let fake = 0x1000 as *mut c_void;
    let (status, message) = merge_fake(&plan, 0, fake);
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(message.contains("parts is 0"), "{message}");
    let (status, message) = merge_fake(&plan, 2, ptr::null_mut());
    assert_eq!(
        (status, message.as_str()),
        (KvqStatus::InvalidArgument, "out is NULL")
    );
    let (status, message) = merge_fake(ptr::null(), 2, fake);
    assert_eq!(
        (status, message.as_str()),
        (KvqStatus::InvalidArgument, "plan is NULL")
    );
}

#[test]
fn without_a_driver_or_gpu_the_calls_say_so() {
    if has_gpu() {
        return; // tests/gpu.rs covers this machine
    }
    let plan = plan();
    let status = unsafe { kvq_plan_load(&plan, 0) };
    assert_eq!(status, KvqStatus::Cuda, "{}", last_message());
    let message = last_message();
    assert!(
        message.contains("libcuda") || message.contains("GPU"),
        "the message names what is missing: {message}"
    );
    let (status, message) = merge_fake(&plan, 2, 0x1000 as *mut c_void);
    assert_eq!(status, KvqStatus::Cuda, "{message}");
    assert_eq!(
        unsafe { kvq_plan_load(&plan, -1) },
        KvqStatus::InvalidArgument
    );
    assert!(last_message().contains("device -1"), "{}", last_message());
}

/// A cache of fake device pointers (never dereferenced: every case below fails before a launch).
fn fake_cache() -> KvqCache {
    let fake = 0x1000 as *mut c_void;
    KvqCache {
        k_pool: fake,
        v_pool: fake,
        k_sink: fake,
        v_sink: fake,
        k_tail: fake,
        v_tail: fake,
        seq_lens: fake,
        page_table: fake,
        k_pending: fake,
        v_pending: fake,
        status: fake,
        codebooks: fake,
        xquant_weights: fake,
        xquant_accumulator: fake,
    }
}

/// `kvq_prefill` of `slots`/`tokens` on fake buffers: the status and this thread's message.
fn prefill_fake(
    plan: &KvqPlan,
    cache: &KvqCache,
    slots: &[i32],
    tokens: &[u32],
) -> (KvqStatus, String) {
    let fake = 0x1000 as *mut c_void;
    let status = unsafe {
        kvq_prefill(
            plan,
            cache,
            ptr::null_mut(),
            slots.len() as u32,
            slots.as_ptr(),
            tokens.as_ptr(),
            fake,
            fake,
            fake,
        )
    };
    (status, last_message())
}

#[test]
fn step_arguments_are_checked_before_the_driver() {
    let plan = plan();
    let cache = fake_cache();
    let bad = |(status, message): (KvqStatus, String), needle: &str| {
        assert_eq!(status, KvqStatus::InvalidArgument, "{message}");
        assert!(message.contains(needle), "{needle:?} in {message:?}");
    };
    bad(prefill_fake(&plan, &cache, &[4], &[10]), "slots[0] = 4");
    bad(prefill_fake(&plan, &cache, &[-1], &[10]), "slots[0] = -1");
    bad(
        prefill_fake(&plan, &cache, &[0], &[4097]),
        "longer than the plan's max_seq_len",
    );
    bad(
        prefill_fake(&plan, &cache, &[1, 1], &[3, 4]),
        "slot 1 appears twice",
    );
    bad(
        prefill_fake(&plan, &cache, &[0; 5], &[1; 5]),
        "more than the plan's max_seqs",
    );
    let mut no_table = cache;
    no_table.page_table = ptr::null_mut();
    bad(
        prefill_fake(&plan, &no_table, &[0], &[1]),
        "cache->page_table is NULL",
    );
    let mut no_lens = cache;
    no_lens.seq_lens = ptr::null_mut();
    bad(
        prefill_fake(&plan, &no_lens, &[0], &[1]),
        "cache->seq_lens is NULL",
    );
    let fake = 0x1000 as *mut c_void;
    let attend = |n: u32, q_len: u32, out: *mut c_void| {
        let status = unsafe {
            kvq_attend(
                &plan,
                &cache,
                ptr::null_mut(),
                n,
                q_len,
                fake.cast(),
                fake,
                out,
                ptr::null_mut(),
                fake,
            )
        };
        (status, last_message())
    };
    bad(attend(2, 1, ptr::null_mut()), "out is NULL");
    bad(
        attend(9, 1, fake),
        "9 sequences, more than the plan's max_seqs (4)",
    );
    bad(
        attend(2, 0, fake),
        "q_len 0 (expected 1 up to the plan's max_q_len, 4)",
    );
    bad(attend(2, 5, fake), "q_len 5");
    let append = |cache: *const KvqCache, q_len: u32| {
        let status = unsafe {
            kvq_append(
                &plan,
                cache,
                ptr::null_mut(),
                1,
                q_len,
                fake.cast(),
                fake,
                fake,
            )
        };
        (status, last_message())
    };
    bad(append(ptr::null(), 1), "cache is NULL");
    bad(append(&cache, 5), "kvq_append: q_len 5");
}

#[test]
fn limits_on_query_tokens_are_checked() {
    let mut limits = *plan().limits();
    limits.max_q_len = 0;
    let err = KvqPlan::new("kivi2", &limits).unwrap_err();
    assert!(
        err.message.contains("limits.max_q_len is 0"),
        "{}",
        err.message
    );
    limits.max_q_len = 5000;
    let err = KvqPlan::new("kivi2", &limits).unwrap_err();
    assert!(
        err.message.contains("longer than limits.max_seq_len"),
        "{}",
        err.message
    );
}

#[test]
fn a_plan_lists_the_lengths_and_the_block_table() {
    let plan = plan();
    let info = plan.info();
    let names: Vec<String> = (0..plan.buffer_count())
        .map(|i| {
            let b = plan.buffer(i).unwrap();
            unsafe { CStr::from_ptr(b.name) }
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(
        names,
        [
            "k_pool",
            "v_pool",
            "k_sink",
            "v_sink",
            "k_tail",
            "v_tail",
            "seq_lens",
            "page_table",
            "k_pending",
            "v_pending",
            "status",
            "codebooks",
            "xquant_weights",
            "xquant_accumulator"
        ]
    );
    // An integer scheme needs none of the codebook or XQuant schemes' buffers.
    for i in 8..14 {
        assert_eq!(plan.buffer(i).unwrap().bytes, 0);
    }
    assert_eq!(plan.buffer(6).unwrap().bytes, 4 * 4);
    assert_eq!(
        plan.buffer(7).unwrap().bytes,
        4 * 4 * u64::from(info.max_pages_per_seq)
    );
}

/// 8 KV heads of 128 (32 query heads), 4 slots of 4,096 tokens, a RoPE base: the limits of the
/// plans whose kernels rotate keys themselves.
fn rope_limits() -> KvqPlanLimits {
    KvqPlanLimits {
        head_dim: 128,
        q_heads: 32,
        kv_heads: 8,
        dtype: KVQ_DTYPE_F16,
        max_seqs: 4,
        max_seq_len: 4096,
        pool_pages: 256,
        max_q_len: 1,
        rope_theta: 500_000.0,
        d_model: 0,
    }
}

/// Codebook plans' calls refuse what they cannot take before touching a GPU: a plain append or
/// prefill where keys are coded before RoPE, codebooks for a plan without any, a missing or wrong
/// codebook file; `kvq_cache_check` on an integer plan has nothing to report.
#[test]
fn codebook_calls_refuse_bad_arguments_without_a_gpu() {
    let limits = rope_limits();
    let commvq = KvqPlan::new("commvq1", &limits).unwrap();
    let cache = fake_cache();
    let fake = 0x1000 as *const c_void;
    let status = unsafe {
        kvq_append(
            &commvq,
            &cache,
            ptr::null_mut(),
            2,
            1,
            fake.cast(),
            fake,
            fake,
        )
    };
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(
        last_message().contains("kvq_append_prerope"),
        "{}",
        last_message()
    );
    let (status, message) = prefill_fake(&commvq, &cache, &[0], &[5]);
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(message.contains("kvq_prefill_prerope"), "{message}");
    let status = unsafe {
        kvq_append_prerope(
            &commvq,
            &cache,
            ptr::null_mut(),
            2,
            2,
            fake.cast(),
            fake,
            fake,
            fake,
        )
    };
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(last_message().contains("q_len 2"), "{}", last_message());

    let missing = CString::new("/nonexistent/kvq-books.safetensors").unwrap();
    let status = unsafe { kvq_codebooks_load(&commvq, &cache, ptr::null_mut(), missing.as_ptr()) };
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(
        last_message().contains("codebook file"),
        "{}",
        last_message()
    );
    let junk = [0u8; 64];
    let status = unsafe {
        kvq_codebooks_load_bytes(&commvq, &cache, ptr::null_mut(), junk.as_ptr(), junk.len())
    };
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(last_message().contains("safetensors"), "{}", last_message());

    let kivi = KvqPlan::new(
        "kivi2",
        &KvqPlanLimits {
            rope_theta: 0.0,
            ..limits
        },
    )
    .unwrap();
    let status = unsafe { kvq_codebooks_load(&kivi, &cache, ptr::null_mut(), missing.as_ptr()) };
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(
        last_message().contains("no codebooks"),
        "{}",
        last_message()
    );
    assert_eq!(
        unsafe { kvq_cache_check(&kivi, &cache, ptr::null_mut()) },
        KvqStatus::Ok
    );
}

/// XQuant's writes refuse, before touching a GPU, a call of the other source (the message names
/// the call to make), a NULL X̂ and a step past the plan's slots.
#[test]
fn xquant_writes_refuse_the_other_source_without_a_gpu() {
    let limits = KvqPlanLimits {
        d_model: 1024,
        ..rope_limits()
    };
    let cl = KvqPlan::new("xquant-cl2", &limits).unwrap();
    let latent = KvqPlan::new("xquant2", &limits).unwrap();
    let cache = fake_cache();
    let (f, none, stream) = (0x1000 as *mut c_void, ptr::null_mut(), ptr::null_mut());
    let (slots, tokens) = ([0i32].as_ptr(), [8u32].as_ptr());
    let expect = |status: KvqStatus, want: &str| {
        let message = unsafe { CStr::from_ptr(kvq_last_error_message()) }.to_string_lossy();
        assert_eq!(status, KvqStatus::InvalidArgument, "{want}: {message}");
        assert!(message.contains(want), "{want}: {message}");
    };
    unsafe {
        let s = kvq_xquant_append(&cl, &cache, stream, 1, f.cast(), f, f);
        expect(s, "call kvq_xquant_append_cross_layer");
        let s = kvq_xquant_prefill(&cl, &cache, stream, 1, slots, tokens, f, f);
        expect(s, "call kvq_xquant_prefill_cross_layer");
        let s = kvq_xquant_append_cross_layer(&latent, &cache, stream, 1, f.cast(), f, f, f);
        expect(s, "call kvq_xquant_append with X");
        let s = kvq_xquant_prefill_cross_layer(&latent, &cache, stream, 1, slots, tokens, f, f, f);
        expect(s, "call kvq_xquant_prefill with X");
        let s = kvq_xquant_append_cross_layer(&cl, &cache, stream, 1, f.cast(), f, none, f);
        expect(s, "x_hat is NULL");
        let s = kvq_xquant_prefill_cross_layer(&cl, &cache, stream, 1, slots, tokens, f, none, f);
        expect(s, "x_hat is NULL");
        let s = kvq_xquant_append_cross_layer(&cl, &cache, stream, 5, f.cast(), f, f, f);
        expect(s, "more than the plan's max_seqs");
    }
}
