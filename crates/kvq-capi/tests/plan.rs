//! Plans through the C entry points: what they accept, what they refuse and with which status.

use std::ffi::{c_char, CStr, CString};
use std::ptr;

use kvq::codegen::{
    decode_slow_path, has_codebook_kernel, has_decode_kernel, has_xquant_kernel, Dtype, KernelShape,
};
use kvq::runtime::{CacheConfig, CacheSizes};
use kvq::schemes::BUILTIN;
use kvq_capi::*;

fn limits(head_dim: u32) -> KvqPlanLimits {
    KvqPlanLimits {
        head_dim,
        q_heads: 32,
        kv_heads: 8,
        dtype: KVQ_DTYPE_F16,
        max_seqs: 4,
        max_seq_len: 8192,
        pool_pages: 256,
        max_q_len: 1,
        rope_theta: 0.0,
        d_model: 0,
    }
}

/// `kvq_plan_create` on `scheme` and `limits`: the plan, or the status and message.
fn create(scheme: &str, limits: &KvqPlanLimits) -> Result<*mut KvqPlan, (KvqStatus, String)> {
    let text = CString::new(scheme).unwrap();
    let mut plan = 0x1 as *mut KvqPlan; // not null: the call must clear it on failure
    let status = unsafe { kvq_plan_create(text.as_ptr(), limits, &mut plan) };
    if status == KvqStatus::Ok {
        assert!(!plan.is_null());
        Ok(plan)
    } else {
        assert!(plan.is_null(), "a failed create left *out set");
        Err((status, last_message()))
    }
}

fn last_message() -> String {
    unsafe { CStr::from_ptr(kvq_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn every_gpu_builtin_plans_every_fast_head_dim_with_the_runtime_sizes() {
    for b in BUILTIN.iter().filter(|b| has_decode_kernel(&b.spec)) {
        for d in (64..=256).step_by(16) {
            let shape = KernelShape::new(d, 4, Dtype::F16);
            let slow = decode_slow_path(&b.spec, &shape);
            match (create(b.name, &limits(d)), slow) {
                (Ok(plan), None) => {
                    let (mut info, mut count) = (unsafe { std::mem::zeroed() }, 0u32);
                    assert_eq!(unsafe { kvq_plan_info(plan, &mut info) }, KvqStatus::Ok);
                    assert_eq!(
                        unsafe { kvq_plan_buffer_count(plan, &mut count) },
                        KvqStatus::Ok
                    );
                    let cfg = CacheConfig {
                        kv_heads: 8,
                        head_dim: d as usize,
                        max_seqs: 4,
                        pool_pages: 256,
                        max_tokens: 8192,
                        input_dtype: Dtype::F16,
                    };
                    let sizes = CacheSizes::new(&b.spec, &cfg).unwrap();
                    let mut sum = 0;
                    for i in 0..count {
                        let mut buf: KvqBuffer = unsafe { std::mem::zeroed() };
                        assert_eq!(unsafe { kvq_plan_buffer(plan, i, &mut buf) }, KvqStatus::Ok);
                        assert_eq!(buf.alignment, KVQ_BUFFER_ALIGNMENT);
                        sum += buf.bytes;
                    }
                    let fp16 = sizes.fp16_state_bytes() as u64;
                    let pools = (sizes.k_pool_bytes + sizes.v_pool_bytes) as u64;
                    // Lengths (an i32 a slot) and the block table (an i32 a page a slot).
                    let tables = 4 * (4 + sizes.page_table_entries) as u64;
                    assert_eq!(sum, pools + fp16 + tables, "{} d{d}", b.name);
                    assert_eq!(info.total_bytes, sum);
                    assert_eq!(info.page_bytes * 256, pools);
                    assert_eq!(info.state_bytes_per_seq * 4, fp16);
                    assert_eq!(info.max_pages_per_seq as usize, sizes.max_pages);
                    unsafe { kvq_plan_destroy(plan) };
                }
                (Err((status, message)), Some(why)) => {
                    assert_eq!(status, KvqStatus::UnsupportedShape, "{message}");
                    assert!(message.contains(&why.to_string()), "{message}");
                }
                (Ok(_), Some(why)) => panic!("{} d{d} planned on a slow path ({why})", b.name),
                (Err(e), None) => panic!("{} d{d} refused: {e:?}", b.name),
            }
        }
    }
}

#[test]
fn schemes_without_a_gpu_kernel_are_unsupported_schemes() {
    // Every built-in scheme has kernels on this surface now; custom schemes may not.
    for b in BUILTIN {
        assert!(
            has_decode_kernel(&b.spec)
                || has_codebook_kernel(&b.spec)
                || has_xquant_kernel(&b.spec),
            "{}",
            b.name
        );
    }
    // Calibrated scores over latents: a valid scheme the XQuant decode does not serve.
    let calibrated_latents = "k = int(2, channel), v = int(2, channel), \
                              calibrate = calibrate(tau1 = -1.5, tau2 = 3.25), source = x(latent)";
    let x = KvqPlanLimits {
        rope_theta: 500_000.0,
        d_model: 4096,
        ..limits(128)
    };
    let (status, message) = create(calibrated_latents, &x).unwrap_err();
    assert_eq!(status, KvqStatus::UnsupportedScheme, "{message}");
    assert!(message.contains("no GPU kernel"), "{message}");
}

#[test]
fn bad_scheme_text_and_names_are_invalid_schemes() {
    let (status, message) = create("kivi9", &limits(128)).unwrap_err();
    assert_eq!(status, KvqStatus::InvalidScheme);
    assert!(
        message.contains("kivi2") && message.contains("kitty"),
        "{message}"
    );
    let (status, message) =
        create("k = int(2, channel), v = int(2, tokn)", &limits(128)).unwrap_err();
    assert_eq!(status, KvqStatus::InvalidScheme);
    assert!(message.contains("tokn"), "{message}");
}

#[test]
fn shapes_off_the_fast_kernels_are_unsupported_shapes() {
    for (d, says) in [(100, "head_dim"), (48, "head_dim"), (272, "head_dim")] {
        let (status, message) = create("kivi2", &limits(d)).unwrap_err();
        assert_eq!(status, KvqStatus::UnsupportedShape, "d{d}: {message}");
        assert!(message.contains(says), "d{d}: {message}");
    }
    // Valid, but codes of a width the tensor-core kernel does not read: refused, never served by
    // the generic kernel behind the engine's back.
    let (status, message) =
        create("k = int(3, channel), v = int(2, token)", &limits(128)).unwrap_err();
    assert_eq!(status, KvqStatus::UnsupportedShape, "{message}");
    assert!(
        message.contains("3-bit codes") && message.contains("no tensor-core kernel"),
        "{message}"
    );
    let mut many_heads = limits(128);
    (many_heads.q_heads, many_heads.kv_heads) = (129, 1);
    let (status, message) = create("kivi2", &many_heads).unwrap_err();
    assert_eq!(status, KvqStatus::UnsupportedShape);
    assert!(message.contains("129 query heads"), "{message}");
}

#[test]
fn bad_limits_are_invalid_arguments_that_name_the_field() {
    type Spoil = fn(&mut KvqPlanLimits);
    let cases: [(&str, Spoil); 5] = [
        ("limits.max_seqs is 0", |l| l.max_seqs = 0),
        ("limits.pool_pages is 0", |l| l.pool_pages = 0),
        ("limits.head_dim is 0", |l| l.head_dim = 0),
        ("limits.dtype is 7", |l| l.dtype = 7),
        ("not a multiple of limits.kv_heads (5)", |l| l.kv_heads = 5),
    ];
    for (says, spoil) in cases {
        let mut l = limits(128);
        spoil(&mut l);
        let (status, message) = create("kivi2", &l).unwrap_err();
        assert_eq!(status, KvqStatus::InvalidArgument, "{message}");
        assert!(message.contains(says), "{message}");
    }
    let mut bf16 = limits(128);
    bf16.dtype = KVQ_DTYPE_BF16;
    unsafe { kvq_plan_destroy(create("kivi2", &bf16).unwrap()) };
}

#[test]
fn null_and_non_utf8_arguments_are_errors_not_crashes() {
    let l = limits(128);
    let text = c"kivi2";
    let mut plan = ptr::null_mut();
    let status = unsafe { kvq_plan_create(ptr::null(), &l, &mut plan) };
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert_eq!(last_message(), "scheme is NULL");
    let status = unsafe { kvq_plan_create(text.as_ptr(), ptr::null(), &mut plan) };
    assert_eq!(
        (status, last_message().as_str()),
        (KvqStatus::InvalidArgument, "limits is NULL")
    );
    let status = unsafe { kvq_plan_create(text.as_ptr(), &l, ptr::null_mut()) };
    assert_eq!(
        (status, last_message().as_str()),
        (KvqStatus::InvalidArgument, "out is NULL")
    );
    let latin1 = [0xE9u8, 0];
    let status = unsafe { kvq_plan_create(latin1.as_ptr() as *const c_char, &l, &mut plan) };
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(last_message().contains("not UTF-8"), "{}", last_message());

    let mut info: KvqPlanInfo = unsafe { std::mem::zeroed() };
    assert_eq!(
        unsafe { kvq_plan_info(ptr::null(), &mut info) },
        KvqStatus::InvalidArgument
    );
    let plan = create("kivi2", &l).unwrap();
    assert_eq!(
        unsafe { kvq_plan_info(plan, ptr::null_mut()) },
        KvqStatus::InvalidArgument
    );
    assert_eq!(
        unsafe { kvq_plan_buffer_count(plan, ptr::null_mut()) },
        KvqStatus::InvalidArgument
    );
    let mut buf: KvqBuffer = unsafe { std::mem::zeroed() };
    assert_eq!(
        unsafe { kvq_plan_buffer(plan, 14, &mut buf) },
        KvqStatus::InvalidArgument
    );
    assert!(
        last_message().contains("buffer index 14"),
        "{}",
        last_message()
    );
    assert!(unsafe { kvq_plan_scheme(ptr::null()) }.is_null());
    unsafe { kvq_plan_destroy(plan) };
    unsafe { kvq_plan_destroy(ptr::null_mut()) };
}

#[test]
fn a_plan_names_its_scheme_and_is_shared_between_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<KvqPlan>();
    let plan = KvqPlan::new(
        "k = int(4, channel), v = int(2, token), sink = 8",
        &limits(80),
    )
    .unwrap();
    let text = plan.spec().to_string();
    assert!(text.contains("sink = 8"), "{text}");
    let infos: Vec<KvqPlanInfo> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(|| plan.info())).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(infos.iter().all(|i| *i == plan.info()));
    assert_eq!(plan.info().sink_tokens, 8);
}

#[test]
fn the_largest_limits_plan_or_are_refused_never_wrapped() {
    let mut l = limits(256);
    (l.max_seqs, l.max_seq_len, l.pool_pages) = (u32::MAX, u32::MAX, u32::MAX);
    let plan = KvqPlan::new("kivi2", &l).expect("these sizes fit 64 bits");
    let s = plan.sizes();
    assert_eq!(
        plan.info().page_bytes,
        (s.k_block_bytes + s.v_block_bytes) as u64 * 8
    );
    assert!(plan.info().total_bytes > u64::from(u32::MAX) * plan.info().page_bytes);
    (l.q_heads, l.kv_heads) = (u32::MAX / 128 * 128, u32::MAX / 128);
    let (status, message) = create("kivi2", &l).unwrap_err();
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(message.contains("would take more than"), "{message}");
}

/// Codebook schemes (CommVQ, custom codebooks) plan without a GPU: the device layout's sizes, the
/// four buffers of their own, and the limits they cannot serve refused with what to change.
#[test]
fn codebook_plans_size_their_buffers_and_refuse_what_they_cannot_serve() {
    use kvq::reference::commvq::device::DeviceLayout;
    use kvq::runtime::codebook::CodebookBufferLayout;
    let rope = KvqPlanLimits {
        rope_theta: 500_000.0,
        ..limits(128)
    };
    let plan = create("commvq1", &rope).unwrap();
    let plan_ref = unsafe { &*plan };
    let spec = kvq::schemes::by_name("commvq1").unwrap().spec;
    let layout = DeviceLayout::new(&spec, 8, 128).unwrap();
    let info = plan_ref.info();
    assert_eq!(info.k_block_bytes as usize, layout.k.block_bytes);
    assert_eq!(info.v_block_bytes as usize, layout.v.block_bytes);
    assert_eq!(info.page_tokens as usize, layout.page);
    let bytes = |i: usize| plan_ref.buffer(i).unwrap().bytes as usize;
    assert_eq!(bytes(0), 256 * 8 * layout.k.block_bytes);
    // Pending rings beside the FP16 tails, the same size; one status line a slot.
    assert_eq!(bytes(8), bytes(4));
    assert_eq!(bytes(9), bytes(5));
    assert!(bytes(8) > 0);
    assert_eq!(bytes(10), 4 * 4 * 4);
    assert_eq!(bytes(11), CodebookBufferLayout::new(&layout).bytes);
    // CommVQ-1's coded pages are about an eighth of FP16's.
    assert!(
        info.page_bytes < (2 * 128 * 8 * 128 * 2 / 6) as u64,
        "{info:?}"
    );
    unsafe { kvq_plan_destroy(plan) };

    let (status, message) = create("commvq1", &limits(128)).unwrap_err();
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(message.contains("rope_theta"), "{message}");
    let (status, message) = create(
        "commvq1",
        &KvqPlanLimits {
            max_q_len: 2,
            ..rope
        },
    )
    .unwrap_err();
    assert_eq!(status, KvqStatus::UnsupportedShape);
    assert!(message.contains("max_q_len"), "{message}");
    let (status, message) = create(
        "commvq1",
        &KvqPlanLimits {
            rope_theta: f64::NAN,
            ..rope
        },
    )
    .unwrap_err();
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(message.contains("rope_theta"), "{message}");
    // Values only coded, keys FP16: no RoPE base needed.
    let plan = create(
        "k = fp16, v = codebook(additive, rows = 128), sink = 8",
        &limits(64),
    )
    .unwrap();
    assert_eq!(
        unsafe { &*plan }.buffer(8).unwrap().bytes,
        0,
        "FP16 keys have no pending ring"
    );
    unsafe { kvq_plan_destroy(plan) };
}

/// XQuant plans (`source = x(latent)`) plan without a GPU: the latent store sized as the integer
/// plan of its latents at `rank / store_width` heads, the packed projections' buffer, and what
/// they need (d_model, the RoPE base, one query token) refused with what to change.
#[test]
fn xquant_plans_size_the_latent_store_and_refuse_what_they_cannot_serve() {
    use kvq::codegen::latent_spec;
    use kvq::runtime::xquant::XQuantWeightsLayout;
    let x = KvqPlanLimits {
        rope_theta: 500_000.0,
        d_model: 4096,
        ..limits(128)
    };
    let plan = create("xquant2", &x).unwrap();
    let plan_ref = unsafe { &*plan };
    let spec = kvq::schemes::by_name("xquant2").unwrap().spec;
    // 8 KV heads of 128 from 4096: latents of 1024 in store heads of the scheme's width.
    let sizes = plan_ref.xquant_sizes().unwrap();
    assert_eq!(sizes.store_heads * sizes.store_width, 1024);
    let latent = CacheSizes::new(
        &latent_spec(&spec),
        &CacheConfig {
            kv_heads: sizes.store_heads,
            head_dim: sizes.store_width,
            max_seqs: 4,
            pool_pages: 256,
            max_tokens: 8192,
            input_dtype: Dtype::F16,
        },
    )
    .unwrap();
    let xquant2_bytes: Vec<usize> = (0..plan_ref.buffer_count())
        .map(|i| plan_ref.buffer(i).unwrap().bytes as usize)
        .collect();
    let bytes = |i: usize| xquant2_bytes[i];
    assert_eq!(bytes(0), latent.k_pool_bytes);
    assert_eq!(bytes(5), 2 * latent.v_tail_halves);
    assert_eq!(
        bytes(12),
        XQuantWeightsLayout::new(8, 128, 4096, false).unwrap().bytes
    );
    // up_k three times (two halves and the K groups) and up_v: at least 4 × 1024 × 1024 × 2 bytes.
    assert!(bytes(12) >= 8 << 20);
    for i in [8, 9, 10, 11, 13] {
        assert_eq!(bytes(i), 0, "buffer {i}");
    }
    let info = plan_ref.info();
    assert_eq!(
        info.page_bytes as usize,
        sizes.store_heads * (latent.k_block_bytes + latent.v_block_bytes)
    );
    // Two 2-bit latents of 1024 a token (as wide as K at GQA) against K and V of 8 × 128 in
    // FP16: an eighth, and the scales and zeros.
    assert!(
        info.page_bytes < (2 * 128 * 8 * 128 * 2 / 6) as u64,
        "{info:?}"
    );
    unsafe { kvq_plan_destroy(plan) };
    let bytes = |i: usize| xquant2_bytes[i];

    for (change, status, names) in [
        (
            KvqPlanLimits { d_model: 0, ..x },
            KvqStatus::InvalidArgument,
            "d_model",
        ),
        (
            KvqPlanLimits {
                rope_theta: 0.0,
                ..x
            },
            KvqStatus::InvalidArgument,
            "rope_theta",
        ),
        (
            KvqPlanLimits { max_q_len: 2, ..x },
            KvqStatus::UnsupportedShape,
            "max_q_len",
        ),
    ] {
        let (got, message) = create("xquant4", &change).unwrap_err();
        assert_eq!(got, status, "{message}");
        assert!(message.contains(names), "{message}");
    }
    // XQuant-CL plans add the accumulator's latents (f16 K and V a token slot) and the lift
    // matrix (f32 [2R][d_model]) to the projections.
    let plan = create("xquant-cl2", &x).unwrap();
    let cl = unsafe { &*plan };
    let cl_bytes = |i: usize| cl.buffer(i).unwrap().bytes as usize;
    assert_eq!(cl_bytes(13), 2 * 4 * 8192 * 1024 * 2);
    assert_eq!(
        cl_bytes(12),
        XQuantWeightsLayout::new(8, 128, 4096, true).unwrap().bytes
    );
    assert_eq!(cl_bytes(12) - bytes(12), 4 * 2 * 1024 * 4096);
    assert_eq!(cl_bytes(0), bytes(0));
    unsafe { kvq_plan_destroy(plan) };
    // Its accumulator rows are indexed in 32 bits.
    let wide = KvqPlanLimits {
        max_seqs: 1 << 16,
        max_seq_len: 1 << 16,
        pool_pages: 1 << 20,
        ..x
    };
    let (got, message) = create("xquant-cl2", &wide).unwrap_err();
    assert_eq!(got, KvqStatus::InvalidArgument, "{message}");
    assert!(message.contains("32-bit"), "{message}");
    // A custom latent scheme plans too.
    let plan = create(
        "k = int(4, channel), v = int(2, token), sink = 16, source = x(latent)",
        &x,
    )
    .unwrap();
    unsafe { kvq_plan_destroy(plan) };
}
