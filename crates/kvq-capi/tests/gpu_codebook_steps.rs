//! Codebook plans (CommVQ and custom codebook schemes) through the C step calls on a GPU, on memory,
//! a block table and a stream the test owns: codebooks written by `kvq_codebooks_load(_bytes)`,
//! prompts by `kvq_prefill_prerope`, then hundreds of tokens appended one step at a time by a
//! CUDA graph captured once around `kvq_append_prerope` (slots permuted, a padding row full of
//! NaN), then `kvq_attend`. Checked against the CPU reference on fresh random layers:
//! - every coded page block in the pool page the block table names, the sinks and the tail rows
//!   equal, bit for bit, what `CommVqCache::build_rotated(…).device_sequence()` lays out;
//! - the attention output (NaN-poisoned before the launch) equals the runtime decode over the
//!   reference's uploaded cache bit for bit with the same split count (that decode is checked
//!   against the reference's attention in kvq-runtime's GPU tests), and is near
//!   `CommVqCache::attend`; padding rows are zeros;
//! - a NaN value is refused: its slot keeps its length and takes nothing until
//!   `kvq_cache_check` has reported it, other slots go on.
//!
//! `KVQ_SEED` repeats a run's inputs (the seed is printed). Without a GPU the test shows as
//! ignored, with the reason (`KVQ_REQUIRE_GPU=1` makes that a failure).

mod common;

use common::{buffers, message, ok, ptr, raw, workspace};
use kvq_runtime::testing::run_seed as seed;
use std::ffi::c_void;
use std::sync::Arc;

use kvq::codegen::{Dtype, KernelShape};
use kvq::reference::attention::Queries;
use kvq::reference::commvq::device::{DeviceLayout, DeviceTensor, SideLayout};
use kvq::reference::commvq::{self, CalibrationData, Codebooks, CommVqCache, TrainOptions};
use kvq::reference::synth::{generate, SynthConfig, SynthKv};
use kvq::reference::KvTensor;
use kvq::runtime::codebook::{CodebookCache, CodebookKernel, CodebookScratch};
use kvq::runtime::cudarc::driver::{sys, CudaSlice, CudaStream};
use kvq::runtime::tune::synth::{random_queries, round_to_word, word_to_f32};
use kvq_capi::*;
use kvq_runtime::testing::harness::{needs, run};
use kvq_runtime::testing::Need;

fn main() {
    run(vec![needs(
        Need::Gpu,
        "codebook_steps_equal_the_reference",
        codebook_steps_equal_the_reference,
    )])
}

const KV_HEADS: usize = 2;
/// Sequences, each in the slot `SLOT_OF[i]`; their prompts.
const SLOT_OF: [usize; 3] = [2, 0, 1];
const PROMPTS: [usize; 3] = [0, 1, 301];

struct Case {
    scheme: &'static str,
    head_dim: usize,
    gqa: usize,
    dtype: Dtype,
}

const CASES: &[Case] = &[
    Case {
        scheme: "commvq1",
        head_dim: 128,
        gqa: 4,
        dtype: Dtype::F16,
    },
    Case {
        scheme: "k = codebook(rope_commutative, levels = 16, residuals = 3, pairs_per_code = 32, span = token), \
                 v = codebook(additive, rows = 64), sink = 16, local = 32, page = 64",
        head_dim: 64,
        gqa: 7,
        dtype: Dtype::Bf16,
    },
    Case {
        scheme: "k = codebook(additive, rows = 128), v = codebook(additive, rows = 96), page = 32",
        head_dim: 128,
        gqa: 8,
        dtype: Dtype::F16,
    },
    Case {
        scheme: "k = fp16, v = codebook(additive, rows = 128), sink = 8",
        head_dim: 64,
        gqa: 1,
        dtype: Dtype::Bf16,
    },
];

fn layer(tokens: usize, d: usize, gqa: usize, seed: u64) -> SynthKv {
    generate(&SynthConfig {
        tokens,
        kv_heads: KV_HEADS,
        gqa,
        head_dim: d,
        d_model: 256,
        seed,
        ..Default::default()
    })
}

/// `t` rounded to the 16-bit format: `[token][kv_head][D]` words, and the values as a tensor.
fn io(t: &KvTensor, dtype: Dtype) -> (Vec<u16>, KvTensor) {
    let mut bits = vec![0u16; t.data.len()];
    let mut back = t.clone();
    for h in 0..t.kv_heads {
        for tok in 0..t.tokens {
            for c in 0..t.head_dim {
                let (b, x) = round_to_word(t.row(h, tok)[c], dtype);
                bits[(tok * t.kv_heads + h) * t.head_dim + c] = b;
                back.row_mut(h, tok)[c] = x;
            }
        }
    }
    (bits, back)
}

/// One sequence as an engine holds it: keys before and after RoPE and values, as words and as
/// the values the reference codes.
struct Seq {
    pre: (Vec<u16>, KvTensor),
    post: (Vec<u16>, KvTensor),
    v: (Vec<u16>, KvTensor),
}

fn sequence(l: &SynthKv, dtype: Dtype) -> Seq {
    let pre = io(&l.k_pre_rope, dtype);
    let mut post = pre.1.clone();
    for h in 0..post.kv_heads {
        for t in 0..post.tokens {
            l.rope.apply(post.row_mut(h, t), t);
        }
    }
    Seq {
        post: io(&post, dtype),
        pre,
        v: io(&l.v, dtype),
    }
}

/// Compares one side of a sequence in the engine's buffers with the reference's device tensor.
#[allow(clippy::too_many_arguments)]
fn check_side(
    what: &str,
    side: &SideLayout,
    want: &DeviceTensor,
    len: usize,
    slot: usize,
    pool: &[u8],
    sink: &[u8],
    tail: &[u8],
    table: &[i32],
    max_pages: usize,
) -> usize {
    let (h, d, block) = (KV_HEADS, side.head_dim, side.block_bytes);
    let mut bytes = 0;
    for page in 0..want.pages {
        let phys = table[slot * max_pages + page] as usize;
        for head in 0..h {
            let got = &pool[(phys * h + head) * block..][..block];
            let w = &want.blocks[(page * h + head) * block..][..block];
            assert!(got == w, "{what}: page {page} head {head} differs");
            bytes += block;
        }
    }
    if !side.is_coded() {
        return bytes;
    }
    let r = side.regions(len);
    let row = |buf: &[u8], rows: usize, head: usize, i: usize| -> Vec<u16> {
        buf[(((slot * h + head) * rows + i) * d) * 2..][..2 * d]
            .chunks(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    };
    for head in 0..h {
        for t in 0..r.sink_end {
            let w = &want.sink[(head * side.sink + t) * d..][..d];
            assert_eq!(row(sink, side.sink, head, t), w, "{what}: sink row {t}");
            bytes += 2 * d;
        }
        for t in r.tail() {
            let i = (t - r.sink_end) % side.tail_cap;
            let w = &want.tail[(head * side.tail_cap + i) * d..][..d];
            assert_eq!(
                row(tail, side.tail_cap, head, i),
                w,
                "{what}: tail token {t}"
            );
            bytes += 2 * d;
        }
    }
    bytes
}

fn codebook_steps_equal_the_reference() {
    let s = seed();
    let gpu = gpu(0).expect("GPU");
    let stream = gpu.device.new_stream().expect("stream");
    let mut checked_bytes = 0usize;
    for (ci, case) in CASES.iter().enumerate() {
        let s = s ^ (ci as u64 * 0x9e37);
        let (d, gqa, dtype) = (case.head_dim, case.gqa, case.dtype);
        let spec = kvq::schemes::by_name(case.scheme)
            .map(|b| b.spec)
            .unwrap_or_else(|| case.scheme.parse().unwrap());
        let layout = DeviceLayout::new(&spec, KV_HEADS, d).unwrap();
        // Enough steps to close two pages of each side after the sink and local window.
        let steps = spec.sink as usize + layout.k.local.max(layout.v.local) + 2 * layout.page + 3;
        let cal = layer(1024, d, gqa, s ^ 0xca1);
        let books: Codebooks = commvq::train_with(
            &spec,
            &CalibrationData {
                k_pre_rope: &cal.k_pre_rope,
                v: &cal.v,
                rope: cal.rope,
            },
            &TrainOptions::quick(s),
        )
        .expect("training");
        let layers: Vec<SynthKv> = (0..3)
            .map(|i| layer(PROMPTS[i] + steps, d, gqa, s ^ (0x5e9 + i as u64)))
            .collect();
        let seqs: Vec<Seq> = layers.iter().map(|l| sequence(l, dtype)).collect();
        let rope = cal.rope;
        let max_len = PROMPTS.iter().max().unwrap() + steps + 8;
        let mut limits = KvqPlanLimits {
            head_dim: d as u32,
            q_heads: (KV_HEADS * gqa) as u32,
            kv_heads: KV_HEADS as u32,
            dtype: match dtype {
                Dtype::F16 => KVQ_DTYPE_F16,
                Dtype::Bf16 => KVQ_DTYPE_BF16,
            },
            max_seqs: 4,
            max_seq_len: max_len as u32,
            pool_pages: 1,
            max_q_len: 1,
            rope_theta: rope.theta,
            d_model: 0,
        };
        let what = format!("{} d{d} GQA {gqa} {dtype:?}", case.scheme);
        let first = KvqPlan::new(case.scheme, &limits).unwrap_or_else(|e| panic!("{what}: {e}"));
        let max_pages = first.info().max_pages_per_seq as usize;
        limits.pool_pages = (4 * max_pages) as u32;
        let plan = KvqPlan::new(case.scheme, &limits).unwrap();
        ok(unsafe { kvq_plan_load(&plan, 0) }, "load");
        let (bufs, cache, table) = buffers(&plan, &stream);
        let workspace = workspace(&plan, &stream, "codebook steps");
        let ws = ptr(&workspace, &stream);

        // Codebooks: from a file for the first case, from bytes otherwise; a file of another
        // shape is refused.
        let file = books.to_safetensors(&spec, KV_HEADS, d).unwrap();
        if ci == 0 {
            let path = std::env::temp_dir().join(format!("kvq-capi-books-{s}.safetensors"));
            std::fs::write(&path, &file).unwrap();
            let c_path = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
            ok(
                unsafe { kvq_codebooks_load(&plan, &cache, raw(&stream), c_path.as_ptr()) },
                "codebooks from a file",
            );
            std::fs::remove_file(&path).ok();
            let other = Codebooks::from_safetensors(&file, &spec, KV_HEADS, d).unwrap();
            let wrong = other.to_safetensors(&spec, KV_HEADS, d).unwrap();
            let mut half = wrong.clone();
            half.truncate(wrong.len() / 2);
            let status = unsafe {
                kvq_codebooks_load_bytes(&plan, &cache, raw(&stream), half.as_ptr(), half.len())
            };
            assert_eq!(status, KvqStatus::InvalidArgument, "{}", message());
            assert!(message().contains("codebook file"), "{}", message());
        } else {
            ok(
                unsafe {
                    kvq_codebooks_load_bytes(&plan, &cache, raw(&stream), file.as_ptr(), file.len())
                },
                "codebooks from bytes",
            );
        }

        // Prompts, packed back to back.
        let row = KV_HEADS * d;
        let pack = |f: fn(&Seq) -> &Vec<u16>| -> Vec<u16> {
            (0..3)
                .flat_map(|i| f(&seqs[i])[..PROMPTS[i] * row].to_vec())
                .collect()
        };
        let (pre_p, post_p, v_p) = (
            stream.clone_htod(&pack(|q| &q.pre.0)).unwrap(),
            stream.clone_htod(&pack(|q| &q.post.0)).unwrap(),
            stream.clone_htod(&pack(|q| &q.v.0)).unwrap(),
        );
        let slots: Vec<i32> = SLOT_OF.iter().map(|&x| x as i32).collect();
        let tokens: Vec<u32> = PROMPTS.iter().map(|&x| x as u32).collect();
        ok(
            unsafe {
                kvq_prefill_prerope(
                    &plan,
                    &cache,
                    raw(&stream),
                    3,
                    slots.as_ptr(),
                    tokens.as_ptr(),
                    ptr(&pre_p, &stream),
                    ptr(&post_p, &stream),
                    ptr(&v_p, &stream),
                    ws,
                )
            },
            &format!("{what}: prefill"),
        );

        // Steps: rows [sequence 0, padding, sequence 1, sequence 2], by one captured graph.
        let step_slots = [SLOT_OF[0] as i32, -1, SLOT_OF[1] as i32, SLOT_OF[2] as i32];
        let slots_d = stream.clone_htod(&step_slots).unwrap();
        let mut rows: Vec<CudaSlice<u16>> = (0..3)
            .map(|_| stream.alloc_zeros::<u16>(4 * row).unwrap())
            .collect();
        let rp: Vec<*mut c_void> = rows.iter().map(|b| ptr(b, &stream)).collect();
        let slots_p = ptr(&slots_d, &stream);
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let status = unsafe {
            kvq_append_prerope(
                &plan,
                &cache,
                raw(&stream),
                4,
                1,
                slots_p.cast(),
                rp[0],
                rp[1],
                rp[2],
            )
        };
        let graph = stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        ok(status, &format!("{what}: append in a graph"));
        let graph = graph.unwrap().expect("a graph");
        let nan = round_to_word(f32::NAN, dtype).0;
        for step in 0..steps {
            for (which, buf) in rows.iter_mut().enumerate() {
                let mut host = vec![nan; 4 * row];
                for (r, seq) in [(0usize, 0usize), (2, 1), (3, 2)] {
                    let t = PROMPTS[seq] + step;
                    let src = match which {
                        0 => &seqs[seq].pre.0,
                        1 => &seqs[seq].post.0,
                        _ => &seqs[seq].v.0,
                    };
                    host[r * row..][..row].copy_from_slice(&src[t * row..][..row]);
                }
                stream.memcpy_htod(&host, buf).unwrap();
            }
            graph.launch().unwrap();
        }
        ok(
            unsafe { kvq_cache_check(&plan, &cache, raw(&stream)) },
            &format!("{what}: nothing refused"),
        );

        // The cache against the reference, byte for byte.
        let down = |i: usize| -> Vec<u8> { stream.clone_dtoh(&bufs[i]).unwrap() };
        let (k_pool, v_pool, k_sink, v_sink, k_tail, v_tail) =
            (down(0), down(1), down(2), down(3), down(4), down(5));
        let lens: Vec<i32> = down(6)
            .chunks(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let mut refs = Vec::new();
        for (i, q) in seqs.iter().enumerate() {
            let n = PROMPTS[i] + steps;
            assert_eq!(
                lens[SLOT_OF[i]] as usize, n,
                "{what}: sequence {i}'s length"
            );
            let cut = |t: &KvTensor| {
                let mut out = KvTensor::zeros(t.kv_heads, n, t.head_dim);
                for h in 0..t.kv_heads {
                    for tok in 0..n {
                        out.row_mut(h, tok).copy_from_slice(t.row(h, tok));
                    }
                }
                out
            };
            let c = CommVqCache::build_rotated(
                &spec,
                &cut(&q.pre.1),
                &cut(&q.post.1),
                &cut(&q.v.1),
                rope,
                &books,
            )
            .unwrap();
            let ds = c.device_sequence().unwrap();
            checked_bytes += check_side(
                &format!("{what}: sequence {i} K"),
                &layout.k,
                &ds.k,
                n,
                SLOT_OF[i],
                &k_pool,
                &k_sink,
                &k_tail,
                &table,
                max_pages,
            );
            checked_bytes += check_side(
                &format!("{what}: sequence {i} V"),
                &layout.v,
                &ds.v,
                n,
                SLOT_OF[i],
                &v_pool,
                &v_sink,
                &v_tail,
                &table,
                max_pages,
            );
            refs.push(c);
        }

        // Attention: rows [sequence 2, padding, sequence 0, sequence 1].
        let q_heads = KV_HEADS * gqa;
        let per = q_heads * d;
        let (q_bits, q_vals) = random_queries(3 * per, dtype, s ^ 0x9).unwrap();
        let order = [Some(2usize), None, Some(0), Some(1)];
        let mut q_rows = vec![0u16; 4 * per];
        let attend_slots: Vec<i32> = order
            .iter()
            .map(|o| o.map_or(-1, |i| SLOT_OF[i] as i32))
            .collect();
        for (r, o) in order.iter().enumerate() {
            if let Some(i) = o {
                q_rows[r * per..][..per].copy_from_slice(&q_bits[i * per..][..per]);
            }
        }
        let q_d = stream.clone_htod(&q_rows).unwrap();
        let out_d = stream.clone_htod(&vec![0x7e00u16; 4 * per]).unwrap();
        let lse_d = stream.clone_htod(&vec![f32::NAN; 4 * q_heads]).unwrap();
        let slots_a = stream.clone_htod(&attend_slots).unwrap();
        ok(
            unsafe {
                kvq_attend(
                    &plan,
                    &cache,
                    raw(&stream),
                    4,
                    1,
                    ptr(&slots_a, &stream).cast(),
                    ptr(&q_d, &stream),
                    ptr(&out_d, &stream),
                    ptr(&lse_d, &stream).cast(),
                    ws,
                )
            },
            &format!("{what}: attend"),
        );
        let out: Vec<u16> = stream.clone_dtoh(&out_d).unwrap();
        let lse: Vec<f32> = stream.clone_dtoh(&lse_d).unwrap();
        assert!(
            out[per..2 * per].iter().all(|&w| w == 0),
            "{what}: the padding row is zeros"
        );
        for r in [0, 2, 3] {
            for h in 0..q_heads {
                assert!(lse[r * q_heads + h].is_finite(), "{what}: lse row {r}");
            }
        }
        // The runtime decode over the reference's cache, the same split count.
        let kernels = codebook_plan_kernels(&gpu, &plan).unwrap();
        let splits = kernels.steps_splits(4).unwrap();
        let shape = KernelShape::new(d as u32, gqa as u32, dtype);
        let kernel = CodebookKernel::load(&gpu.jit, &spec, &shape, KV_HEADS).unwrap();
        let uploaded = CodebookCache::upload(&stream, kernel.layout(), &refs, rope.theta).unwrap();
        let q_rt = stream.clone_htod(&q_bits).unwrap();
        let mut out_rt = stream.clone_htod(&vec![0x7e00u16; 3 * per]).unwrap();
        let mut scratch = CodebookScratch::new(&stream).unwrap();
        kernel
            .attend(&stream, &uploaded, &q_rt, &mut out_rt, splits, &mut scratch)
            .unwrap();
        let rt: Vec<u16> = stream.clone_dtoh(&out_rt).unwrap();
        let mut worst = 0f64;
        for (r, o) in order.iter().enumerate() {
            let Some(&i) = o.as_ref() else { continue };
            let got = &out[r * per..][..per];
            if splits > 1 {
                assert_eq!(
                    got,
                    &rt[i * per..][..per],
                    "{what}: sequence {i} vs the runtime"
                );
            }
            let q = Queries {
                data: q_vals[i * per..][..per].to_vec(),
                q_heads,
                head_dim: d,
            };
            let want = refs[i].attend(&q).unwrap();
            let scale = want.iter().fold(1e-3f64, |m, w| m.max(w.abs() as f64));
            for (j, w) in want.iter().enumerate() {
                let err = (word_to_f32(got[j], dtype) as f64 - *w as f64).abs() / scale;
                worst = worst.max(err);
                assert!(
                    err < 2e-2,
                    "{what}: sequence {i} output {j}: error {err:.3e} of the largest"
                );
            }
        }
        println!("{what}: {splits} splits, worst error {worst:.2e} of the largest output");

        // A NaN value in sequence 0's new V row: its slot keeps its length and takes nothing
        // until the check reports it; the other slots go on.
        let lens_now = |stream: &Arc<CudaStream>| -> Vec<i32> {
            stream
                .clone_dtoh(&bufs[6])
                .unwrap()
                .chunks(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        let mut good = vec![round_to_word(0.5, dtype).0; 4 * row];
        good[row..2 * row].fill(nan);
        let mut bad = good.clone();
        bad[5] = nan;
        for buf in rows.iter_mut() {
            stream.memcpy_htod(&good, buf).unwrap();
        }
        stream.memcpy_htod(&bad, &mut rows[2]).unwrap();
        graph.launch().unwrap();
        stream.memcpy_htod(&good, &mut rows[2]).unwrap();
        graph.launch().unwrap();
        let mid = lens_now(&stream);
        let bad_slot = SLOT_OF[0];
        for slot in 0..3 {
            let want = if slot == bad_slot { 0 } else { 2 };
            assert_eq!(mid[slot] - lens[slot], want, "{what}: slot {slot}'s growth");
        }
        let status = unsafe { kvq_cache_check(&plan, &cache, raw(&stream)) };
        assert_eq!(status, KvqStatus::InvalidArgument, "{what}: {}", message());
        let m = message();
        assert!(
            m.contains(&format!("sequence {bad_slot}, token {}", lens[bad_slot]))
                && m.contains("NaN"),
            "{what}: {m}"
        );
        graph.launch().unwrap();
        ok(
            unsafe { kvq_cache_check(&plan, &cache, raw(&stream)) },
            &format!("{what}: clean after the report"),
        );
        let after = lens_now(&stream);
        assert_eq!(
            after[bad_slot],
            mid[bad_slot] + 1,
            "{what}: the slot takes tokens again"
        );
    }
    println!("{checked_bytes} bytes of the engine's cache equal the reference's");
}
