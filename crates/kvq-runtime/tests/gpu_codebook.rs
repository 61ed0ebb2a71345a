//! On a GPU: the codebook schemes' (CommVQ's) fused decode against the CPU reference on fresh
//! random layers. Codebooks are trained by the reference, sequences coded by it and uploaded in the
//! device layout (`kvq_reference::commvq::device`); the kernel's outputs, NaN-poisoned before each
//! launch, must match `CommVqCache::attend` within a bound that follows from the computation.
//! `KVQ_SEED` repeats a run's inputs (the seed is printed). Runs under its own harness: without a
//! GPU each test shows as ignored, with the reason; KVQ_REQUIRE_GPU=1 makes that a failure.

mod gated;

use half::{bf16, f16};
use kvq_codegen::{Dtype, KernelShape};
use kvq_reference::attention::Queries;
use kvq_reference::commvq::device::{SideKind, TokenSlot};
use kvq_reference::commvq::{self, CalibrationData, Codebooks, CommVqCache, TrainOptions};
use kvq_reference::synth::{generate, SynthConfig, SynthKv};
use kvq_reference::Dequantized;
use kvq_runtime::codebook::{CodebookCache, CodebookKernel, CodebookScratch};
use kvq_runtime::testing::run_seed as seed;
use kvq_runtime::{Device, Jit};
use kvq_spec::SchemeSpec;

const TESTS: &[(&str, fn())] = &[(
    "codebook_decode_matches_the_reference",
    codebook_decode_matches_the_reference,
)];

fn main() {
    gated::run_gpu_tests(TESTS)
}

/// A scheme (a built-in's name or scheme text) and the head sizes it is checked at.
struct Case {
    text: &'static str,
    dims: &'static [usize],
}

const CASES: &[Case] = &[
    Case {
        text: "commvq1",
        dims: &[128],
    },
    Case {
        text: "commvq2",
        dims: &[128],
    },
    Case {
        text: "k = codebook(rope_commutative, levels = 16, residuals = 3, pairs_per_code = 32, span = head), \
               v = codebook(additive, rows = 64), sink = 16, local = 32, page = 64",
        dims: &[64, 128],
    },
    Case {
        text: "k = codebook(rope_commutative, levels = 32, residuals = 40, pairs_per_code = 32), v = fp16",
        dims: &[64],
    },
    Case {
        text: "k = fp16, v = codebook(additive, rows = 128), sink = 8",
        dims: &[64],
    },
    Case {
        text: "k = codebook(additive, rows = 128), v = codebook(additive, rows = 96), page = 32",
        dims: &[128],
    },
];

const LENGTHS: &[usize] = &[1, 127, 129, 4097, 33_000];
const KV_HEADS: usize = 2;
const CALIBRATION_TOKENS: usize = 1024;

fn spec_of(text: &str) -> SchemeSpec {
    match text {
        "commvq1" => kvq_spec::SchemeSpec::parse(
            "k = codebook(rope_commutative, levels = 64, residuals = 10, pairs_per_code = 64, span = token), \
             v = codebook(additive, rows = 128)",
        ),
        "commvq2" => kvq_spec::SchemeSpec::parse(
            "k = codebook(rope_commutative, levels = 64, residuals = 21, pairs_per_code = 64, span = token), \
             v = codebook(additive, rows = 256)",
        ),
        t => kvq_spec::SchemeSpec::parse(t),
    }
    .unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn layer(tokens: usize, head_dim: usize, gqa: usize, seed: u64) -> SynthKv {
    generate(&SynthConfig {
        tokens,
        kv_heads: KV_HEADS,
        gqa,
        head_dim,
        d_model: 256,
        seed,
        ..Default::default()
    })
}

/// Few EM steps and sweeps: the kernel is checked against the reference on the same codebooks,
/// whatever their quality.
fn train(spec: &SchemeSpec, head_dim: usize, seed: u64) -> Codebooks {
    let cal = layer(CALIBRATION_TOKENS, head_dim, 1, seed);
    let data = CalibrationData {
        k_pre_rope: &cal.k_pre_rope,
        v: &cal.v,
        rope: cal.rope,
    };
    commvq::train_with(spec, &data, &TrainOptions::quick(seed)).expect("training")
}

/// The queries in the kernel's dtype, and as the reference sees them (the same rounded values).
fn io_queries(q: &Queries, dtype: Dtype) -> (Vec<u16>, Queries) {
    let bits: Vec<u16> = q
        .data
        .iter()
        .map(|&x| match dtype {
            Dtype::F16 => f16::from_f32(x).to_bits(),
            Dtype::Bf16 => bf16::from_f32(x).to_bits(),
        })
        .collect();
    let data = bits
        .iter()
        .map(|&b| match dtype {
            Dtype::F16 => f16::from_bits(b).to_f32(),
            Dtype::Bf16 => bf16::from_bits(b).to_f32(),
        })
        .collect();
    (
        bits,
        Queries {
            data,
            q_heads: q.q_heads,
            head_dim: q.head_dim,
        },
    )
}

fn io_value(bits: u16, dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F16 => f16::from_bits(bits).to_f64(),
        Dtype::Bf16 => bf16::from_bits(bits).to_f64(),
    }
}

/// Per channel of each query head, the magnitude of what the kernel sums for it, which scales the
/// rounding its f32 sums can carry: Σ_t p_t·|v_t| over FP16 rows, and for additive values what the
/// kernel computes instead of v̂ — (Σp)·|μ| + Σ_j A_j·|C_j ⊙ σ| with A_j = Σ_t p_t·w_t·s_tj (each
/// row's accumulator, a sum of positive terms, off by at most n·2^-24 of itself).
fn summed_magnitudes(cache: &CommVqCache, deq: &Dequantized, q: &Queries) -> Vec<f64> {
    let p = cache.probabilities(q).expect("probabilities");
    let layout = cache.device_layout().expect("layout");
    let seq = cache.device_sequence().expect("device sequence");
    let books = cache.device_codebooks().expect("device codebooks");
    let (len, d, kv) = (cache.tokens(), cache.head_dim(), cache.kv_heads());
    let gqa = q.q_heads / kv;
    let rows = match layout.v.kind {
        SideKind::Additive { rows } => rows,
        _ => 0,
    };
    let mut out = vec![0.0; q.q_heads * d];
    for qh in 0..q.q_heads {
        let head = qh / gqa;
        let (mut mass, mut acc) = (0.0f64, vec![0.0f64; rows]);
        for t in 0..len {
            let pt = p[qh * len + t];
            match layout.v.locate(len, t) {
                TokenSlot::Page { page, row } if rows > 0 => {
                    let block = &seq.v.blocks[layout.block_range(&layout.v, page, head)];
                    let word =
                        |at: usize| u32::from_le_bytes(block[at..at + 4].try_into().unwrap());
                    let f = layout.v.scales.offset + 2 * row;
                    let w = f16::from_bits(u16::from_le_bytes([block[f], block[f + 1]])).to_f64();
                    mass += pt;
                    for (j, a) in acc.iter_mut().enumerate() {
                        let bits = word(layout.v.codes.offset + 4 * ((j / 32) * layout.page + row));
                        if bits >> (j % 32) & 1 == 1 {
                            *a += pt * w;
                        }
                    }
                }
                _ => {
                    for (c, x) in deq.v.row(head, t).iter().enumerate() {
                        out[qh * d + c] += pt * (*x as f64).abs();
                    }
                }
            }
        }
        for c in 0..d {
            let mut m =
                mass * (books.v_mean.get(head * d + c).copied().unwrap_or(0.0) as f64).abs();
            for (j, a) in acc.iter().enumerate() {
                m += a * (books.v_rows_scaled[(head * rows + j) * d + c] as f64).abs();
            }
            out[qh * d + c] += m;
        }
    }
    out
}

fn codebook_decode_matches_the_reference() {
    let device = Device::open(0).expect("device");
    let jit = Jit::new(&device).expect("jit");
    let stream = device.default_stream();
    let base = seed();
    let mut worst = 0.0f64;
    let mut checked = 0usize;
    for (ci, case) in CASES.iter().enumerate() {
        let spec = spec_of(case.text);
        for &d in case.dims {
            let s = base.wrapping_add((ci * 1000 + d) as u64);
            let books = train(&spec, d, s);
            let full = layer(*LENGTHS.iter().max().unwrap_or(&1), d, 1, s ^ 0x9e37);
            let caches: Vec<CommVqCache> = LENGTHS
                .iter()
                .map(|&n| {
                    let mut l = full.clone();
                    l.truncate(n);
                    CommVqCache::build(&spec, &l.k_pre_rope, &l.v, l.rope, &books)
                        .unwrap_or_else(|e| panic!("{}: build {n}: {e}", case.text))
                })
                .collect();
            let deqs: Vec<Dequantized> = caches.iter().map(CommVqCache::dequantize).collect();
            for gqa in [1usize, 4, 7, 8] {
                for dtype in [Dtype::F16, Dtype::Bf16] {
                    let shape = KernelShape::new(d as u32, gqa as u32, dtype);
                    let kernel = CodebookKernel::load(&jit, &spec, &shape, KV_HEADS)
                        .unwrap_or_else(|e| panic!("{} {shape:?}: {e}", case.text));
                    let gpu =
                        CodebookCache::upload(&stream, kernel.layout(), &caches, full.rope.theta)
                            .expect("upload");
                    // One query set a sequence, from a fresh layer of this GQA.
                    let mut q_bits = Vec::new();
                    let mut q_ref = Vec::new();
                    for (i, _) in LENGTHS.iter().enumerate() {
                        let ql = layer(16, d, gqa, s ^ (0x51ed + (gqa * 97 + i) as u64));
                        let (bits, q) = io_queries(&ql.q, dtype);
                        q_bits.extend(bits);
                        q_ref.push(q);
                    }
                    let q_dev = stream.clone_htod(&q_bits).expect("upload q");
                    let mut scratch = CodebookScratch::new(&stream).expect("scratch");
                    let eps = match dtype {
                        Dtype::F16 => 2f64.powi(-11),
                        Dtype::Bf16 => 2f64.powi(-8),
                    };
                    let q_heads = KV_HEADS * gqa;
                    let wanted: Vec<(Vec<f32>, Vec<f64>)> = caches
                        .iter()
                        .zip(&deqs)
                        .zip(&q_ref)
                        .map(|((c, deq), q)| {
                            (
                                c.attend(q).expect("reference"),
                                summed_magnitudes(c, deq, q),
                            )
                        })
                        .collect();
                    for splits in [1, kernel.default_splits(LENGTHS.len(), 33_000), 7] {
                        // NaN in every output word: a value the kernel never writes fails.
                        let poison = vec![0x7e00u16; q_bits.len()];
                        let mut out = stream.clone_htod(&poison).expect("poison");
                        kernel
                            .attend(&stream, &gpu, &q_dev, &mut out, splits, &mut scratch)
                            .unwrap_or_else(|e| panic!("{} {shape:?}: {e}", case.text));
                        let got: Vec<u16> = stream.clone_dtoh(&out).expect("download");
                        for (i, cache) in caches.iter().enumerate() {
                            let (want, mag) = &wanted[i];
                            // The output's rounding to the dtype; f32 sums over the sequence's
                            // tokens (2^-24 of the summed magnitude a term), and the scores' f32
                            // rounding (1e-4 of it, far above what the f32 sums of 64 rounds and
                            // the RoPE angles, exact to 1e-7, can reach).
                            let n = cache.tokens() as f64;
                            for (j, w) in want.iter().enumerate() {
                                let g = io_value(got[i * q_heads * d + j], dtype);
                                let bound = eps * (*w as f64).abs()
                                    + (n * 2f64.powi(-24) + 1e-4) * mag[j]
                                    + 1e-30;
                                let err = (g - *w as f64).abs();
                                assert!(
                                    err <= bound,
                                    "{} d{d} GQA {gqa} {dtype:?} splits {splits}: sequence of {} tokens, \
                                     output {j}: {g} against {w} (error {err:.3e}, bound {bound:.3e})",
                                    case.text,
                                    cache.tokens()
                                );
                                worst = worst.max(err / bound);
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    println!("{checked} outputs checked; the largest error is {worst:.3} of its bound");
}
