//! XQuant plans through the C calls on a GPU, on memory, a block table and a stream the test
//! owns, as an engine would make them: the projections written by `kvq_xquant_weights_load`
//! (from a file) or `_bytes`, prompts' layer input by `kvq_xquant_prefill`, then a token a step
//! by a CUDA graph captured once around `kvq_xquant_append` (slots permuted, a padding row full of
//! NaN), then `kvq_attend` (output and LSE NaN-poisoned first). Checked against the CPU reference
//! on fresh random layers:
//! - the latent store (pages in the pool pages the block table names, sinks, tail rings) equals,
//!   bit for bit, the reference's store of the GPU projection's latent rows
//!   (`XQuantCache::from_latents`; kvq-runtime's gpu_xquant_writes checks those rows against the
//!   reference's f64 projection);
//! - the output is within the XQuant decode's bound of attention over the reference's rebuilt K
//!   and V, the LSE within 1e-3 of the host's log-sum-exp over the same K, a padding row zeros.
//!
//! XQuant-CL plans run a stack of four layers through `kvq_xquant_prefill_cross_layer` and a
//! graph of `kvq_xquant_append_cross_layer` calls (the accumulator X̂ carried from layer to
//! layer in one device buffer, zeroed by the graph), against the same inputs written by
//! kvq-runtime's `XQuantPagedCache` (which gpu_xquant_writes checks against the CPU reference):
//! the X̂ each layer hands on, the latent store and the accumulator's latents bit for bit, and
//! `kvq_attend`'s output bit for bit against the Rust decode at the same split count.
//!
//! `KVQ_SEED` repeats a run's inputs (the seed is printed). Without a GPU the test shows as
//! ignored, with the reason (`KVQ_REQUIRE_GPU=1` makes that a failure).

mod common;

use std::ffi::CString;

use common::{buffers, ok, ptr, raw, workspace};
use kvq::codegen::{Dtype, KernelShape, RebuildPrecision};
use kvq::reference::attention::{self, Queries};
use kvq::reference::synth::{generate, SynthConfig};
use kvq::reference::xquant::{Projections, XQuantCache};
use kvq::runtime::cudarc::driver::{result, sys};
use kvq::runtime::paged::SequenceSnapshot;
use kvq::runtime::tune::synth::{random_queries, round_to_word, word_to_f32};
use kvq::runtime::xquant::{
    XQuantCacheConfig, XQuantKernel, XQuantPagedCache, XQuantProjector, XQuantScratch,
    XQuantWeights,
};
use kvq::runtime::{Device, Jit};
use kvq::SchemeSpec;
use kvq_capi::*;
use kvq_runtime::testing::harness::{needs, run};
use kvq_runtime::testing::layer_stack::LayerStack;
use kvq_runtime::testing::run_seed as seed;
use kvq_runtime::testing::Need;

fn main() {
    run(vec![
        needs(
            Need::Gpu,
            "xquant_c_steps_equal_the_reference",
            xquant_c_steps_equal_the_reference,
        ),
        needs(
            Need::Gpu,
            "xquant_cross_layer_c_steps_equal_the_rust_cache",
            xquant_cross_layer_c_steps_equal_the_rust_cache,
        ),
    ])
}

/// Sequences, each in the slot `SLOT_OF[i]`; their prompts; the tokens appended to each.
const SLOT_OF: [usize; 3] = [2, 0, 1];
const PROMPTS: [usize; 3] = [0, 129, 700];
const STEPS: usize = 150;

struct Case {
    scheme: &'static str,
    kv_heads: usize,
    head_dim: usize,
    gqa: usize,
    dtype: Dtype,
    d_model: usize,
}

const CASES: &[Case] = &[
    // The shape: 8 KV heads of 128 (latents of 1,024 in store heads of 256).
    Case {
        scheme: "xquant2",
        kv_heads: 8,
        head_dim: 128,
        gqa: 4,
        dtype: Dtype::F16,
        d_model: 1024,
    },
    // SmolLM2's shape (3 KV heads of 64, GQA 3, d_model 576), a custom latent scheme in bf16.
    Case {
        scheme: "k = int(4, channel), v = int(2, token, group = 32), sink = 4, local = 32, \
                 page = 64, source = x(latent)",
        kv_heads: 3,
        head_dim: 64,
        gqa: 3,
        dtype: Dtype::Bf16,
        d_model: 576,
    },
];

/// The tests' plan limits: 4 slots of 1,024 tokens, pool pages for all of them.
fn plan_limits(
    spec: &SchemeSpec,
    (kv_heads, head_dim, gqa): (usize, usize, usize),
    dtype: Dtype,
    d_model: usize,
    rope_theta: f64,
) -> KvqPlanLimits {
    KvqPlanLimits {
        head_dim: head_dim as u32,
        q_heads: (kv_heads * gqa) as u32,
        kv_heads: kv_heads as u32,
        dtype: match dtype {
            Dtype::F16 => KVQ_DTYPE_F16,
            Dtype::Bf16 => KVQ_DTYPE_BF16,
        },
        max_seqs: 4,
        max_seq_len: 1024,
        pool_pages: 4 * (1024 / spec.page) + 4,
        max_q_len: 1,
        rope_theta,
        d_model: d_model as u32,
    }
}

fn f16s(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| word_to_f32(b, Dtype::F16)).collect()
}

fn xquant_c_steps_equal_the_reference() {
    let s = seed();
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    // A stream of its own: the legacy default stream cannot be captured.
    let stream = device.new_stream().expect("stream");
    let (mut outputs, mut worst, mut bytes_checked) = (0usize, 0f64, 0usize);
    for (ci, case) in CASES.iter().enumerate() {
        let what = case.scheme;
        let (h, d, dm) = (case.kv_heads, case.head_dim, case.d_model);
        let spec: SchemeSpec = kvq::schemes::by_name(case.scheme)
            .map(|b| b.spec)
            .unwrap_or_else(|| case.scheme.parse().unwrap());
        let longest = PROMPTS.iter().max().unwrap() + STEPS;
        let shift = 53;
        let layer = generate(&SynthConfig {
            tokens: longest + shift * 3,
            kv_heads: h,
            gqa: case.gqa,
            head_dim: d,
            d_model: dm,
            seed: s ^ (ci as u64 * 0x9e37),
            ..Default::default()
        });
        let proj = Projections::from_weights(&layer.layer.w_k, &layer.layer.w_v, dm, h, d).unwrap();
        let x_bits: Vec<u16> = layer
            .layer
            .x
            .iter()
            .map(|&v| round_to_word(v, case.dtype).0)
            .collect();
        // Sequence i's layer input: rows from i·shift on.
        let rows = |i: usize, from: usize, to: usize| {
            &x_bits[(i * shift + from) * dm..(i * shift + to) * dm]
        };

        let limits = plan_limits(&spec, (h, d, case.gqa), case.dtype, dm, layer.rope.theta);
        let plan = KvqPlan::new(case.scheme, &limits).unwrap_or_else(|e| panic!("{what}: {e:?}"));
        let (bufs, cache, table) = buffers(&plan, &stream);
        let workspace = workspace(&plan, &stream, what);
        let ws = ptr(&workspace, &stream);

        // The projections: from a file for the first case, from bytes for the others.
        let file = proj.to_safetensors(&spec).unwrap();
        if ci == 0 {
            let path = std::env::temp_dir().join(format!(
                "kvq-xquant-steps-{}.safetensors",
                std::process::id()
            ));
            std::fs::write(&path, &file).unwrap();
            let c_path = CString::new(path.to_str().unwrap()).unwrap();
            let status =
                unsafe { kvq_xquant_weights_load(&plan, &cache, raw(&stream), c_path.as_ptr()) };
            std::fs::remove_file(&path).ok();
            ok(status, &format!("{what}: projections from a file"));
        } else {
            ok(
                unsafe {
                    kvq_xquant_weights_load_bytes(
                        &plan,
                        &cache,
                        raw(&stream),
                        file.as_ptr(),
                        file.len(),
                    )
                },
                &format!("{what}: projections from bytes"),
            );
        }
        // K and V calls are refused on an XQuant plan, naming the X calls.
        let status = unsafe { kvq_append(&plan, &cache, raw(&stream), 1, 1, ws.cast(), ws, ws) };
        assert_eq!(status, KvqStatus::InvalidArgument);
        assert!(
            common::message().contains("kvq_xquant_append"),
            "{}",
            common::message()
        );

        // Prompts, packed back to back.
        let packed: Vec<u16> = (0..3)
            .flat_map(|i| rows(i, 0, PROMPTS[i]).to_vec())
            .collect();
        let x_prompts = stream.clone_htod(&packed).unwrap();
        let slots: Vec<i32> = SLOT_OF.iter().map(|&x| x as i32).collect();
        let tokens: Vec<u32> = PROMPTS.iter().map(|&x| x as u32).collect();
        ok(
            unsafe {
                kvq_xquant_prefill(
                    &plan,
                    &cache,
                    raw(&stream),
                    3,
                    slots.as_ptr(),
                    tokens.as_ptr(),
                    ptr(&x_prompts, &stream),
                    ws,
                )
            },
            &format!("{what}: prefill"),
        );

        // Steps: rows [sequence 0, padding, sequence 1, sequence 2], by one captured graph.
        let step_slots = [SLOT_OF[0] as i32, -1, SLOT_OF[1] as i32, SLOT_OF[2] as i32];
        let slots_d = stream.clone_htod(&step_slots).unwrap();
        let mut x_step = stream.alloc_zeros::<u16>(4 * dm).unwrap();
        let (slots_p, x_p) = (ptr(&slots_d, &stream), ptr(&x_step, &stream));
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let status =
            unsafe { kvq_xquant_append(&plan, &cache, raw(&stream), 4, slots_p.cast(), x_p, ws) };
        let graph = stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        ok(status, &format!("{what}: append in a graph"));
        let graph = graph.unwrap().expect("a graph");
        let nan = round_to_word(f32::NAN, case.dtype).0;
        for step in 0..STEPS {
            let mut host = vec![nan; 4 * dm];
            for (r, i) in [(0usize, 0usize), (2, 1), (3, 2)] {
                let t = PROMPTS[i] + step;
                host[r * dm..(r + 1) * dm].copy_from_slice(rows(i, t, t + 1));
            }
            stream.memcpy_htod(&host, &mut x_step).unwrap();
            graph.launch().unwrap();
        }

        // Attend: NaN-poisoned output and LSE.
        let q_heads = h * case.gqa;
        let per = q_heads * d;
        let (q_bits, q_vals) = random_queries(4 * per, case.dtype, s ^ 5).unwrap();
        let q_dev = stream.clone_htod(&q_bits).unwrap();
        let out = stream.clone_htod(&vec![nan; 4 * per]).unwrap();
        let lse = stream.clone_htod(&vec![f32::NAN; 4 * q_heads]).unwrap();
        ok(
            unsafe {
                kvq_attend(
                    &plan,
                    &cache,
                    raw(&stream),
                    4,
                    1,
                    slots_p.cast(),
                    ptr(&q_dev, &stream),
                    ptr(&out, &stream),
                    ptr(&lse, &stream).cast(),
                    ws,
                )
            },
            &format!("{what}: attend"),
        );
        let got: Vec<u16> = stream.clone_dtoh(&out).unwrap();
        let got_lse: Vec<f32> = stream.clone_dtoh(&lse).unwrap();
        assert!(
            got[per..2 * per]
                .iter()
                .all(|&w| word_to_f32(w, case.dtype) == 0.0),
            "{what}: padding row"
        );

        // The reference: the GPU projection's rows of each whole sequence, stored by the CPU.
        let shape = KernelShape::new(d as u32, case.gqa as u32, case.dtype);
        let weights =
            XQuantWeights::upload(&stream, &spec, &proj, layer.rope, Some(case.dtype)).unwrap();
        let mut projector = XQuantProjector::load(&jit, shape.dtype, dm, proj.k.rank).unwrap();
        let down = |i: usize| -> Vec<u8> { stream.clone_dtoh(&bufs[i]).unwrap() };
        let (k_pool, v_pool, k_sink, v_sink, k_tail, v_tail) =
            (down(0), down(1), down(2), down(3), down(4), down(5));
        let halves = |b: &[u8]| -> Vec<u16> {
            b.chunks(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        let info = plan.info();
        let store_heads = plan.store_heads();
        let max_pages = info.max_pages_per_seq as usize;
        let eps = match case.dtype {
            Dtype::F16 => 2f64.powi(-11),
            Dtype::Bf16 => 2f64.powi(-8),
        };
        for (i, &slot) in SLOT_OF.iter().enumerate() {
            let n = PROMPTS[i] + STEPS;
            let x_dev = stream.clone_htod(rows(i, 0, n)).unwrap();
            let rank = proj.k.rank;
            let mut lk = stream.alloc_zeros::<u16>(n * rank).unwrap();
            let mut lv = stream.alloc_zeros::<u16>(n * rank).unwrap();
            projector
                .project(&stream, &weights, &x_dev, n, &mut lk, &mut lv)
                .unwrap();
            let (lk, lv) = (
                f16s(&stream.clone_dtoh(&lk).unwrap()),
                f16s(&stream.clone_dtoh(&lv).unwrap()),
            );
            let reference = XQuantCache::from_latents(&spec, &lk, &lv, &proj, layer.rope).unwrap();
            let stored = reference.stored();
            let block = |pool: &[u8], bytes: usize, j: usize| -> Vec<u8> {
                let page = table[slot * max_pages + j] as usize;
                pool[page * store_heads * bytes..(page + 1) * store_heads * bytes].to_vec()
            };
            let per_slot = |b: &[u8]| -> Vec<u16> {
                let each = b.len() / 2 / limits.max_seqs as usize;
                halves(&b[slot * each * 2..(slot + 1) * each * 2])
            };
            let snap = SequenceSnapshot {
                len: n,
                k_pages: (0..stored.k().pages())
                    .map(|j| block(&k_pool, info.k_block_bytes as usize, j))
                    .collect(),
                v_pages: (0..stored.v().pages())
                    .map(|j| block(&v_pool, info.v_block_bytes as usize, j))
                    .collect(),
                k_sink: per_slot(&k_sink),
                v_sink: per_slot(&v_sink),
                k_tail: per_slot(&k_tail),
                v_tail: per_slot(&v_tail),
            };
            let diffs = snap.differences(stored);
            assert!(
                diffs.is_empty(),
                "{what}: sequence {i} in slot {slot}: {}",
                diffs.join("; ")
            );
            bytes_checked += snap
                .k_pages
                .iter()
                .chain(&snap.v_pages)
                .map(Vec::len)
                .sum::<usize>();

            let row = [0usize, 2, 3][i];
            let q = Queries {
                data: q_vals[row * per..][..per].to_vec(),
                q_heads,
                head_dim: d,
            };
            let rebuilt = reference.dequantize_f16_rebuild();
            let want = attention::decode(&q, &rebuilt, None).unwrap();
            let top = want.iter().fold(1e-6f64, |m, w| m.max(w.abs() as f64));
            for (j, w) in want.iter().enumerate() {
                let g = word_to_f32(got[row * per + j], case.dtype) as f64;
                let bound = eps * (*w as f64).abs() + 1e-4 * top;
                let err = (g - *w as f64).abs();
                assert!(
                    err <= bound,
                    "{what}: sequence {i}, output {j}: {g} against {w} (bound {bound:.3e})"
                );
                worst = worst.max(err / bound);
                outputs += 1;
            }
            // ln Σ exp(q·k/√d) on the host, over the same rebuilt K.
            for qh in 0..q_heads {
                let qv = q.head(qh);
                let k_head = qh / case.gqa;
                let scores: Vec<f64> = (0..n)
                    .map(|t| {
                        let k = rebuilt.k.row(k_head, t);
                        qv.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let want = m + scores.iter().map(|s| (s - m).exp()).sum::<f64>().ln();
                let g = got_lse[row * q_heads + qh] as f64;
                assert!(
                    (g - want).abs() <= 1e-3 * (1.0 + want.abs()),
                    "{what}: sequence {i} head {qh} LSE {g} against {want}"
                );
            }
        }
        println!(
            "{what}: {} store heads of {}; 3 sequences of up to {longest} tokens",
            store_heads,
            plan.xquant_sizes().unwrap().store_width
        );
    }
    println!(
        "{bytes_checked} page bytes bit-exact; {outputs} outputs within {worst:.3} of their bound"
    );
}

/// XQuant-CL cases: a scheme, the layer input's dtype and width (2 KV heads of 64, GQA 4).
const CL_CASES: &[(&str, Dtype, usize)] = &[
    // d_model 384 > 2R = 256: the lift solved in the latents' width.
    ("xquant-cl2", Dtype::F16, 384),
    // d_model 192 < 2R; FP16 sink and local rows of deltas, smaller pages.
    (
        "k = int(3, channel), v = int(4, token, group = 32), sink = 4, local = 32, page = 64, \
         source = x(cross_layer)",
        Dtype::Bf16,
        192,
    ),
];

/// Words of a little-endian byte buffer.
fn halves(b: &[u8]) -> Vec<u16> {
    b.chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn xquant_cross_layer_c_steps_equal_the_rust_cache() {
    let s = seed() ^ 0xc1a0;
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.new_stream().expect("stream");
    let (h, d, gqa, depth) = (2usize, 64usize, 4usize, 4usize);
    let (mut words_checked, mut bytes_checked, mut outputs) = (0usize, 0usize, 0usize);
    for (ci, &(scheme, dtype, dm)) in CL_CASES.iter().enumerate() {
        let spec: SchemeSpec = kvq::schemes::by_name(scheme)
            .map(|b| b.spec)
            .unwrap_or_else(|| scheme.parse().unwrap());
        let longest = PROMPTS.iter().max().unwrap() + STEPS;
        let shift = 41;
        let stack = LayerStack::new(
            depth,
            &SynthConfig {
                tokens: longest + shift * 3,
                kv_heads: h,
                gqa,
                head_dim: d,
                d_model: dm,
                seed: s ^ (ci as u64 * 0x9e37),
                ..Default::default()
            },
            dtype,
        );
        let (layers, projs, x_bits) = (&stack.layers, &stack.projections, &stack.x);
        // Layer l's input rows from..to of sequence i.
        let rows = |l: usize, i: usize, from: usize, to: usize| -> &[u16] {
            &x_bits[l][(i * shift + from) * dm..(i * shift + to) * dm]
        };
        let limits = plan_limits(&spec, (h, d, gqa), dtype, dm, layers[0].rope.theta);
        let max_seq_len = limits.max_seq_len as usize;
        let plan = KvqPlan::new(scheme, &limits).unwrap_or_else(|e| panic!("{scheme}: {e:?}"));
        // One workspace for every layer: their calls run in order on one stream.
        let workspace = workspace(&plan, &stream, scheme);
        let ws = ptr(&workspace, &stream);
        let c_layers: Vec<_> = (0..depth).map(|_| buffers(&plan, &stream)).collect();
        for (l, (_, cache, _)) in c_layers.iter().enumerate() {
            let file = projs[l].to_safetensors(&spec).unwrap();
            let status = unsafe {
                kvq_xquant_weights_load_bytes(&plan, cache, raw(&stream), file.as_ptr(), file.len())
            };
            ok(status, &format!("{scheme}: layer {l}'s projections"));
        }
        // The same stack through kvq-runtime's cache.
        let cfg = XQuantCacheConfig {
            max_seqs: 4,
            pool_pages: 4 * (max_seq_len / spec.page as usize + 2),
            max_tokens: max_seq_len,
            input_dtype: dtype,
        };
        let mut caches: Vec<XQuantPagedCache> = layers
            .iter()
            .zip(projs)
            .map(|(l, p)| {
                XQuantPagedCache::new(&jit, stream.clone(), &spec, p, l.rope, cfg).unwrap()
            })
            .collect();
        let ids: Vec<Vec<_>> = caches
            .iter_mut()
            .map(|c| (0..3).map(|_| c.add_sequence().unwrap()).collect())
            .collect();

        // Prompts through the stack: C calls on the packed prompts, Rust on each.
        let slots: Vec<i32> = SLOT_OF.iter().map(|&x| x as i32).collect();
        let tokens: Vec<u32> = PROMPTS.iter().map(|&x| x as u32).collect();
        let total: usize = PROMPTS.iter().sum();
        let c_hat = stream.alloc_zeros::<u16>(total * dm).unwrap();
        for (l, (_, cache, _)) in c_layers.iter().enumerate() {
            let packed: Vec<u16> = (0..3)
                .flat_map(|i| rows(l, i, 0, PROMPTS[i]).to_vec())
                .collect();
            let x = stream.clone_htod(&packed).unwrap();
            let status = unsafe {
                kvq_xquant_prefill_cross_layer(
                    &plan,
                    cache,
                    raw(&stream),
                    3,
                    slots.as_ptr(),
                    tokens.as_ptr(),
                    ptr(&x, &stream),
                    ptr(&c_hat, &stream),
                    ws,
                )
            };
            ok(status, &format!("{scheme}: layer {l} prefill"));
        }
        let c_hat: Vec<u16> = stream.clone_dtoh(&c_hat).unwrap();
        let mut at = 0usize;
        for (i, &p) in PROMPTS.iter().enumerate() {
            if p == 0 {
                continue;
            }
            let mut x_hat = stream.alloc_zeros::<u16>(p * dm).unwrap();
            for l in 0..depth {
                let x = stream.clone_htod(rows(l, i, 0, p)).unwrap();
                caches[l]
                    .prefill_cross_layer(ids[l][i], &x, &mut x_hat, p, dtype)
                    .unwrap();
            }
            let want: Vec<u16> = stream.clone_dtoh(&x_hat).unwrap();
            assert!(
                c_hat[at * dm..(at + p) * dm] == want[..],
                "{scheme}: sequence {i}'s prompt: the accumulator after the stack"
            );
            words_checked += want.len();
            at += p;
        }

        // Steps: rows [sequence 0, padding, sequence 1, sequence 2]; one captured graph zeroes
        // X̂ and appends through every layer.
        let step_slots = [SLOT_OF[0] as i32, -1, SLOT_OF[1] as i32, SLOT_OF[2] as i32];
        let slots_d = stream.clone_htod(&step_slots).unwrap();
        let mut x_steps: Vec<_> = (0..depth)
            .map(|_| stream.alloc_zeros::<u16>(4 * dm).unwrap())
            .collect();
        let step_hat = stream.alloc_zeros::<u16>(4 * dm).unwrap();
        let (slots_p, hat_p) = (ptr(&slots_d, &stream), ptr(&step_hat, &stream));
        let x_ps: Vec<_> = x_steps.iter().map(|x| ptr(x, &stream)).collect();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        // The driver's memset on the address: cudarc's slice calls track events, which a
        // capture does not take.
        unsafe { result::memset_d8_async(hat_p as u64, 0, 4 * dm * 2, stream.cu_stream()) }
            .unwrap();
        let statuses: Vec<KvqStatus> = c_layers
            .iter()
            .zip(&x_ps)
            .map(|((_, cache, _), &x_p)| unsafe {
                kvq_xquant_append_cross_layer(
                    &plan,
                    cache,
                    raw(&stream),
                    4,
                    slots_p.cast(),
                    x_p,
                    hat_p,
                    ws,
                )
            })
            .collect();
        let graph = stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        for (l, status) in statuses.into_iter().enumerate() {
            ok(status, &format!("{scheme}: layer {l} append in a graph"));
        }
        let graph = graph.unwrap().expect("a graph");
        let nan = round_to_word(f32::NAN, dtype).0;
        for step in 0..STEPS {
            for (l, x_step) in x_steps.iter_mut().enumerate() {
                let mut host = vec![nan; 4 * dm];
                for (r, i) in [(0usize, 0usize), (2, 1), (3, 2)] {
                    let t = PROMPTS[i] + step;
                    host[r * dm..(r + 1) * dm].copy_from_slice(rows(l, i, t, t + 1));
                }
                stream.memcpy_htod(&host, x_step).unwrap();
            }
            graph.launch().unwrap();
            let mut x_hat = stream.alloc_zeros::<u16>(3 * dm).unwrap();
            for l in 0..depth {
                let host: Vec<u16> = (0..3)
                    .flat_map(|i| {
                        let t = PROMPTS[i] + step;
                        rows(l, i, t, t + 1).to_vec()
                    })
                    .collect();
                let x = stream.clone_htod(&host).unwrap();
                caches[l]
                    .append_cross_layer(&ids[l], &x, &mut x_hat, dtype)
                    .unwrap();
            }
            let (got, want): (Vec<u16>, Vec<u16>) = (
                stream.clone_dtoh(&step_hat).unwrap(),
                stream.clone_dtoh(&x_hat).unwrap(),
            );
            for (r, i) in [(0usize, 0usize), (2, 1), (3, 2)] {
                assert!(
                    got[r * dm..(r + 1) * dm] == want[i * dm..(i + 1) * dm],
                    "{scheme}: step {step}, sequence {i}: the accumulator after the stack"
                );
            }
            words_checked += 3 * dm;
        }

        // Each layer's store and accumulator latents, then its decode.
        let info = plan.info();
        let (store_heads, max_pages) = (plan.store_heads(), info.max_pages_per_seq as usize);
        let rank = projs[0].k.rank;
        let shape = KernelShape::new(d as u32, gqa as u32, dtype);
        let kernel = XQuantKernel::load(&jit, &spec, &shape, h, dm, RebuildPrecision::F16).unwrap();
        let splits = kernel.default_splits(4, max_seq_len);
        let mut scratch = XQuantScratch::new(&stream).unwrap();
        let per = h * gqa * d;
        for (l, (bufs, cache, table)) in c_layers.iter().enumerate() {
            let down = |i: usize| -> Vec<u8> { stream.clone_dtoh(&bufs[i]).unwrap() };
            let (k_pool, v_pool) = (down(0), down(1));
            let per_slot = |b: &[u8], slot: usize| -> Vec<u16> {
                let each = b.len() / 2 / 4;
                halves(&b[slot * each * 2..(slot + 1) * each * 2])
            };
            let sides: Vec<Vec<u8>> = (2..6).map(down).collect();
            let accumulator = halves(&down(13));
            let (rust_k, rust_v, rust_rows) = caches[l].accumulator_latents().unwrap();
            let (rust_k, rust_v): (Vec<u16>, Vec<u16>) = (
                stream.clone_dtoh(rust_k).unwrap(),
                stream.clone_dtoh(rust_v).unwrap(),
            );
            for (i, &slot) in SLOT_OF.iter().enumerate() {
                let want = caches[l].snapshot(ids[l][i]).unwrap();
                let block = |pool: &[u8], bytes: usize, j: usize| -> Vec<u8> {
                    let page = table[slot * max_pages + j] as usize;
                    pool[page * store_heads * bytes..(page + 1) * store_heads * bytes].to_vec()
                };
                let got = SequenceSnapshot {
                    len: want.len,
                    k_pages: (0..want.k_pages.len())
                        .map(|j| block(&k_pool, info.k_block_bytes as usize, j))
                        .collect(),
                    v_pages: (0..want.v_pages.len())
                        .map(|j| block(&v_pool, info.v_block_bytes as usize, j))
                        .collect(),
                    k_sink: per_slot(&sides[0], slot),
                    v_sink: per_slot(&sides[1], slot),
                    k_tail: per_slot(&sides[2], slot),
                    v_tail: per_slot(&sides[3], slot),
                };
                let what = format!("{scheme}: layer {l}, sequence {i} in slot {slot}");
                assert!(
                    got == want,
                    "{what}: the latent store differs from the Rust cache's"
                );
                bytes_checked += got
                    .k_pages
                    .iter()
                    .chain(&got.v_pages)
                    .map(Vec::len)
                    .sum::<usize>();
                let n = want.len * rank;
                let c_at = slot * max_seq_len * rank;
                let r_at = ids[l][i].0 as usize * rust_rows * rank;
                let v_off = 4 * max_seq_len * rank;
                assert!(
                    accumulator[c_at..c_at + n] == rust_k[r_at..r_at + n]
                        && accumulator[v_off + c_at..v_off + c_at + n] == rust_v[r_at..r_at + n],
                    "{what}: the accumulator's latents differ from the Rust cache's"
                );
                words_checked += 2 * n;
            }
            // Attend through C (rows as the steps', output and LSE NaN-poisoned) and in Rust
            // (a row a slot) at the same split count.
            let (q_bits, _) = random_queries(4 * per, dtype, s ^ 7 ^ l as u64).unwrap();
            let q_dev = stream.clone_htod(&q_bits).unwrap();
            let out = stream.clone_htod(&vec![nan; 4 * per]).unwrap();
            let lse = stream.clone_htod(&vec![f32::NAN; 4 * h * gqa]).unwrap();
            let status = unsafe {
                kvq_attend(
                    &plan,
                    cache,
                    raw(&stream),
                    4,
                    1,
                    slots_p.cast(),
                    ptr(&q_dev, &stream),
                    ptr(&out, &stream),
                    ptr(&lse, &stream).cast(),
                    ws,
                )
            };
            ok(status, &format!("{scheme}: layer {l} attend"));
            let got: Vec<u16> = stream.clone_dtoh(&out).unwrap();
            let got_lse: Vec<f32> = stream.clone_dtoh(&lse).unwrap();
            let mut q_rust = vec![0u16; 4 * per];
            for (r, i) in [(0usize, 0usize), (2, 1), (3, 2)] {
                let slot = ids[l][i].0 as usize;
                q_rust[slot * per..(slot + 1) * per]
                    .copy_from_slice(&q_bits[r * per..(r + 1) * per]);
            }
            let q_rust = stream.clone_htod(&q_rust).unwrap();
            let mut want = stream.alloc_zeros::<u16>(4 * per).unwrap();
            kernel
                .attend_paged(
                    &stream,
                    &caches[l],
                    &q_rust,
                    &mut want,
                    splits,
                    &mut scratch,
                )
                .unwrap();
            let want: Vec<u16> = stream.clone_dtoh(&want).unwrap();
            assert!(
                got[per..2 * per]
                    .iter()
                    .all(|&w| word_to_f32(w, dtype) == 0.0),
                "{scheme}: layer {l}: padding row"
            );
            for (r, i) in [(0usize, 0usize), (2, 1), (3, 2)] {
                let slot = ids[l][i].0 as usize;
                assert!(
                    got[r * per..(r + 1) * per] == want[slot * per..(slot + 1) * per],
                    "{scheme}: layer {l}, sequence {i}: kvq_attend differs from the Rust decode"
                );
                assert!(
                    got_lse[r * h * gqa..(r + 1) * h * gqa]
                        .iter()
                        .all(|v| v.is_finite()),
                    "{scheme}: layer {l}, sequence {i}: LSE"
                );
                outputs += per;
            }
        }
        println!("{scheme}: {depth} layers, 3 sequences of up to {longest} tokens");
    }
    println!(
        "XQuant-CL through C: {words_checked} accumulator words, {bytes_checked} page bytes and \
         {outputs} outputs bit-exact against the Rust cache"
    );
}
