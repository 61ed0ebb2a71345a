//! On a GPU: the codebook schemes' (CommVQ's) cache-filling kernels against the CPU reference on
//! fresh random layers. A sequence appended to an empty GPU cache in one piece, and the same
//! sequence grown chunk by chunk and token by token, must both hold — byte for byte — the page
//! blocks, sink rows and tail rows `CommVqCache::build_rotated(…).device_sequence()` lays out for
//! the same 16-bit inputs; decode over the GPU-filled cache must equal decode over the reference's
//! uploaded one bit for bit; bad inputs are typed errors, nothing from the failing part on
//! appended. `KVQ_SEED` repeats a run's inputs. Runs under its own harness: without a GPU each test
//! shows as ignored; KVQ_REQUIRE_GPU=1 makes that a failure.

mod gated;

use half::{bf16, f16};
use kvq_codegen::{Dtype, KernelShape};
use kvq_reference::commvq::device::{DeviceLayout, DeviceSequence, DeviceTensor, SideLayout};
use kvq_reference::commvq::{self, CalibrationData, Codebooks, CommVqCache, TrainOptions};
use kvq_reference::synth::{generate, SynthConfig, SynthKv};
use kvq_reference::KvTensor;
use kvq_runtime::codebook::{
    CacheArrays, CodebookCache, CodebookEncoder, CodebookKernel, CodebookScratch, EncodeInputs,
};
use kvq_runtime::testing::run_seed as seed;
use kvq_runtime::{Device, Jit};
use kvq_spec::SchemeSpec;

const TESTS: &[(&str, fn())] = &[
    (
        "codebook_encode_writes_the_reference_bytes",
        codebook_encode_writes_the_reference_bytes,
    ),
    (
        "codebook_encode_refuses_bad_inputs_from_the_failing_part_on",
        codebook_encode_refuses_bad_inputs_from_the_failing_part_on,
    ),
    ("codebook_encode_throughput", codebook_encode_throughput),
];

fn main() {
    gated::run_gpu_tests(TESTS)
}

const COMMVQ1: &str = "k = codebook(rope_commutative, levels = 64, residuals = 10, pairs_per_code = 64, span = token), \
                       v = codebook(additive, rows = 128)";
const COMMVQ2: &str = "k = codebook(rope_commutative, levels = 64, residuals = 21, pairs_per_code = 64, span = token), \
                       v = codebook(additive, rows = 256)";

/// Schemes and head sizes: the built-ins, other levels and residual counts, `span = head` and `token`,
/// FP16 on either side, additive keys, small pages.
const CASES: &[(&str, &[usize])] = &[
    (COMMVQ1, &[128]),
    (COMMVQ2, &[128]),
    (
        "k = codebook(rope_commutative, levels = 16, residuals = 3, pairs_per_code = 32, span = head), \
         v = codebook(additive, rows = 64), sink = 16, local = 32, page = 64",
        &[64, 128],
    ),
    (
        "k = codebook(rope_commutative, levels = 32, residuals = 40, pairs_per_code = 32), v = fp16",
        &[64],
    ),
    ("k = fp16, v = codebook(additive, rows = 128), sink = 8", &[64]),
    (
        "k = codebook(additive, rows = 128), v = codebook(additive, rows = 96), page = 32",
        &[128],
    ),
];

const LENGTHS: &[usize] = &[1, 127, 129, 4097, 9001];
const KV_HEADS: usize = 4;

fn layer(tokens: usize, head_dim: usize, seed: u64) -> SynthKv {
    generate(&SynthConfig {
        tokens,
        kv_heads: KV_HEADS,
        gqa: 1,
        head_dim,
        d_model: 256,
        seed,
        ..Default::default()
    })
}

fn train(spec: &SchemeSpec, head_dim: usize, seed: u64) -> Codebooks {
    let cal = layer(1024, head_dim, seed);
    let data = CalibrationData {
        k_pre_rope: &cal.k_pre_rope,
        v: &cal.v,
        rope: cal.rope,
    };
    commvq::train_with(spec, &data, &TrainOptions::quick(seed)).expect("training")
}

fn to_bits(x: f32, dtype: Dtype) -> u16 {
    match dtype {
        Dtype::F16 => f16::from_f32(x).to_bits(),
        Dtype::Bf16 => bf16::from_f32(x).to_bits(),
    }
}

fn from_bits(b: u16, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F16 => f16::from_bits(b).to_f32(),
        Dtype::Bf16 => bf16::from_bits(b).to_f32(),
    }
}

/// A layer's tensors as an engine holds them: 16-bit `[token][kv_head][D]`, and the same values
/// as the reference's f32 tensors.
struct Inputs {
    k_pre: (Vec<u16>, KvTensor),
    k_post: (Vec<u16>, KvTensor),
    v: (Vec<u16>, KvTensor),
}

fn io_tensor(t: &KvTensor, dtype: Dtype) -> (Vec<u16>, KvTensor) {
    let mut bits = vec![0u16; t.data.len()];
    let mut back = t.clone();
    for h in 0..t.kv_heads {
        for tok in 0..t.tokens {
            for (c, x) in t.row(h, tok).iter().enumerate() {
                let b = to_bits(*x, dtype);
                bits[(tok * t.kv_heads + h) * t.head_dim + c] = b;
                back.row_mut(h, tok)[c] = from_bits(b, dtype);
            }
        }
    }
    (bits, back)
}

fn inputs(l: &SynthKv, dtype: Dtype) -> Inputs {
    let k_pre = io_tensor(&l.k_pre_rope, dtype);
    let mut post = k_pre.1.clone();
    for h in 0..post.kv_heads {
        for t in 0..post.tokens {
            l.rope.apply(post.row_mut(h, t), t);
        }
    }
    Inputs {
        k_pre,
        k_post: io_tensor(&post, dtype),
        v: io_tensor(&l.v, dtype),
    }
}

fn truncated(t: &KvTensor, n: usize) -> KvTensor {
    let mut out = KvTensor::zeros(t.kv_heads, n, t.head_dim);
    for h in 0..t.kv_heads {
        for tok in 0..n {
            out.row_mut(h, tok).copy_from_slice(t.row(h, tok));
        }
    }
    out
}

/// The chunks a sequence is grown by: a prompt, single tokens, odd chunks, the rest.
fn growth(len: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut left = len;
    for step in [37usize, 1, 1, 1, 5, 300, 1, 129, 2000] {
        let n = step.min(left);
        if n > 0 {
            out.push(n);
        }
        left -= n;
    }
    while left > 0 {
        let n = left.min(1500);
        out.push(n);
        left -= n;
    }
    out
}

/// Compares one side of GPU sequence `slot` against the reference's, byte for byte where the
/// decode reads: the blocks of its pages, the sink rows and the tail rows of live tokens.
#[allow(clippy::too_many_arguments)]
fn compare_side(
    what: &str,
    layout: &DeviceLayout,
    side: &SideLayout,
    want: &DeviceTensor,
    pool: &[u8],
    sink: &[u16],
    tail: &[u16],
    slot: usize,
    max_pages: usize,
    len: usize,
) -> usize {
    let (h, d) = (layout.kv_heads, layout.head_dim);
    let mut bytes = 0;
    for page in 0..side.pages(len) {
        for head in 0..h {
            let r = layout.block_range(side, page, head);
            let phys = slot * max_pages + page;
            let got = &pool[(phys * h + head) * side.block_bytes..][..side.block_bytes];
            if let Some(i) = (0..side.block_bytes).find(|&i| got[i] != want.blocks[r.start + i]) {
                panic!(
                    "{what}: page {page}, KV head {head}, block byte {i}: GPU {:#04x}, reference {:#04x} \
                     (codes at {}..{}, scales at {}..)",
                    got[i],
                    want.blocks[r.start + i],
                    side.codes.offset,
                    side.codes.offset + side.codes.bytes,
                    side.scales.offset
                );
            }
            bytes += side.block_bytes;
        }
    }
    if side.is_coded() {
        let regions = side.regions(len);
        for head in 0..h {
            for t in regions.sink() {
                let got = &sink[((slot * h + head) * side.sink + t) * d..][..d];
                assert_eq!(
                    got,
                    &want.sink[layout.sink_row(side, head, t)],
                    "{what}: sink row {t} of KV head {head}"
                );
                bytes += 2 * d;
            }
            for t in regions.tail() {
                let s = (t - regions.sink_end) % side.tail_cap;
                let got = &tail[((slot * h + head) * side.tail_cap + s) * d..][..d];
                assert_eq!(
                    got,
                    &want.tail[layout.tail_row(side, head, s)],
                    "{what}: tail token {t} (slot {s}) of KV head {head}"
                );
                bytes += 2 * d;
            }
        }
    }
    bytes
}

fn compare(
    what: &str,
    layout: &DeviceLayout,
    want: &DeviceSequence,
    got: &CacheArrays,
    slot: usize,
) -> usize {
    let len = want.len;
    compare_side(
        &format!("{what} K"),
        layout,
        &layout.k,
        &want.k,
        &got.k_pool,
        &got.k_sink,
        &got.k_tail,
        slot,
        got.max_pages,
        len,
    ) + compare_side(
        &format!("{what} V"),
        layout,
        &layout.v,
        &want.v,
        &got.v_pool,
        &got.v_sink,
        &got.v_tail,
        slot,
        got.max_pages,
        len,
    )
}

fn codebook_encode_writes_the_reference_bytes() {
    let device = Device::open(0).expect("device");
    let jit = Jit::new(&device).expect("jit");
    let stream = device.default_stream();
    let base = seed();
    let mut checked = 0usize;
    for (ci, (text, dims)) in CASES.iter().enumerate() {
        let spec: SchemeSpec = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
        for &d in *dims {
            let s = base.wrapping_add((ci * 1000 + d) as u64);
            let books = train(&spec, d, s);
            let max_len = *LENGTHS.iter().max().unwrap_or(&1);
            let full = layer(max_len, d, s ^ 0x9e37);
            for dtype in [Dtype::F16, Dtype::Bf16] {
                let io = inputs(&full, dtype);
                let encoder = CodebookEncoder::load(&jit, &spec, &books, d, KV_HEADS, dtype)
                    .unwrap_or_else(|e| panic!("{text} d{d} {dtype:?}: {e}"));
                let layout = encoder.generated().layout;
                let dev = |bits: &[u16]| stream.clone_htod(bits).expect("upload");
                let (k_pre, k_post, v) = (dev(&io.k_pre.0), dev(&io.k_post.0), dev(&io.v.0));
                // Slots 2i (whole) and 2i + 1 (grown) hold LENGTHS[i].
                let mut cache = encoder
                    .new_cache(&stream, 2 * LENGTHS.len(), max_len, full.rope.theta)
                    .expect("cache");
                let row = KV_HEADS * d;
                let mut refs = Vec::new();
                for (i, &n) in LENGTHS.iter().enumerate() {
                    let cut = |t: &KvTensor| truncated(t, n);
                    let r = CommVqCache::build_rotated(
                        &spec,
                        &cut(&io.k_pre.1),
                        &cut(&io.k_post.1),
                        &cut(&io.v.1),
                        full.rope,
                        &books,
                    )
                    .unwrap_or_else(|e| panic!("{text} d{d}: reference of {n}: {e}"));
                    let whole = EncodeInputs {
                        k_pre_rope: &k_pre,
                        k_post_rope: &k_post,
                        v: &v,
                        tokens: n,
                    };
                    encoder
                        .append(&stream, &mut cache, 2 * i, &whole)
                        .unwrap_or_else(|e| {
                            panic!("{text} d{d} {dtype:?} {n} tokens at once: {e}")
                        });
                    let mut at = 0;
                    for chunk in growth(n) {
                        let part = |t: &[u16]| dev(&t[at * row..(at + chunk) * row]);
                        let (a, b, c) = (part(&io.k_pre.0), part(&io.k_post.0), part(&io.v.0));
                        let piece = EncodeInputs {
                            k_pre_rope: &a,
                            k_post_rope: &b,
                            v: &c,
                            tokens: chunk,
                        };
                        encoder
                            .append(&stream, &mut cache, 2 * i + 1, &piece)
                            .unwrap_or_else(|e| {
                                panic!("{text} d{d} {dtype:?} {n} tokens grown, at {at}: {e}")
                            });
                        at += chunk;
                    }
                    assert_eq!(cache.len(2 * i), Some(n));
                    assert_eq!(cache.len(2 * i + 1), Some(n));
                    refs.push(r);
                }
                let got = cache.download(&stream).expect("download");
                for (i, r) in refs.iter().enumerate() {
                    let want = r.device_sequence().expect("device sequence");
                    let what = format!("{text} d{d} {dtype:?} {} tokens", want.len);
                    checked += compare(&format!("{what} at once"), &layout, &want, &got, 2 * i);
                    checked += compare(&format!("{what} grown"), &layout, &want, &got, 2 * i + 1);
                }
                decode_agrees(
                    &jit,
                    &stream,
                    &spec,
                    d,
                    dtype,
                    &cache,
                    &refs,
                    full.rope.theta,
                );
            }
        }
    }
    println!("{checked} bytes of codes, scales and FP16 rows equal the reference's");
}

/// Decode over the GPU-filled cache (its "at once" and "grown" slots) against decode over the
/// reference's sequences uploaded: the same bytes and lengths, so the same outputs, bit for bit.
#[allow(clippy::too_many_arguments)]
fn decode_agrees(
    jit: &Jit,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    spec: &SchemeSpec,
    d: usize,
    dtype: Dtype,
    filled: &CodebookCache,
    refs: &[CommVqCache],
    theta: f64,
) {
    let shape = KernelShape::new(d as u32, 4, dtype);
    let Ok(kernel) = CodebookKernel::load(jit, spec, &shape, KV_HEADS) else {
        return; // a scheme the decode does not take (none of CASES)
    };
    let doubled: Vec<CommVqCache> = refs.iter().flat_map(|r| [r.clone(), r.clone()]).collect();
    let uploaded = CodebookCache::upload(stream, kernel.layout(), &doubled, theta).expect("upload");
    let q_len = doubled.len() * KV_HEADS * 4 * d;
    let q: Vec<u16> = (0..q_len)
        .map(|i| to_bits(((i * 7919 % 1000) as f32 / 500.0) - 1.0, dtype))
        .collect();
    let q = stream.clone_htod(&q).expect("q");
    let mut scratch = CodebookScratch::new(stream).expect("scratch");
    let run = |cache: &CodebookCache, scratch: &mut CodebookScratch| {
        let mut out = stream.clone_htod(&vec![0x7e00u16; q_len]).expect("poison");
        kernel
            .attend(stream, cache, &q, &mut out, 3, scratch)
            .expect("decode");
        stream.clone_dtoh(&out).expect("download")
    };
    let a = run(filled, &mut scratch);
    let b = run(&uploaded, &mut scratch);
    assert_eq!(
        a, b,
        "{spec} d{d} {dtype:?}: decode over the GPU-filled cache differs"
    );
}

fn codebook_encode_refuses_bad_inputs_from_the_failing_part_on() {
    let device = Device::open(0).expect("device");
    let jit = Jit::new(&device).expect("jit");
    let stream = device.default_stream();
    let spec: SchemeSpec = COMMVQ1.parse().expect("scheme");
    let d = 128;
    let s = seed();
    let books = train(&spec, d, s);
    let l = layer(600, d, s ^ 0x77);
    let io = inputs(&l, Dtype::F16);
    let encoder =
        CodebookEncoder::load(&jit, &spec, &books, d, KV_HEADS, Dtype::F16).expect("encoder");
    let mut cache = encoder
        .new_cache(&stream, 2, 1000, l.rope.theta)
        .expect("cache");
    let dev = |bits: &[u16]| stream.clone_htod(bits).expect("upload");
    let good = (dev(&io.k_pre.0), dev(&io.k_post.0), dev(&io.v.0));
    let ok = EncodeInputs {
        k_pre_rope: &good.0,
        k_post_rope: &good.1,
        v: &good.2,
        tokens: 300,
    };
    encoder
        .append(&stream, &mut cache, 0, &ok)
        .expect("a good prompt");
    // An infinite value in the eighth row of a later append (token 308): refused, what came before
    // it may stay, nothing from it on.
    let row = KV_HEADS * d;
    let mut v_bad = io.v.0[300 * row..600 * row].to_vec();
    v_bad[7 * row + 5] = 0x7c00;
    let v_bad = dev(&v_bad);
    let rest = |t: &[u16]| dev(&t[300 * row..600 * row]);
    let (a, b) = (rest(&io.k_pre.0), rest(&io.k_post.0));
    let bad = EncodeInputs {
        k_pre_rope: &a,
        k_post_rope: &b,
        v: &v_bad,
        tokens: 1,
    };
    encoder
        .append(&stream, &mut cache, 0, &bad)
        .expect("token 300 is fine");
    let bad = EncodeInputs { tokens: 300, ..bad };
    let e = encoder.append(&stream, &mut cache, 0, &bad);
    assert!(e.is_err(), "an infinite value was appended");
    let msg = e.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        msg.contains("infinite") && msg.contains("sequence 0"),
        "{msg}"
    );
    let len = cache.len(0).expect("slot 0");
    assert!(
        (301..=308).contains(&len),
        "{len} tokens after a refused token 308"
    );
    // Keys whose norm passes f16's range (every channel 60000): the page is refused.
    let huge = dev(&vec![to_bits(60000.0, Dtype::F16); 600 * row]);
    let keys = EncodeInputs {
        k_pre_rope: &huge,
        k_post_rope: &good.1,
        v: &good.2,
        tokens: 600,
    };
    let e = encoder.append(&stream, &mut cache, 1, &keys);
    let msg = e.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("norm"), "{msg}");
    assert_eq!(cache.len(1), Some(0));
    // Too many tokens, a short tensor: refused before any launch.
    let long = EncodeInputs { tokens: 2000, ..ok };
    assert!(encoder.append(&stream, &mut cache, 1, &long).is_err());
    let short = dev(&io.v.0[..10 * row]);
    let short = EncodeInputs {
        v: &short,
        tokens: 11,
        ..ok
    };
    let msg = encoder
        .append(&stream, &mut cache, 1, &short)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(msg.contains("v holds"), "{msg}");
}

/// Prints the encoders' throughput: a 32,768-token prompt of 8 KV heads × 128 (f16) appended to an
/// empty sequence (rows stored, every page coded, the status read), wall-clock median of 5 into
/// fresh slots after one warm-up. Checks nothing beyond success; `--nocapture` shows the numbers.
fn codebook_encode_throughput() {
    let device = Device::open(0).expect("device");
    let jit = Jit::new(&device).expect("jit");
    let stream = device.default_stream();
    let (tokens, heads, d) = (32_768usize, 8usize, 128usize);
    let keys_1 = "k = codebook(rope_commutative, levels = 64, residuals = 10, pairs_per_code = 64, span = token), v = fp16";
    let keys_2 = "k = codebook(rope_commutative, levels = 64, residuals = 21, pairs_per_code = 64, span = token), v = fp16";
    let values_1 = "k = fp16, v = codebook(additive, rows = 128)";
    let values_2 = "k = fp16, v = codebook(additive, rows = 256)";
    for (name, text) in [
        ("CommVQ-1", COMMVQ1),
        ("CommVQ-2", COMMVQ2),
        ("CommVQ-1 keys (values FP16)", keys_1),
        ("CommVQ-2 keys (values FP16)", keys_2),
        ("CommVQ-1 values (keys FP16)", values_1),
        ("CommVQ-2 values (keys FP16)", values_2),
    ] {
        let spec: SchemeSpec = text.parse().expect("scheme");
        let cal = generate(&SynthConfig {
            tokens: 1024,
            kv_heads: heads,
            gqa: 1,
            head_dim: d,
            d_model: 256,
            seed: 5,
            ..Default::default()
        });
        let data = CalibrationData {
            k_pre_rope: &cal.k_pre_rope,
            v: &cal.v,
            rope: cal.rope,
        };
        let books = commvq::train_with(&spec, &data, &TrainOptions::quick(5)).expect("training");
        let encoder =
            CodebookEncoder::load(&jit, &spec, &books, d, heads, Dtype::F16).expect("encoder");
        let n = tokens * heads * d;
        let words: Vec<u16> = (0..n)
            .map(|i| {
                f16::from_f32(((i.wrapping_mul(2_654_435_761) >> 7) % 2001) as f32 / 1000.0 - 1.0)
                    .to_bits()
            })
            .collect();
        let x = stream.clone_htod(&words).expect("upload");
        let inputs = EncodeInputs {
            k_pre_rope: &x,
            k_post_rope: &x,
            v: &x,
            tokens,
        };
        let mut cache = encoder
            .new_cache(&stream, 6, tokens, 10_000.0)
            .expect("cache");
        let mut times = Vec::new();
        for slot in 0..6 {
            stream.synchronize().expect("sync");
            let t = std::time::Instant::now();
            encoder
                .append(&stream, &mut cache, slot, &inputs)
                .expect("append");
            if slot > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let median = times[times.len() / 2];
        println!(
            "{name}: {tokens} tokens × {heads} KV heads × {d} appended in {:.2} ms: {:.3e} tokens/s",
            median * 1e3,
            tokens as f64 / median
        );
    }
}
