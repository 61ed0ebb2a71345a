//! On a GPU: XQuant's cache writes (`XQuantPagedCache`) on fresh random layers. Three checks a
//! case, for a batch of sequences filled by a prefill and then token-by-token appends:
//!
//! 1. the projection's f16 latent rows against the reference's f64 `X·down` (within the f16
//!    rounding plus a bound on f32 sums);
//! 2. the stored bytes (pages, FP16 sinks, tail rings) **bit for bit** against the reference's
//!    store of the same latent rows (`XQuantCache::from_latents` over the GPU's rows): the
//!    integer store's append, prefill and page quantizers at the latent store's head width. The
//!    rows come from projecting each sequence whole, the stored ones from prefills and one-token
//!    appends — at d_model 1,024 the former launch whole-sum CTAs and the appends one CTA a
//!    partition, so this also checks that a token's latents do not depend on its batch;
//! 3. the decode over the device-written cache against attention over the reference's
//!    rematerialised K and V, outputs NaN-poisoned.
//!
//! `KVQ_SEED` repeats a run's inputs (the seed is printed). Without a GPU the test shows as
//! ignored; KVQ_REQUIRE_GPU=1 makes that a failure.

mod gated;

use kvq_codegen::{Dtype, KernelShape, RebuildPrecision};
use kvq_reference::attention::{self, Queries};
use kvq_reference::synth::SynthRng;
use kvq_reference::synth::{generate, SynthConfig};
use kvq_reference::xquant::{latent_store_width, LatentProjection, Projections, XQuantCache};
use kvq_runtime::testing::layer_stack::LayerStack;
use kvq_runtime::testing::run_seed as seed;
use kvq_runtime::tune::synth::{random_queries, round_to_word, word_to_f32};
use kvq_runtime::xquant::{
    XQuantCacheConfig, XQuantKernel, XQuantPagedCache, XQuantProjector, XQuantScratch,
};
use kvq_runtime::{Device, GpuTimer, Jit, SeqId};
use kvq_spec::SchemeSpec;

const TESTS: &[(&str, fn())] = &[
    (
        "xquant_device_writes_match_the_reference",
        xquant_device_writes_match_the_reference,
    ),
    (
        "xquant_cross_layer_writes_match_the_reference",
        xquant_cross_layer_writes_match_the_reference,
    ),
    ("xquant_write_time", xquant_write_time),
];

fn main() {
    gated::run_gpu_tests(TESTS)
}

struct Case {
    scheme: &'static str,
    kv_heads: usize,
    head_dim: usize,
    gqa: usize,
    dtype: Dtype,
    d_model: usize,
    /// (prefill tokens, appended tokens) a sequence.
    sequences: &'static [(usize, usize)],
}

const CASES: &[Case] = &[
    // 32/8 heads of 128 at d_model 1,024: latents of 1,024 in four store heads of 256.
    Case {
        scheme: "k = int(2, channel), v = int(2, token), source = x(latent)",
        kv_heads: 8,
        head_dim: 128,
        gqa: 4,
        dtype: Dtype::F16,
        d_model: 1024,
        sequences: &[(300, 200), (0, 300), (1000, 40)],
    },
    // SmolLM2's shape (3 KV heads of 64, GQA 3, d_model 576): latents of 192, one store head.
    Case {
        scheme: "k = int(3, channel), v = int(4, token, group = 32), sink = 4, local = 32, \
                 page = 64, source = x(latent)",
        kv_heads: 3,
        head_dim: 64,
        gqa: 3,
        dtype: Dtype::Bf16,
        d_model: 576,
        sequences: &[(1, 150), (129, 70), (700, 1)],
    },
    Case {
        scheme: "k = int(4, channel), v = int(4, token), sink = 8, source = x(latent)",
        kv_heads: 2,
        head_dim: 64,
        gqa: 8,
        dtype: Dtype::Bf16,
        d_model: 256,
        sequences: &[(5, 260), (400, 3)],
    },
];

fn to_f32(bits: &[u16]) -> Vec<f32> {
    bits.iter()
        .map(|&b| half::f16::from_bits(b).to_f32())
        .collect()
}

/// A sequence's stored bytes against the reference's store, bit for bit; returns the page bytes
/// compared.
fn assert_stored_as(
    cache: &XQuantPagedCache,
    id: SeqId,
    reference: &XQuantCache,
    what: &str,
) -> usize {
    let snap = cache.snapshot(id).unwrap();
    assert_eq!(snap.len, reference.tokens(), "{what}");
    let diffs = snap.differences(reference.stored());
    assert!(diffs.is_empty(), "{what}: {}", diffs.join("; "));
    snap.k_pages
        .iter()
        .chain(&snap.v_pages)
        .map(Vec::len)
        .sum::<usize>()
}

/// The f32 values of X-format words.
fn words(bits: &[u16], dtype: Dtype) -> Vec<f32> {
    bits.iter().map(|&b| word_to_f32(b, dtype)).collect()
}

fn norm(row: &[f32]) -> f64 {
    row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt()
}

/// An XQuant-CL case: a stack of layers of one shape.
struct ClCase {
    scheme: &'static str,
    dtype: Dtype,
    d_model: usize,
    sequences: &'static [(usize, usize)],
}

const CL_CASES: &[ClCase] = &[
    // d_model 384 > 2R = 256: the lift solves in the latents' width. The 1,500-token prefill
    // lifts in whole-sum CTAs (141 of them at least fill an H200's 132 SMs), every other write
    // one partition a CTA.
    ClCase {
        scheme: "k = int(2, channel), v = int(2, token), source = x(cross_layer)",
        dtype: Dtype::F16,
        d_model: 384,
        sequences: &[(300, 140), (0, 200), (129, 3), (1500, 2)],
    },
    // d_model 192 < 2R: in d_model's; FP16 sink and local rows hold deltas too.
    ClCase {
        scheme: "k = int(3, channel), v = int(4, token, group = 32), sink = 4, local = 32, \
                 page = 64, source = x(cross_layer)",
        dtype: Dtype::Bf16,
        d_model: 192,
        sequences: &[(1, 150), (200, 70)],
    },
];

/// XQuant-CL's writes over a stack of four layers (2 KV heads of 64, latents of 128): every
/// sequence is prefilled and then appended token by token through the stack, the accumulator
/// carried from layer to layer on the device as an engine would. For each layer and sequence:
/// the delta latents and the accumulator's latents against the reference's f64 projections of
/// the same inputs, the accumulator handed on against `XQuantCache::next_accumulator`, the
/// stored bytes bit for bit against the reference's store of the GPU's delta rows
/// (`XQuantCache::from_cross_layer_latents`), and the decode over the written caches against
/// attention over the reference's reconstruction, outputs NaN-poisoned.
fn xquant_cross_layer_writes_match_the_reference() {
    let s = seed() ^ 0xc1c1;
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.default_stream();
    let (h, d, gqa, depth) = (2usize, 64usize, 4usize, 4usize);
    let (mut latents_checked, mut latent_worst) = (0usize, 0f64);
    let (mut acc_checked, mut acc_worst) = (0usize, 0f64);
    let (mut outputs_checked, mut output_worst) = (0usize, 0f64);
    let mut bytes_checked = 0usize;
    for (ci, case) in CL_CASES.iter().enumerate() {
        let s = s ^ (ci as u64 * 0x7f4a);
        let spec: SchemeSpec = case.scheme.parse().unwrap();
        let (dm, dtype) = (case.d_model, case.dtype);
        let eps = match dtype {
            Dtype::F16 => 2f64.powi(-11),
            Dtype::Bf16 => 2f64.powi(-8),
        };
        let longest = case.sequences.iter().map(|(p, a)| p + a).max().unwrap();
        let shift = 29;
        let stack = LayerStack::new(
            depth,
            &SynthConfig {
                tokens: longest + shift * case.sequences.len(),
                kv_heads: h,
                gqa,
                head_dim: d,
                d_model: dm,
                seed: s,
                ..Default::default()
            },
            dtype,
        );
        let (layers, projs, x_bits) = (&stack.layers, &stack.projections, &stack.x);
        let rank = projs[0].k.rank;
        // Layer l's input rows from..to of sequence i.
        let rows_of = |l: usize, i: usize, from: usize, to: usize| -> &[u16] {
            &x_bits[l][(i * shift + from) * dm..(i * shift + to) * dm]
        };
        let page = spec.page as usize;
        let cfg = XQuantCacheConfig {
            max_seqs: case.sequences.len(),
            pool_pages: case.sequences.len() * (longest / page + 2),
            max_tokens: longest,
            input_dtype: dtype,
        };
        let mut caches: Vec<XQuantPagedCache> = layers
            .iter()
            .zip(projs)
            .map(|(l, p)| {
                XQuantPagedCache::new(&jit, stream.clone(), &spec, p, l.rope, cfg)
                    .unwrap_or_else(|e| panic!("{}: {e}", case.scheme))
            })
            .collect();
        let ids: Vec<Vec<_>> = caches
            .iter_mut()
            .map(|c| {
                case.sequences
                    .iter()
                    .map(|_| c.add_sequence().unwrap())
                    .collect()
            })
            .collect();
        // Writes of the wrong kind or shape are refused, and change nothing.
        {
            let one = stream.clone_htod(rows_of(0, 0, 0, 1)).unwrap();
            let mut short = stream.alloc_zeros::<u16>(dm - 1).unwrap();
            let c = &mut caches[0];
            let id = ids[0][0];
            let err = c.append(&[id], &one, dtype).unwrap_err().to_string();
            assert!(err.contains("append_cross_layer"), "{err}");
            let err = c
                .append_cross_layer(&[id], &one, &mut short, dtype)
                .unwrap_err()
                .to_string();
            assert!(err.contains("x_hat"), "{err}");
            assert_eq!(c.len(id).unwrap(), 0);
            let latent: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(latent)"
                .parse()
                .unwrap();
            let mut plain = XQuantPagedCache::new(
                &jit,
                stream.clone(),
                &latent,
                &projs[0],
                layers[0].rope,
                cfg,
            )
            .unwrap();
            let seq = plain.add_sequence().unwrap();
            let mut x_hat = stream.alloc_zeros::<u16>(dm).unwrap();
            let err = plain
                .append_cross_layer(&[seq], &one, &mut x_hat, dtype)
                .unwrap_err()
                .to_string();
            assert!(err.contains("x(latent)"), "{err}");
            assert!(plain.accumulator_latents().is_none());
        }
        // acc[l][i]: the accumulator the GPU handed layer l for sequence i's tokens (X̂_{l−1};
        // zeros at layer 0), acc[depth][i] the last layer's.
        let mut acc = vec![vec![Vec::<u16>::new(); case.sequences.len()]; depth + 1];
        for (i, &(p, _)) in case.sequences.iter().enumerate() {
            if p == 0 {
                continue;
            }
            let mut x_hat = stream.alloc_zeros::<u16>(p * dm).unwrap();
            for l in 0..depth {
                acc[l][i].extend(stream.clone_dtoh(&x_hat).unwrap());
                let x = stream.clone_htod(rows_of(l, i, 0, p)).unwrap();
                caches[l]
                    .prefill_cross_layer(ids[l][i], &x, &mut x_hat, p, dtype)
                    .unwrap_or_else(|e| panic!("{} layer {l}: {e}", case.scheme));
            }
            acc[depth][i].extend(stream.clone_dtoh(&x_hat).unwrap());
            // A second prefill of the sequence is refused before anything is written (the
            // accumulator's rows go first, so the store's own refusal would come too late).
            let x = stream.clone_htod(rows_of(0, i, 0, p)).unwrap();
            let err = caches[0]
                .prefill_cross_layer(ids[0][i], &x, &mut x_hat, p, dtype)
                .unwrap_err()
                .to_string();
            assert!(err.contains("empty sequence"), "{err}");
        }
        let steps = case.sequences.iter().map(|s| s.1).max().unwrap();
        for j in 0..steps {
            let active: Vec<usize> = (0..case.sequences.len())
                .filter(|&i| j < case.sequences[i].1)
                .collect();
            let mut x_hat = stream.alloc_zeros::<u16>(active.len() * dm).unwrap();
            for l in 0..=depth {
                let got: Vec<u16> = stream.clone_dtoh(&x_hat).unwrap();
                for (r, &i) in active.iter().enumerate() {
                    acc[l][i].extend_from_slice(&got[r * dm..(r + 1) * dm]);
                }
                if l == depth {
                    break;
                }
                let rows: Vec<u16> = active
                    .iter()
                    .flat_map(|&i| {
                        let p = case.sequences[i].0;
                        rows_of(l, i, p + j, p + j + 1).iter().copied()
                    })
                    .collect();
                let x = stream.clone_htod(&rows).unwrap();
                let step_ids: Vec<_> = active.iter().map(|&i| ids[l][i]).collect();
                caches[l]
                    .append_cross_layer(&step_ids, &x, &mut x_hat, dtype)
                    .unwrap_or_else(|e| panic!("{} layer {l} step {j}: {e}", case.scheme));
            }
        }

        let q_heads = h * gqa;
        let per = q_heads * d;
        let mut scratch = XQuantScratch::new(&stream).unwrap();
        for l in 0..depth {
            let proj = &projs[l];
            let (base_k, base_v, base_rows) = caches[l].accumulator_latents().unwrap();
            let (base_k, base_v) = (
                to_f32(&stream.clone_dtoh(base_k).unwrap()),
                to_f32(&stream.clone_dtoh(base_v).unwrap()),
            );
            let mut references = Vec::new();
            for (i, &(p, a)) in case.sequences.iter().enumerate() {
                let n = p + a;
                let x_vals = words(rows_of(l, i, 0, n), dtype);
                let prev = words(&acc[l][i], dtype);
                let next = words(&acc[l + 1][i], dtype);
                let x_dev = stream.clone_htod(rows_of(l, i, 0, n)).unwrap();
                let prev_dev = stream.clone_htod(&acc[l][i]).unwrap();
                let (dk, dv) = caches[l]
                    .project_cross_layer(&x_dev, &prev_dev, n, dtype)
                    .unwrap();
                let (dk, dv) = (to_f32(&dk), to_f32(&dv));
                let delta: Vec<f32> = x_vals.iter().zip(&prev).map(|(a, b)| a - b).collect();
                let at = ids[l][i].0 as usize * base_rows * rank;
                let (bk, bv) = (&base_k[at..at + n * rank], &base_v[at..at + n * rank]);
                // Delta latents (δ rounded to X's format first) and the accumulator's latents
                // (f16 rows) against f64 projections: f16's rounding of the latent, δ's
                // rounding, f32 sums of products with down's two halves.
                for (what, got, src, lp, rounding) in [
                    ("delta K", &dk, &delta, &proj.k, eps),
                    ("delta V", &dv, &delta, &proj.v, eps),
                    ("accumulator K", &bk.to_vec(), &prev, &proj.k, 0.0),
                    ("accumulator V", &bv.to_vec(), &prev, &proj.v, 0.0),
                ] {
                    let want = lp.project(src);
                    for t in 0..n {
                        let nrm = norm(&src[t * dm..(t + 1) * dm]);
                        for c in 0..rank {
                            let (g, w) = (got[t * rank + c] as f64, want[t * rank + c] as f64);
                            let bound = 2f64.powi(-11) * w.abs()
                                + (rounding + 2f64.powi(-16)) * nrm
                                + 1e-30;
                            let err = (g - w).abs();
                            assert!(
                                err <= bound,
                                "{} layer {l} {what}: sequence {i} token {t} channel {c}: {g} \
                                 against {w} (error {err:.3e}, bound {bound:.3e})",
                                case.scheme
                            );
                            latent_worst = latent_worst.max(err / bound);
                            latents_checked += 1;
                        }
                    }
                }
                // The accumulator handed on: the GPU's f32 lift of its own delta rows, rounded
                // to X's format, against the reference's f64 lift of the same rows.
                let want = XQuantCache::next_accumulator(proj, &prev, &dk, &dv).unwrap();
                for t in 0..n {
                    let row = &want[t * dm..(t + 1) * dm];
                    let top = row.iter().fold(1e-6f64, |m, w| m.max(w.abs() as f64));
                    for c in 0..dm {
                        let (g, w) = (next[t * dm + c] as f64, row[c] as f64);
                        let bound = eps * w.abs() + 1e-4 * top;
                        let err = (g - w).abs();
                        assert!(
                            err <= bound,
                            "{} layer {l} accumulator out: sequence {i} token {t} channel {c}: \
                             {g} against {w} (error {err:.3e}, bound {bound:.3e})",
                            case.scheme
                        );
                        acc_worst = acc_worst.max(err / bound);
                        acc_checked += 1;
                    }
                }
                let reference = XQuantCache::from_cross_layer_latents(
                    &spec,
                    (&dk, &dv),
                    (bk, bv),
                    proj,
                    layers[l].rope,
                )
                .unwrap();
                let what = format!("{} layer {l}: sequence {i}", case.scheme);
                bytes_checked += assert_stored_as(&caches[l], ids[l][i], &reference, &what);
                references.push(reference);
            }
            let (q_bits, q_vals) =
                random_queries(references.len() * per, dtype, s ^ 5 ^ l as u64).unwrap();
            let q_dev = stream.clone_htod(&q_bits).unwrap();
            let shape = KernelShape::new(d as u32, gqa as u32, dtype);
            for precision in [RebuildPrecision::F32, RebuildPrecision::F16] {
                let kernel = XQuantKernel::load(&jit, &spec, &shape, h, dm, precision)
                    .unwrap_or_else(|e| panic!("{}: {e}", case.scheme));
                for splits in [1usize, 5] {
                    let mut out = stream.clone_htod(&vec![0x7e00u16; q_bits.len()]).unwrap();
                    kernel
                        .attend_paged(&stream, &caches[l], &q_dev, &mut out, splits, &mut scratch)
                        .unwrap();
                    let got: Vec<u16> = stream.clone_dtoh(&out).unwrap();
                    for (i, reference) in references.iter().enumerate() {
                        let q = Queries {
                            data: q_vals[i * per..][..per].to_vec(),
                            q_heads,
                            head_dim: d,
                        };
                        let kv = match precision {
                            RebuildPrecision::F32 => reference.dequantize(),
                            RebuildPrecision::F16 => reference.dequantize_f16_rebuild(),
                        };
                        let want = attention::decode(&q, &kv, None).unwrap();
                        let top = want.iter().fold(1e-6f64, |m, w| m.max(w.abs() as f64));
                        for (j, w) in want.iter().enumerate() {
                            let g = word_to_f32(got[i * per + j], dtype) as f64;
                            let bound = eps * (*w as f64).abs() + 1e-4 * top;
                            let err = (g - *w as f64).abs();
                            assert!(
                                err <= bound,
                                "{} layer {l} {precision:?} splits {splits}: sequence {i}, \
                                 output {j}: {g} against {w} (error {err:.3e}, bound {bound:.3e})",
                                case.scheme
                            );
                            output_worst = output_worst.max(err / bound);
                            outputs_checked += 1;
                        }
                    }
                }
            }
        }
        let mem = caches[0].memory().unwrap();
        println!(
            "{}: d_model {dm}, latents of {rank}, {depth} layers; layer 0 holds {} bytes for its \
             sequences ({:.1} bits a latent element with the accumulator's latents)",
            case.scheme, mem.sequence_bytes, mem.bits_per_element
        );
    }
    println!(
        "XQuant-CL: {latents_checked} latents within {latent_worst:.3} of their bound; \
         {acc_checked} accumulator values within {acc_worst:.3}; {bytes_checked} page bytes \
         bit-exact; {outputs_checked} outputs within {output_worst:.3} of their bound"
    );
}

fn xquant_device_writes_match_the_reference() {
    let s = seed();
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.default_stream();
    let (mut latents_checked, mut latent_worst) = (0usize, 0f64);
    let (mut outputs_checked, mut output_worst) = (0usize, 0f64);
    let mut bytes_checked = 0usize;
    for (ci, case) in CASES.iter().enumerate() {
        let s = s ^ (ci as u64 * 0x9e37);
        let spec: SchemeSpec = case.scheme.parse().unwrap();
        let (h, d, dm) = (case.kv_heads, case.head_dim, case.d_model);
        let longest = case.sequences.iter().map(|(p, a)| p + a).max().unwrap();
        let shift = 37;
        let layer = generate(&SynthConfig {
            tokens: longest + shift * case.sequences.len(),
            kv_heads: h,
            gqa: case.gqa,
            head_dim: d,
            d_model: dm,
            seed: s,
            ..Default::default()
        });
        let proj = Projections::from_weights(&layer.layer.w_k, &layer.layer.w_v, dm, h, d).unwrap();
        let rank = proj.k.rank;
        let width = latent_store_width(&spec, rank).unwrap();
        let (x_bits, x_vals): (Vec<u16>, Vec<f32>) = layer
            .layer
            .x
            .iter()
            .map(|&v| round_to_word(v, case.dtype))
            .unzip();
        let page = spec.page as usize;
        let cfg = XQuantCacheConfig {
            max_seqs: case.sequences.len(),
            pool_pages: case.sequences.len() * (longest / page + 2),
            max_tokens: longest,
            input_dtype: case.dtype,
        };
        let mut cache = XQuantPagedCache::new(&jit, stream.clone(), &spec, &proj, layer.rope, cfg)
            .unwrap_or_else(|e| panic!("{}: {e}", case.scheme));
        assert_eq!(cache.weights().store_width(), width);
        // Sequence i holds the layer input's rows from i·shift on.
        let rows_of = |i: usize, from: usize, to: usize| {
            let at = (i * shift + from) * dm;
            (
                &x_bits[at..at + (to - from) * dm],
                &x_vals[at..at + (to - from) * dm],
            )
        };

        // 1. The projection's rows against the reference's f64 sums.
        let mut gpu_latents = Vec::new();
        for (i, &(p, a)) in case.sequences.iter().enumerate() {
            let n = p + a;
            let (bits, vals) = rows_of(i, 0, n);
            let x_dev = stream.clone_htod(bits).unwrap();
            let (lk, lv) = cache.project(&x_dev, n, case.dtype).unwrap();
            for (name, got, lp) in [("K", &lk, &proj.k), ("V", &lv, &proj.v)] {
                let want = lp.project(vals);
                for t in 0..n {
                    let norm = vals[t * dm..(t + 1) * dm]
                        .iter()
                        .map(|v| (*v as f64).powi(2))
                        .sum::<f64>()
                        .sqrt();
                    for c in 0..rank {
                        let (g, w) = (
                            half::f16::from_bits(got[t * rank + c]).to_f32() as f64,
                            want[t * rank + c] as f64,
                        );
                        // f16's rounding of the latent, plus f32 sums of products of X with
                        // down's two halves: each latent is a dot product with a unit column.
                        let bound = 2f64.powi(-11) * w.abs() + 2f64.powi(-16) * norm + 1e-30;
                        let err = (g - w).abs();
                        assert!(
                            err <= bound,
                            "{} {name} latent: sequence {i} token {t} channel {c}: {g} against \
                             {w} (error {err:.3e}, bound {bound:.3e})",
                            case.scheme
                        );
                        latent_worst = latent_worst.max(err / bound);
                        latents_checked += 1;
                    }
                }
            }
            gpu_latents.push((to_f32(&lk), to_f32(&lv)));
        }

        // 2. Prefill, then appends a token at a time across the batch.
        let ids: Vec<_> = case
            .sequences
            .iter()
            .map(|_| cache.add_sequence().unwrap())
            .collect();
        for (i, &(p, _)) in case.sequences.iter().enumerate() {
            if p > 0 {
                let x_dev = stream.clone_htod(rows_of(i, 0, p).0).unwrap();
                cache.prefill(ids[i], &x_dev, p, case.dtype).unwrap();
            }
        }
        let steps = case.sequences.iter().map(|s| s.1).max().unwrap();
        for j in 0..steps {
            let mut step_ids = Vec::new();
            let mut step_rows = Vec::new();
            for (i, &(p, a)) in case.sequences.iter().enumerate() {
                if j < a {
                    step_ids.push(ids[i]);
                    step_rows.extend_from_slice(rows_of(i, p + j, p + j + 1).0);
                }
            }
            let x_dev = stream.clone_htod(&step_rows).unwrap();
            cache.append(&step_ids, &x_dev, case.dtype).unwrap();
        }
        let mut references = Vec::new();
        for (i, (lk, lv)) in gpu_latents.iter().enumerate() {
            let reference = XQuantCache::from_latents(&spec, lk, lv, &proj, layer.rope).unwrap();
            let what = format!("{}: sequence {i}", case.scheme);
            bytes_checked += assert_stored_as(&cache, ids[i], &reference, &what);
            references.push(reference);
        }

        // 3. The decode over the written cache.
        let shape = KernelShape::new(d as u32, case.gqa as u32, case.dtype);
        let kernel = XQuantKernel::load(&jit, &spec, &shape, h, dm, RebuildPrecision::F16)
            .unwrap_or_else(|e| panic!("{}: {e}", case.scheme));
        let q_heads = h * case.gqa;
        let per = q_heads * d;
        let (q_bits, q_vals) = random_queries(references.len() * per, case.dtype, s ^ 5).unwrap();
        let q_dev = stream.clone_htod(&q_bits).unwrap();
        let mut scratch = XQuantScratch::new(&stream).unwrap();
        let eps = match case.dtype {
            Dtype::F16 => 2f64.powi(-11),
            Dtype::Bf16 => 2f64.powi(-8),
        };
        for splits in [1usize, 5] {
            let mut out = stream.clone_htod(&vec![0x7e00u16; q_bits.len()]).unwrap();
            kernel
                .attend_paged(&stream, &cache, &q_dev, &mut out, splits, &mut scratch)
                .unwrap();
            let got: Vec<u16> = stream.clone_dtoh(&out).unwrap();
            for (i, reference) in references.iter().enumerate() {
                let q = Queries {
                    data: q_vals[i * per..][..per].to_vec(),
                    q_heads,
                    head_dim: d,
                };
                let want =
                    attention::decode(&q, &reference.dequantize_f16_rebuild(), None).unwrap();
                let top = want.iter().fold(1e-6f64, |m, w| m.max(w.abs() as f64));
                for (j, w) in want.iter().enumerate() {
                    let g = word_to_f32(got[i * per + j], case.dtype) as f64;
                    let bound = eps * (*w as f64).abs() + 1e-4 * top;
                    let err = (g - *w as f64).abs();
                    assert!(
                        err <= bound,
                        "{} splits {splits}: sequence {i}, output {j}: {g} against {w} (error \
                         {err:.3e}, bound {bound:.3e})",
                        case.scheme
                    );
                    output_worst = output_worst.max(err / bound);
                    outputs_checked += 1;
                }
            }
        }
        println!(
            "{}: latents of {rank} in {} store heads of {width}; {} sequences written",
            case.scheme,
            rank / width,
            ids.len()
        );
    }
    println!(
        "{latents_checked} latents within {latent_worst:.3} of their bound; {bytes_checked} page \
         bytes bit-exact; {outputs_checked} outputs within {output_worst:.3} of their bound"
    );
}

/// Times the writes (printing only: docs/BENCHMARKS.md holds the measured tables) at d_model
/// 4,096 and 8 KV heads of 128 (latents of 1,024), X in f16: the projection alone for 16, 4,096
/// and 32,768 tokens (its rate counts the useful 2·n·d_model·2R FLOP; the kernel runs twice
/// that, down's two halves), an append step of 16 sequences, and a 4,096-token prefill. The
/// projections are random (the time does not depend on their values).
fn xquant_write_time() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.default_stream();
    let timer = GpuTimer::new(&jit).expect("timer");
    let (kv, d, dm) = (8usize, 128usize, 4096usize);
    let r = kv * d;
    let mut rng = SynthRng::new(0x5eed);
    let mut random =
        |n: usize, scale: f32| -> Vec<f32> { (0..n).map(|_| scale * rng.symmetric()).collect() };
    let factor = |down: Vec<f32>, up: Vec<f32>| LatentProjection {
        d_model: dm,
        out: r,
        rank: r,
        down,
        up,
        singular: vec![1.0; r],
    };
    let proj = Projections {
        kv_heads: kv,
        head_dim: d,
        k: factor(random(dm * r, 0.02), random(r * r, 0.05)),
        v: factor(random(dm * r, 0.02), random(r * r, 0.05)),
    };
    let spec: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(latent)"
        .parse()
        .unwrap();
    let max_n = 32768;
    let cfg = XQuantCacheConfig {
        max_seqs: 17,
        pool_pages: 16 * (max_n / 128 + 2),
        max_tokens: max_n,
        input_dtype: Dtype::F16,
    };
    let mut cache =
        XQuantPagedCache::new(&jit, stream.clone(), &spec, &proj, Default::default(), cfg).unwrap();
    let x_bits: Vec<u16> = random(max_n * dm, 1.0)
        .iter()
        .map(|&v| round_to_word(v, Dtype::F16).0)
        .collect();
    let mut projector = XQuantProjector::load(&jit, Dtype::F16, dm, r).unwrap();
    let mut lk = stream.alloc_zeros::<u16>(max_n * r).unwrap();
    let mut lv = stream.alloc_zeros::<u16>(max_n * r).unwrap();
    for n in [16usize, 4096, 32768] {
        let x = stream.clone_htod(&x_bits[..n * dm]).unwrap();
        let us = timer
            .time(&stream, 2, 10, |s| {
                projector.project(s, cache.weights(), &x, n, &mut lk, &mut lv)
            })
            .unwrap()
            .median_us();
        let flops = 2.0 * (n * dm * 2 * r) as f64;
        println!(
            "projection of {n} tokens: {us:.1} us ({:.0} TFLOP/s of useful work)",
            flops / us / 1e6
        );
    }
    let ids: Vec<_> = (0..16).map(|_| cache.add_sequence().unwrap()).collect();
    let step = stream.clone_htod(&x_bits[..16 * dm]).unwrap();
    let us = timer
        .time(&stream, 2, 10, |_| cache.append(&ids, &step, Dtype::F16))
        .unwrap()
        .median_us();
    println!(
        "append step of 16 sequences (projection, append, page quantizers, commit): {us:.1} us"
    );
    let prompt = stream.clone_htod(&x_bits[..4096 * dm]).unwrap();
    let mut seq = cache.add_sequence();
    let us = timer
        .time(&stream, 1, 5, |_| {
            if let Ok(id) = seq {
                cache.remove_sequence(id)?;
            }
            let id = cache.add_sequence()?;
            seq = Ok(id);
            cache.prefill(id, &prompt, 4096, Dtype::F16)
        })
        .unwrap()
        .median_us();
    println!("prefill of 4,096 tokens (projection, copies, page quantizers): {us:.1} us");

    // XQuant-CL: the same writes plus the delta, the accumulator's projection and rows, the lift.
    let cl_spec: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(cross_layer)"
        .parse()
        .unwrap();
    let started = std::time::Instant::now();
    let cl_cfg = XQuantCacheConfig {
        max_tokens: 4096 + 16,
        ..cfg
    };
    let mut cl = XQuantPagedCache::new(
        &jit,
        stream.clone(),
        &cl_spec,
        &proj,
        Default::default(),
        cl_cfg,
    )
    .unwrap();
    println!(
        "XQuant-CL cache created in {:.1} s (most of it the lift matrix's solve on the host)",
        started.elapsed().as_secs_f64()
    );
    let ids: Vec<_> = (0..16).map(|_| cl.add_sequence().unwrap()).collect();
    let mut x_hat = stream.alloc_zeros::<u16>(16 * dm).unwrap();
    let us = timer
        .time(&stream, 2, 10, |_| {
            cl.append_cross_layer(&ids, &step, &mut x_hat, Dtype::F16)
        })
        .unwrap()
        .median_us();
    println!("XQuant-CL append step of 16 sequences: {us:.1} us");
    let mut x_hat = stream.alloc_zeros::<u16>(4096 * dm).unwrap();
    let mut seq = cl.add_sequence();
    let us = timer
        .time(&stream, 1, 5, |_| {
            if let Ok(id) = seq {
                cl.remove_sequence(id)?;
            }
            let id = cl.add_sequence()?;
            seq = Ok(id);
            cl.prefill_cross_layer(id, &prompt, &mut x_hat, 4096, Dtype::F16)
        })
        .unwrap()
        .median_us();
    println!("XQuant-CL prefill of 4,096 tokens: {us:.1} us");
}
