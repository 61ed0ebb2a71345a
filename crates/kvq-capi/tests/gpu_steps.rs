//! The C step calls on a GPU, on memory, a block table and a stream the test owns, as an engine
//! would make them: `kvq_prefill`, then `kvq_append` and `kvq_attend` every step, with the rows'
//! sequence slots permuted and a padding row. Each attend gives the bits (output and LSE) of the
//! Rust paged cache's launch with the same kernel and launch, whose kernels the `kvq` crate's GPU
//! tests check against the CPU reference; a CUDA graph captured once and replayed every step gives
//! the same bits again; and the FP16 scheme matches attention computed on the host. Without a GPU
//! the test shows as ignored, with the reason (`KVQ_REQUIRE_GPU=1` makes that a failure).

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use kvq::codegen::{Dtype, QuantizerForms};
use kvq::runtime::cudarc::driver::{sys, CudaSlice, CudaStream};
use kvq::runtime::tune::synth::{random_queries, word_to_f32};
use kvq::runtime::{CacheConfig, DecodeScratch, Device, Jit, PagedKvCache, SeqId};
use kvq_capi::*;

mod common;

use common::{buffers, ok, ptr};
use kvq_runtime::testing::harness::{needs, run};
use kvq_runtime::testing::Need;

fn main() {
    run(vec![
        needs(
            Need::Gpu,
            "c_steps_equal_the_rust_cache_in_and_out_of_a_graph",
            c_steps_equal_the_rust_cache_in_and_out_of_a_graph,
        ),
        needs(
            Need::Gpu,
            "a_stream_of_another_context_is_refused_and_the_callers_context_kept",
            a_stream_of_another_context_is_refused_and_the_callers_context_kept,
        ),
    ])
}

/// An engine's stream in a context of its own (not the device's primary one, where kvq's kernels
/// live) is refused with `KVQ_STATUS_CUDA` and a message naming the fix, after a call on a
/// primary-context stream has loaded the GPU (so the refusal is not the first lookup's); the
/// thread's current context is the engine's again after each call.
fn a_stream_of_another_context_is_refused_and_the_callers_context_kept() {
    let case = Case {
        scheme: "fp16",
        head_dim: 64,
        dtype: Dtype::F16,
    };
    let plan = KvqPlan::new(case.scheme, &limits(&case, 2, 8, 2, 256, 8)).expect("plan");
    let device = Device::open(0).expect("GPU");
    let primary = device.new_stream().expect("stream");
    let engine = EngineCache::new(&plan, &primary);
    let mut bytes = 0u64;
    ok(
        unsafe { kvq_plan_workspace_bytes(&plan, 0, &mut bytes) },
        "workspace size",
    );
    let workspace = primary.alloc_zeros::<u8>(bytes.max(1) as usize).unwrap();
    let (slots, q) = (
        primary.clone_htod(&[0i32, 1]).unwrap(),
        primary.alloc_zeros::<u16>(2 * Q_LEN * 8 * 64).unwrap(),
    );
    let out = primary.alloc_zeros::<u16>(2 * Q_LEN * 8 * 64).unwrap();
    // The addresses are taken now: cudarc makes the primary context current to hand them out.
    let (slots, q, out, workspace) = (
        ptr(&slots, &primary),
        ptr(&q, &primary),
        ptr(&out, &primary),
        ptr(&workspace, &primary),
    );
    let attend = |stream: *mut c_void| unsafe {
        kvq_attend(
            &plan,
            &engine.cache,
            stream,
            2,
            1,
            slots.cast(),
            q,
            out,
            std::ptr::null_mut(),
            workspace,
        )
    };
    ok(
        attend(primary.cu_stream().cast()),
        "a primary-context stream",
    );
    primary.synchronize().unwrap();
    // SAFETY: plain driver calls on this thread; the context and stream are destroyed below.
    unsafe {
        let mut own: sys::CUcontext = std::ptr::null_mut();
        sys::cuCtxCreate_v4(&mut own, std::ptr::null_mut(), 0, 0)
            .result()
            .expect("cuCtxCreate");
        let mut stream: sys::CUstream = std::ptr::null_mut();
        sys::cuStreamCreate(&mut stream, 0)
            .result()
            .expect("cuStreamCreate");
        let status = attend(stream.cast());
        let message = CStr::from_ptr(kvq_last_error_message()).to_string_lossy();
        let mut current: sys::CUcontext = std::ptr::null_mut();
        sys::cuCtxGetCurrent(&mut current).result().unwrap();
        sys::cuStreamDestroy_v2(stream).result().unwrap();
        sys::cuCtxDestroy_v2(own).result().unwrap();
        assert_eq!(status, KvqStatus::Cuda, "{message}");
        assert!(message.contains("primary context"), "{message}");
        assert_eq!(
            current, own,
            "the engine's context is current after the call"
        );
    }
}

/// One engine-owned cache: the plan's buffers, allocated zeroed.
struct EngineCache {
    /// Owns the memory `cache` points into.
    _buffers: Vec<CudaSlice<u8>>,
    cache: KvqCache,
}

impl EngineCache {
    /// The plan's buffers; the block table maps slot `s`'s logical page `j` to pool page
    /// `pool_pages − 1 − (s·max_pages + j)` (backwards, so a kernel ignoring it reads wrong pages).
    fn new(plan: &KvqPlan, stream: &Arc<CudaStream>) -> EngineCache {
        let (buffers, cache, _) = buffers(plan, stream);
        EngineCache {
            _buffers: buffers,
            cache,
        }
    }
}

/// Random 16-bit words of `dtype` (and their values).
fn words(n: usize, dtype: Dtype, seed: u64) -> (Vec<u16>, Vec<f32>) {
    random_queries(n, dtype, seed).unwrap()
}

struct Case {
    scheme: &'static str,
    head_dim: u32,
    dtype: Dtype,
}

fn c_steps_equal_the_rust_cache_in_and_out_of_a_graph() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.new_stream().expect("stream");
    for case in [
        Case {
            scheme: "kivi2",
            head_dim: 128,
            dtype: Dtype::F16,
        },
        Case {
            scheme: "kivi2",
            head_dim: 80,
            dtype: Dtype::Bf16,
        },
        Case {
            scheme: "calibquant1",
            head_dim: 128,
            dtype: Dtype::F16,
        },
        Case {
            scheme: "kitty",
            head_dim: 128,
            dtype: Dtype::Bf16,
        },
        Case {
            scheme: "int8",
            head_dim: 64,
            dtype: Dtype::F16,
        },
        Case {
            scheme: "fp16",
            head_dim: 128,
            dtype: Dtype::F16,
        },
    ] {
        check_case(&jit, &stream, &case);
    }
}

fn check_case(jit: &Jit, stream: &Arc<CudaStream>, case: &Case) {
    let (kv_heads, gqa, max_seqs, max_len) = (2usize, 4usize, 4usize, 1024usize);
    let (d, dtype) = (case.head_dim as usize, case.dtype);
    let q_heads = kv_heads * gqa;
    let what = format!("{} d{d} {dtype}", case.scheme);
    // Pages for every slot's whole table.
    let probe = KvqPlan::new(
        case.scheme,
        &limits(case, kv_heads, q_heads, max_seqs, max_len, 1),
    )
    .expect("plan");
    let pool_pages = max_seqs * probe.info().max_pages_per_seq as usize;
    let plan = KvqPlan::new(
        case.scheme,
        &limits(case, kv_heads, q_heads, max_seqs, max_len, pool_pages),
    )
    .expect("plan");
    ok(unsafe { kvq_plan_load(&plan, 0) }, "load");
    let mut ws_bytes = 0u64;
    ok(
        unsafe { kvq_plan_workspace_bytes(&plan, 0, &mut ws_bytes) },
        "workspace",
    );
    let kernels = plan_kernels(&gpu(0).unwrap(), &plan).unwrap();

    // The Rust cache: slots 0..3 are rows 0..3; slot 3 stays empty.
    let spec = *plan.spec();
    let cfg = CacheConfig {
        kv_heads,
        head_dim: d,
        max_seqs,
        pool_pages,
        max_tokens: max_len,
        input_dtype: dtype,
    };
    let forms = QuantizerForms::default_for(&spec, d as u32);
    let mut rust = PagedKvCache::with_forms(jit, stream.clone(), &spec, cfg, forms).unwrap();
    let ids: Vec<SeqId> = (0..max_seqs)
        .map(|_| rust.add_sequence().unwrap())
        .collect();

    let direct = EngineCache::new(&plan, stream);
    let graphed = EngineCache::new(&plan, stream);
    let ws_direct = stream.alloc_zeros::<u8>(ws_bytes as usize).unwrap();
    let ws_graph = stream.alloc_zeros::<u8>(ws_bytes as usize).unwrap();
    let ws = |w: &CudaSlice<u8>| ptr(w, stream);
    let raw = |s: &CudaStream| s.cu_stream() as *mut c_void;

    // Prefill: prompts of 300 and 129 tokens into slots 0 and 1; slot 2 starts empty.
    let row = kv_heads * d;
    let prompts = [(0usize, 300usize), (1, 129), (2, 0)];
    let total: usize = prompts.iter().map(|p| p.1).sum();
    let (k_bits, _) = words(total * row, dtype, 1);
    let (v_bits, _) = words(total * row, dtype, 2);
    let (k_in, v_in) = (
        stream.clone_htod(&k_bits).unwrap(),
        stream.clone_htod(&v_bits).unwrap(),
    );
    rust.prefill_packed(&[(ids[0], 300), (ids[1], 129)], &k_in, &v_in, dtype)
        .unwrap();
    let slots: Vec<i32> = prompts.iter().map(|p| p.0 as i32).collect();
    let tokens: Vec<u32> = prompts.iter().map(|p| p.1 as u32).collect();
    for (c, w) in [(&direct, &ws_direct), (&graphed, &ws_graph)] {
        let (k_p, v_p, w_p) = (ptr(&k_in, stream), ptr(&v_in, stream), ws(w));
        // kvq's calls give the thread its current CUDA context back (here: none).
        unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) }
            .result()
            .unwrap();
        let status = unsafe {
            kvq_prefill(
                &plan,
                &c.cache,
                raw(stream),
                3,
                slots.as_ptr(),
                tokens.as_ptr(),
                k_p,
                v_p,
                w_p,
            )
        };
        let mut current: sys::CUcontext = std::ptr::null_mut();
        unsafe { sys::cuCtxGetCurrent(&mut current) }
            .result()
            .unwrap();
        assert!(
            current.is_null(),
            "{what}: kvq_prefill left a context current"
        );
        ok(status, &format!("{what}: prefill"));
    }

    // Every step appends a token to slots 0, 1, 2 (rows in that order) and attends the four
    // rows (slots 2, padding, 0, 1).
    let append_slots = stream.clone_htod(&[0i32, 1, 2]).unwrap();
    let attend_order = [2i32, -1, 0, 1];
    let attend_slots = stream.clone_htod(&attend_order).unwrap();
    let n_attend = attend_order.len();
    let (mut k_new, mut v_new) = (
        stream.alloc_zeros::<u16>(3 * row).unwrap(),
        stream.alloc_zeros::<u16>(3 * row).unwrap(),
    );
    let mut q_rows = stream.alloc_zeros::<u16>(n_attend * q_heads * d).unwrap();
    let poison = vec![0xFFFFu16; n_attend * q_heads * d];
    let mut out_direct = stream.clone_htod(&poison).unwrap();
    let lse_direct = stream
        .clone_htod(&vec![f32::NAN; n_attend * q_heads])
        .unwrap();
    let mut out_graph = stream.clone_htod(&poison).unwrap();
    let lse_graph = stream
        .clone_htod(&vec![f32::NAN; n_attend * q_heads])
        .unwrap();

    // The graph: one step's append and attend on the static buffers above. Their addresses are
    // taken before the capture: cudarc orders a slice's use after its last writer, and inside a
    // capture that wait would tie the graph to work outside it.
    let (append_slots_p, attend_slots_p) = (ptr(&append_slots, stream), ptr(&attend_slots, stream));
    let (k_new_p, v_new_p, q_p) = (
        ptr(&k_new, stream),
        ptr(&v_new, stream),
        ptr(&q_rows, stream),
    );
    let (out_graph_p, lse_graph_p, ws_graph_p) = (
        ptr(&out_graph, stream),
        ptr(&lse_graph, stream),
        ws(&ws_graph),
    );
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let capture = unsafe {
        (
            kvq_append(
                &plan,
                &graphed.cache,
                raw(stream),
                3,
                1,
                append_slots_p.cast(),
                k_new_p,
                v_new_p,
            ),
            kvq_attend(
                &plan,
                &graphed.cache,
                raw(stream),
                n_attend as u32,
                1,
                attend_slots_p.cast(),
                q_p,
                out_graph_p,
                lse_graph_p.cast(),
                ws_graph_p,
            ),
        )
    };
    // End the capture before looking at the calls' statuses (a failed call leaves it open).
    let graph = stream.end_capture(
        sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
    );
    ok(capture.0, &format!("{what}: append in a graph"));
    ok(capture.1, &format!("{what}: attend in a graph"));
    let graph = graph.unwrap().expect("a graph");

    let (splits, pieces) = kernels.launch(n_attend).unwrap();
    let mut scratch =
        DecodeScratch::with_pieces(stream, max_seqs, q_heads, d, splits, pieces).unwrap();
    let mut host_k: Vec<Vec<f32>> = vec![Vec::new(); 3];
    let mut host_v: Vec<Vec<f32>> = vec![Vec::new(); 3];
    // The FP16 check keeps every token on the host.
    for (s, &(_, t)) in prompts.iter().enumerate() {
        let first: usize = prompts[..s].iter().map(|p| p.1).sum();
        for x in &k_bits[first * row..(first + t) * row] {
            host_k[s].push(word_to_f32(*x, dtype));
        }
        for x in &v_bits[first * row..(first + t) * row] {
            host_v[s].push(word_to_f32(*x, dtype));
        }
    }
    let steps = 150;
    let mut checked = 0;
    for step in 1..=steps {
        let (kb, kv) = words(3 * row, dtype, 100 + step);
        let (vb, vv) = words(3 * row, dtype, 200 + step);
        for s in 0..3 {
            host_k[s].extend_from_slice(&kv[s * row..(s + 1) * row]);
            host_v[s].extend_from_slice(&vv[s * row..(s + 1) * row]);
        }
        stream.memcpy_htod(&kb, &mut k_new).unwrap();
        stream.memcpy_htod(&vb, &mut v_new).unwrap();
        // Queries by slot (slot 3, empty in the Rust cache, and the padding row get zeros).
        let (qb, qv) = words(max_seqs * q_heads * d, dtype, 300 + step);
        let mut q_by_row = vec![0u16; n_attend * q_heads * d];
        let per = q_heads * d;
        for (i, &slot) in attend_order.iter().enumerate() {
            if slot >= 0 {
                let s = slot as usize;
                q_by_row[i * per..(i + 1) * per].copy_from_slice(&qb[s * per..(s + 1) * per]);
            }
        }
        stream.memcpy_htod(&q_by_row, &mut q_rows).unwrap();
        let mut q_rust_bits = qb.clone();
        q_rust_bits[3 * per..].fill(0);
        let q_rust = stream.clone_htod(&q_rust_bits).unwrap();

        rust.append(&ids[..3], &k_new, &v_new, dtype).unwrap();
        let status = unsafe {
            kvq_append(
                &plan,
                &direct.cache,
                raw(stream),
                3,
                1,
                ptr(&append_slots, stream).cast(),
                ptr(&k_new, stream),
                ptr(&v_new, stream),
            )
        };
        ok(status, &format!("{what}: append"));
        stream.memcpy_htod(&poison, &mut out_direct).unwrap();
        stream.memcpy_htod(&poison, &mut out_graph).unwrap();
        let status = unsafe {
            kvq_attend(
                &plan,
                &direct.cache,
                raw(stream),
                n_attend as u32,
                1,
                ptr(&attend_slots, stream).cast(),
                ptr(&q_rows, stream),
                ptr(&out_direct, stream),
                ptr(&lse_direct, stream).cast(),
                ws(&ws_direct),
            )
        };
        ok(status, &format!("{what}: attend"));
        graph.launch().unwrap();
        if ![1, 2, 75, 128, steps].contains(&step) {
            continue;
        }
        checked += 1;
        let mut out_rust = stream.clone_htod(&poison).unwrap();
        let mut lse_rust = stream
            .clone_htod(&vec![f32::NAN; max_seqs * q_heads])
            .unwrap();
        kernels
            .decode
            .attend_with_lse(
                stream,
                rust.view(),
                &q_rust,
                &mut out_rust,
                &mut lse_rust,
                &mut scratch,
            )
            .unwrap();
        let rust_out: Vec<u16> = stream.clone_dtoh(&out_rust).unwrap();
        let rust_lse: Vec<f32> = stream.clone_dtoh(&lse_rust).unwrap();
        let c_out: Vec<u16> = stream.clone_dtoh(&out_direct).unwrap();
        let c_lse: Vec<f32> = stream.clone_dtoh(&lse_direct).unwrap();
        let g_out: Vec<u16> = stream.clone_dtoh(&out_graph).unwrap();
        let g_lse: Vec<f32> = stream.clone_dtoh(&lse_graph).unwrap();
        let at = format!("{what} step {step}");
        assert_eq!(
            c_out, g_out,
            "{at}: the graph's outputs differ from the calls'"
        );
        assert_eq!(bits(&c_lse), bits(&g_lse), "{at}: the graph's LSEs differ");
        for (i, &slot) in attend_order.iter().enumerate() {
            let (rows, qrows) = (i * per..(i + 1) * per, i * q_heads..(i + 1) * q_heads);
            if slot < 0 {
                assert!(
                    c_out[rows].iter().all(|&w| w == 0),
                    "{at}: padding row not zeros"
                );
                continue;
            }
            let s = slot as usize;
            let (r_rows, r_q) = (s * per..(s + 1) * per, s * q_heads..(s + 1) * q_heads);
            assert_eq!(
                c_out[rows.clone()],
                rust_out[r_rows],
                "{at}: row {i} (slot {s}) differs"
            );
            assert_eq!(
                bits(&c_lse[qrows.clone()]),
                bits(&rust_lse[r_q]),
                "{at}: row {i} (slot {s}) LSE differs"
            );
            if case.scheme == "fp16" {
                let q = &qv[s * per..(s + 1) * per];
                check_exact(
                    &c_out[rows],
                    &c_lse[qrows],
                    q,
                    &host_k[s],
                    &host_v[s],
                    case,
                    &at,
                );
            }
        }
    }
    assert_eq!(checked, 5);
    eprintln!(
        "{what}: C calls, graph replays and the Rust cache agree bit for bit over {steps} steps"
    );
    let verify = Verify {
        plan: &plan,
        case,
        cache: &direct,
        workspace: ptr(&ws_direct, stream),
        append_slots: &append_slots,
        attend_slots: &attend_slots,
        attend_order: &attend_order,
    };
    let mut lens: Vec<usize> = prompts.iter().map(|p| p.1 + steps as usize).collect();
    let host = (&mut host_k[..], &mut host_v[..]);
    verify_steps(stream, &verify, &mut rust, &ids, &kernels, host, &mut lens);
}

/// Query tokens a sequence of the verification steps.
const Q_LEN: usize = 3;

/// What the verification steps run on (the cache the C calls advanced through the decode steps).
struct Verify<'a> {
    plan: &'a KvqPlan,
    case: &'a Case,
    cache: &'a EngineCache,
    workspace: *mut c_void,
    append_slots: &'a CudaSlice<i32>,
    attend_slots: &'a CudaSlice<i32>,
    attend_order: &'a [i32],
}

/// Whether appending tokens after length `lo` up to length `hi` closes a quantized page of `spec`
/// (the regions of the whole step's length then differ from those of a shorter one).
fn closes_a_page(spec: &kvq::SchemeSpec, lo: usize, hi: usize) -> bool {
    let (sink, page) = (spec.sink as usize, spec.page as usize);
    [&spec.k, &spec.v]
        .iter()
        .filter(|t| t.is_quantized())
        .any(|t| {
            let local = spec.local_of(t) as usize;
            (lo + 1..=hi).any(|len| len > sink + local && (len - sink - local) % page == 0)
        })
}

/// Steps of speculative-decoding verification: `Q_LEN` new tokens a sequence appended and attended
/// causally in one `kvq_append` and one `kvq_attend`. Each row (sequence, token j) must give the
/// bits of a decode step of the Rust cache fed the same tokens one at a time and attended after
/// token j with the same launch, wherever no page closed between token j and the step's end (there
/// the step, by design, sees those tokens quantized, as the whole step's cache holds them). The
/// FP16 scheme's rows also match causal attention computed in f64 on the host.
fn verify_steps(
    stream: &Arc<CudaStream>,
    v: &Verify<'_>,
    rust: &mut PagedKvCache,
    ids: &[SeqId],
    kernels: &PlanKernels,
    (host_k, host_v): (&mut [Vec<f32>], &mut [Vec<f32>]),
    lens: &mut [usize],
) {
    let (plan, case) = (v.plan, v.case);
    let l = plan.limits();
    let (kv_heads, q_heads, d) = (l.kv_heads as usize, l.q_heads as usize, l.head_dim as usize);
    let (row, per, dtype) = (kv_heads * d, q_heads * d, case.dtype);
    let max_seqs = l.max_seqs as usize;
    let n_attend = v.attend_order.len();
    let what = format!("{} d{d} {dtype} q_len {Q_LEN}", case.scheme);
    let (splits, pieces) = kernels.launch(n_attend * Q_LEN).unwrap();
    let mut scratch =
        DecodeScratch::with_pieces(stream, max_seqs, q_heads, d, splits, pieces).unwrap();
    let poison = vec![0xFFFFu16; n_attend * Q_LEN * per];
    let (mut compared, mut closed) = (0usize, 0usize);
    for vstep in 0..60u64 {
        // [3 sequences][Q_LEN tokens][kv_heads][head_dim], and queries by slot and token.
        let (kb, kv) = words(3 * Q_LEN * row, dtype, 1000 + vstep);
        let (vb, vv) = words(3 * Q_LEN * row, dtype, 2000 + vstep);
        let (qb, qv) = words(max_seqs * Q_LEN * per, dtype, 3000 + vstep);
        for s in 0..3 {
            host_k[s].extend_from_slice(&kv[s * Q_LEN * row..(s + 1) * Q_LEN * row]);
            host_v[s].extend_from_slice(&vv[s * Q_LEN * row..(s + 1) * Q_LEN * row]);
        }
        let mut q_rows = vec![0u16; n_attend * Q_LEN * per];
        for (i, &slot) in v.attend_order.iter().enumerate() {
            if slot >= 0 {
                let s = slot as usize;
                q_rows[i * Q_LEN * per..(i + 1) * Q_LEN * per]
                    .copy_from_slice(&qb[s * Q_LEN * per..(s + 1) * Q_LEN * per]);
            }
        }
        let (k3, v3, q3) = (
            stream.clone_htod(&kb).unwrap(),
            stream.clone_htod(&vb).unwrap(),
            stream.clone_htod(&q_rows).unwrap(),
        );
        let out3 = stream.clone_htod(&poison).unwrap();
        let lse3 = stream
            .clone_htod(&vec![f32::NAN; n_attend * Q_LEN * q_heads])
            .unwrap();
        let status = unsafe {
            kvq_append(
                plan,
                &v.cache.cache,
                stream.cu_stream() as *mut c_void,
                3,
                Q_LEN as u32,
                ptr(v.append_slots, stream).cast(),
                ptr(&k3, stream),
                ptr(&v3, stream),
            )
        };
        ok(status, &format!("{what}: append"));
        let status = unsafe {
            kvq_attend(
                plan,
                &v.cache.cache,
                stream.cu_stream() as *mut c_void,
                n_attend as u32,
                Q_LEN as u32,
                ptr(v.attend_slots, stream).cast(),
                ptr(&q3, stream),
                ptr(&out3, stream),
                ptr(&lse3, stream).cast(),
                v.workspace,
            )
        };
        ok(status, &format!("{what}: attend"));
        let c_out: Vec<u16> = stream.clone_dtoh(&out3).unwrap();
        let c_lse: Vec<f32> = stream.clone_dtoh(&lse3).unwrap();
        // The mirror: token j of every sequence appended, then a decode step with token j's query.
        for j in 0..Q_LEN {
            let pick = |x: &[u16], width: usize, seqs: usize| -> Vec<u16> {
                (0..seqs)
                    .flat_map(|s| x[(s * Q_LEN + j) * width..(s * Q_LEN + j + 1) * width].to_vec())
                    .collect()
            };
            let (kj, vj) = (
                stream.clone_htod(&pick(&kb, row, 3)).unwrap(),
                stream.clone_htod(&pick(&vb, row, 3)).unwrap(),
            );
            rust.append(&ids[..3], &kj, &vj, dtype).unwrap();
            let mut qj = pick(&qb, per, max_seqs);
            qj[3 * per..].fill(0);
            let qj = stream.clone_htod(&qj).unwrap();
            let mut out = stream.clone_htod(&vec![0xFFFFu16; max_seqs * per]).unwrap();
            let mut lse = stream
                .clone_htod(&vec![f32::NAN; max_seqs * q_heads])
                .unwrap();
            kernels
                .decode
                .attend_with_lse(stream, rust.view(), &qj, &mut out, &mut lse, &mut scratch)
                .unwrap();
            let m_out: Vec<u16> = stream.clone_dtoh(&out).unwrap();
            let m_lse: Vec<f32> = stream.clone_dtoh(&lse).unwrap();
            for (i, &slot) in v.attend_order.iter().enumerate() {
                let r = i * Q_LEN + j;
                let (rows, qrows) = (r * per..(r + 1) * per, r * q_heads..(r + 1) * q_heads);
                let at = format!("{what} step {vstep} row {i} token {j}");
                if slot < 0 {
                    assert!(
                        c_out[rows].iter().all(|&w| w == 0),
                        "{at}: padding not zeros"
                    );
                    continue;
                }
                let s = slot as usize;
                let seen = lens[s] + j + 1;
                if case.scheme == "fp16" {
                    let q = &qv[(s * Q_LEN + j) * per..(s * Q_LEN + j + 1) * per];
                    let (k, vv) = (&host_k[s][..seen * row], &host_v[s][..seen * row]);
                    check_exact(
                        &c_out[rows.clone()],
                        &c_lse[qrows.clone()],
                        q,
                        k,
                        vv,
                        case,
                        &at,
                    );
                }
                if closes_a_page(plan.spec(), seen, lens[s] + Q_LEN) {
                    closed += 1;
                    continue;
                }
                compared += 1;
                let (m_rows, m_q) = (s * per..(s + 1) * per, s * q_heads..(s + 1) * q_heads);
                assert_eq!(
                    c_out[rows], m_out[m_rows],
                    "{at}: output differs from the mirror"
                );
                assert_eq!(bits(&c_lse[qrows]), bits(&m_lse[m_q]), "{at}: LSE differs");
            }
        }
        for len in lens.iter_mut() {
            *len += Q_LEN;
        }
    }
    let fp16 = !plan.spec().k.is_quantized() && !plan.spec().v.is_quantized();
    assert!(
        compared > 400 && (closed > 0 || fp16),
        "{what}: compared {compared}, closed {closed}"
    );
    eprintln!(
        "{what}: 60 verification steps; {compared} rows equal the one-token mirror bit for bit, \
         {closed} rows after a page closed inside the step left out"
    );
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn limits(
    case: &Case,
    kv_heads: usize,
    q_heads: usize,
    max_seqs: usize,
    max_len: usize,
    pool_pages: usize,
) -> KvqPlanLimits {
    KvqPlanLimits {
        head_dim: case.head_dim,
        q_heads: q_heads as u32,
        kv_heads: kv_heads as u32,
        dtype: match case.dtype {
            Dtype::F16 => KVQ_DTYPE_F16,
            Dtype::Bf16 => KVQ_DTYPE_BF16,
        },
        max_seqs: max_seqs as u32,
        max_seq_len: max_len as u32,
        pool_pages: pool_pages as u32,
        max_q_len: Q_LEN as u32,
        rope_theta: 0.0,
        d_model: 0,
    }
}

/// One row's outputs and LSEs against attention in f64 over the row's FP16-stored tokens (`k`,
/// `v`: `[tokens][kv_heads][head_dim]`), within the rounding of the f16 output.
fn check_exact(out: &[u16], lse: &[f32], q: &[f32], k: &[f32], v: &[f32], case: &Case, at: &str) {
    let d = case.head_dim as usize;
    let (kv_heads, gqa) = (2usize, 4usize);
    let tokens = k.len() / (kv_heads * d);
    // The case's inputs are f16, which the cache stores exactly.
    assert_eq!(case.dtype, Dtype::F16);
    let f16 = f64::from;
    for h in 0..kv_heads * gqa {
        let kvh = h / gqa;
        let qh = &q[h * d..(h + 1) * d];
        let scores: Vec<f64> = (0..tokens)
            .map(|t| {
                let kr = &k[(t * kv_heads + kvh) * d..][..d];
                qh.iter()
                    .zip(kr)
                    .map(|(a, b)| f64::from(*a) * f16(*b))
                    .sum::<f64>()
                    / (d as f64).sqrt()
            })
            .collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
        let want_lse = m + z.ln();
        assert!(
            (f64::from(lse[h]) - want_lse).abs() < 1e-3 * want_lse.abs().max(1.0),
            "{at}: head {h} LSE {} against {want_lse}",
            lse[h]
        );
        let mut norm = 0f64;
        let mut err = 0f64;
        for c in 0..d {
            let want: f64 = (0..tokens)
                .map(|t| (scores[t] - m).exp() / z * f16(v[(t * kv_heads + kvh) * d + c]))
                .sum();
            let have = f64::from(word_to_f32(out[h * d + c], case.dtype));
            norm += want * want;
            err += (have - want) * (have - want);
        }
        let rel = (err / norm.max(1e-30)).sqrt();
        assert!(rel < 2e-3, "{at}: head {h} relative L2 error {rel:.2e}");
    }
}
