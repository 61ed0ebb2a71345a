//! On a GPU: XQuant's latent decode (`source = x(latent)`) against the CPU reference on fresh
//! random layers. The reference builds each sequence's latent cache from the layer input and the
//! projections' SVD (`XQuantCache::build`), the cache's integer store is uploaded as it is, and the
//! kernel's outputs, NaN-poisoned before each launch, must match attention over the reference's
//! rematerialised K and V (`XQuantCache::dequantize`, `attention::decode`) within a bound that
//! follows from f32 arithmetic. `KVQ_SEED` repeats a run's inputs (the seed is printed). Runs under
//! its own harness: without a GPU the test shows as ignored, with the reason; KVQ_REQUIRE_GPU=1
//! makes that a failure.

mod gated;

use kvq_codegen::{Dtype, KernelShape, RebuildPrecision};
use kvq_reference::attention::{self, Queries};
use kvq_reference::synth::{generate, SynthConfig, SynthRng};
use kvq_reference::xquant::{Projections, XQuantCache};
use kvq_runtime::testing::run_seed as seed;
use kvq_runtime::tune::synth::{random_queries, word_to_f32};
use kvq_runtime::xquant::{XQuantDeviceCache, XQuantKernel, XQuantScratch};
use kvq_runtime::{Device, GpuTimer, Jit};
use kvq_spec::SchemeSpec;

const TESTS: &[(&str, fn())] = &[
    (
        "xquant_decode_matches_the_reference",
        xquant_decode_matches_the_reference,
    ),
    (
        "xquant_cross_layer_stack_matches_the_reference",
        xquant_cross_layer_stack_matches_the_reference,
    ),
    ("xquant_decode_time", xquant_decode_time),
];

fn main() {
    gated::run_gpu_tests(TESTS)
}

const KV_HEADS: usize = 2;

struct Case {
    scheme: &'static str,
    head_dim: usize,
    gqa: usize,
    dtype: Dtype,
    d_model: usize,
    lengths: &'static [usize],
}

const CASES: &[Case] = &[
    Case {
        scheme: "k = int(2, channel), v = int(2, token), source = x(latent)",
        head_dim: 64,
        gqa: 1,
        dtype: Dtype::F16,
        d_model: 96,
        lengths: &[1, 129, 4097, 33000],
    },
    Case {
        scheme: "k = int(3, channel), v = int(3, token), source = x(latent)",
        head_dim: 64,
        gqa: 7,
        dtype: Dtype::Bf16,
        d_model: 256,
        lengths: &[1, 129, 4097],
    },
    Case {
        scheme: "k = int(4, channel), v = int(4, token), source = x(latent)",
        head_dim: 128,
        gqa: 4,
        dtype: Dtype::F16,
        d_model: 512,
        lengths: &[1, 129, 4097],
    },
    Case {
        scheme:
            "k = int(2, channel), v = int(2, token, group = 32), sink = 4, local = 32, page = 64, \
                 source = x(latent)",
        head_dim: 64,
        gqa: 8,
        dtype: Dtype::Bf16,
        d_model: 576,
        lengths: &[1, 3, 101, 4097],
    },
    Case {
        scheme: "k = int(2, channel), v = int(2, token), source = x(latent)",
        head_dim: 128,
        gqa: 1,
        dtype: Dtype::Bf16,
        d_model: 256,
        lengths: &[1, 129, 4097, 33000],
    },
    Case {
        scheme: "k = int(4, channel), v = int(2, token), sink = 8, source = x(latent)",
        head_dim: 256,
        gqa: 2,
        dtype: Dtype::F16,
        d_model: 512,
        lengths: &[1, 129, 1000],
    },
    // Latents of 320 in two store heads of 160 (docs/LAYOUT.md §10), grouped V on CUDA cores.
    Case {
        scheme: "k = int(4, channel), v = int(2, token, group = 32), source = x(latent)",
        head_dim: 256,
        gqa: 1,
        dtype: Dtype::F16,
        d_model: 320,
        lengths: &[1, 129, 2000],
    },
    // head_dim 96 on the warpgroup rebuild (m64n96 MMAs), three chunks of 64 latents.
    Case {
        scheme: "k = int(2, channel), v = int(4, token), source = x(latent)",
        head_dim: 96,
        gqa: 2,
        dtype: Dtype::F16,
        d_model: 192,
        lengths: &[1, 129, 4097],
    },
    Case {
        scheme: "k = int(8, channel, symmetric), v = int(3, token), source = x(latent)",
        head_dim: 96,
        gqa: 3,
        dtype: Dtype::F16,
        d_model: 192,
        lengths: &[1, 200],
    },
];

/// One scheme and shape over a batch of caches (one per sequence), both rebuild precisions, 1/3/16
/// splits: every output against the reference's attention within its bound. Returns the outputs
/// checked and the largest error over its bound.
fn check_batch(
    jit: &Jit,
    label: &str,
    spec: &SchemeSpec,
    shape: KernelShape,
    d_model: usize,
    caches: &[XQuantCache],
    seed: u64,
) -> (usize, f64) {
    let stream = jit.device().default_stream();
    let (d, gqa) = (shape.head_dim as usize, shape.gqa as usize);
    let q_heads = KV_HEADS * gqa;
    let per = q_heads * d;
    let (q_bits, q_vals) = random_queries(caches.len() * per, shape.dtype, seed ^ 7).unwrap();
    let gpu = XQuantDeviceCache::upload(&stream, caches).expect("upload");
    let q_dev = stream.clone_htod(&q_bits).unwrap();
    let mut scratch = XQuantScratch::new(&stream).unwrap();
    let eps = match shape.dtype {
        Dtype::F16 => 2f64.powi(-11),
        Dtype::Bf16 => 2f64.powi(-8),
    };
    let (mut checked, mut worst) = (0usize, 0f64);
    for precision in [RebuildPrecision::F32, RebuildPrecision::F16] {
        let kernel = XQuantKernel::load(jit, spec, &shape, KV_HEADS, d_model, precision)
            .unwrap_or_else(|e| panic!("{label} {shape:?} {precision:?}: {e}"));
        // The one-pass rebuild's reference rounds the latents and up_k to f16 first, as the
        // kernel does; what is left in both is f32 summation.
        let wanted: Vec<Vec<f32>> = caches
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let q = Queries {
                    data: q_vals[i * per..][..per].to_vec(),
                    q_heads,
                    head_dim: d,
                };
                let kv = match precision {
                    RebuildPrecision::F32 => c.dequantize(),
                    RebuildPrecision::F16 => c.dequantize_f16_rebuild(),
                };
                attention::decode(&q, &kv, None).unwrap()
            })
            .collect();
        for splits in [1usize, 3, 16] {
            let mut out = stream.clone_htod(&vec![0x7e00u16; q_bits.len()]).unwrap();
            kernel
                .attend(&stream, &gpu, &q_dev, &mut out, splits, &mut scratch)
                .unwrap_or_else(|e| panic!("{label}: {e}"));
            let got: Vec<u16> = stream.clone_dtoh(&out).unwrap();
            for (i, want) in wanted.iter().enumerate() {
                let top = want.iter().fold(1e-6f64, |m, w| m.max(w.abs() as f64));
                for (j, w) in want.iter().enumerate() {
                    let g = word_to_f32(got[i * per + j], shape.dtype) as f64;
                    // The output's rounding to the dtype, plus f32 sums (K rebuilt over the
                    // latent, scores, Σ p·l̂) against the reference's f64: 1e-4 of the largest
                    // output is far above both.
                    let bound = eps * (*w as f64).abs() + 1e-4 * top;
                    let err = (g - *w as f64).abs();
                    assert!(
                        err <= bound,
                        "{label} d{d} GQA {gqa} {:?} {precision:?} splits {splits}: sequence of \
                         {} tokens, output {j}: {g} against {w} (error {err:.3e}, bound \
                         {bound:.3e})",
                        shape.dtype,
                        caches[i].tokens()
                    );
                    worst = worst.max(err / bound);
                    checked += 1;
                }
            }
        }
    }
    (checked, worst)
}

fn xquant_decode_matches_the_reference() {
    let s = seed();
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let (mut checked, mut worst) = (0usize, 0f64);
    for (ci, case) in CASES.iter().enumerate() {
        let s = s ^ (ci as u64 * 0x51ed);
        let spec: SchemeSpec = case.scheme.parse().unwrap();
        let (d, gqa, dm) = (case.head_dim, case.gqa, case.d_model);
        let longest = *case.lengths.iter().max().unwrap();
        let layer = generate(&SynthConfig {
            tokens: longest,
            kv_heads: KV_HEADS,
            gqa,
            head_dim: d,
            d_model: dm,
            seed: s,
            ..Default::default()
        });
        let proj =
            Projections::from_weights(&layer.layer.w_k, &layer.layer.w_v, dm, KV_HEADS, d).unwrap();
        let caches: Vec<XQuantCache> = case
            .lengths
            .iter()
            .map(|&n| {
                XQuantCache::build(&spec, &layer.layer.x[..n * dm], &proj, layer.rope).unwrap()
            })
            .collect();
        let shape = KernelShape::new(d as u32, gqa as u32, case.dtype);
        let (n, w) = check_batch(&jit, case.scheme, &spec, shape, dm, &caches, s);
        checked += n;
        worst = worst.max(w);
    }
    println!("{checked} outputs checked; the largest error is {worst:.3} of its bound");
}

/// XQuant-CL over a stack of four layers: each layer's cache holds the latents of its input's
/// delta against the accumulator the previous layers built (`XQuantCache::build_cross_layer`),
/// and the decode adds the accumulator's latents back. Every layer of two sequences (129 and 700
/// tokens, FP16 local rows among them) against the reference.
fn xquant_cross_layer_stack_matches_the_reference() {
    let s = seed() ^ 0xc1;
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let text = "k = int(2, channel), v = int(2, token), source = x(cross_layer)";
    let spec: SchemeSpec = text.parse().unwrap();
    // d_model 96 < 2·kv_heads·head_dim: both latents together determine X, so the accumulator
    // tracks it (docs/CODEBOOKS.md §3.1; the device-written stacks of gpu_xquant_writes run at
    // d_model 192 and 384).
    let (d, gqa, dm, lengths) = (64usize, 4usize, 96usize, [129usize, 700]);
    let layers: Vec<_> = (0..4u64)
        .map(|i| {
            generate(&SynthConfig {
                tokens: 700,
                kv_heads: KV_HEADS,
                gqa,
                head_dim: d,
                d_model: dm,
                seed: s.wrapping_add(i),
                ..Default::default()
            })
        })
        .collect();
    let projections: Vec<Projections> = layers
        .iter()
        .map(|l| Projections::from_weights(&l.layer.w_k, &l.layer.w_v, dm, KV_HEADS, d).unwrap())
        .collect();
    // Each sequence walks the stack, carrying its accumulator X̂ from layer to layer.
    let mut per_layer: Vec<Vec<XQuantCache>> = vec![Vec::new(); layers.len()];
    for &n in &lengths {
        let mut x_hat = vec![0f32; n * dm];
        for (i, (layer, proj)) in layers.iter().zip(&projections).enumerate() {
            let (cache, next) = XQuantCache::build_cross_layer(
                &spec,
                &layer.layer.x[..n * dm],
                &x_hat,
                proj,
                layer.rope,
            )
            .unwrap();
            per_layer[i].push(cache);
            x_hat = next;
        }
    }
    let shape = KernelShape::new(d as u32, gqa as u32, Dtype::F16);
    let (mut checked, mut worst) = (0usize, 0f64);
    for (i, caches) in per_layer.iter().enumerate() {
        let label = format!("{text}, layer {i}");
        let (n, w) = check_batch(&jit, &label, &spec, shape, dm, caches, s ^ i as u64);
        checked += n;
        worst = worst.max(w);
    }
    println!(
        "{checked} outputs over 4 layers checked; the largest error is {worst:.3} of its bound"
    );
}

/// Times the decode of XQuant-2, XQuant-4 and XQuant-CL-2 (printing only: docs/BENCHMARKS.md holds
/// the measured tables) at 32 query / 8 KV heads of 128 and latents of 1,024 channels (the latent
/// width of any d_model ≥ 1,024, 4,096 included: the decode never reads d_model), B = 1 and 16 (one sequence's cache repeated) × L =
/// 4K and 32K, both rebuild precisions, over a sweep of split counts (the best printed). The
/// latents are random (the time does not depend on their values), so long caches build quickly.
/// The rate is the K rebuild's useful work, 2·R·D FLOP a token and KV head, over the whole step.
fn xquant_decode_time() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.default_stream();
    let timer = GpuTimer::new(&jit).expect("timer");
    let (kv, d, gqa, dm) = (8usize, 128usize, 4usize, 1024usize);
    let layer = generate(&SynthConfig {
        tokens: 64,
        kv_heads: kv,
        gqa,
        head_dim: d,
        d_model: dm,
        seed: 11,
        ..Default::default()
    });
    let proj = Projections::from_weights(&layer.layer.w_k, &layer.layer.w_v, dm, kv, d).unwrap();
    let r = proj.k.rank;
    // Uniform in [-2, 2): the time does not depend on the values.
    let mut rng = SynthRng::new(0x2545_f491);
    let mut latents =
        |n: usize| -> Vec<f32> { (0..n * r).map(|_| 2.0 * rng.symmetric()).collect() };
    let x32k = (latents(32768), latents(32768));
    let base32k = (latents(32768), latents(32768));
    for text in ["xquant2", "xquant4", "xquant-cl2"] {
        let spec: SchemeSpec = match text {
            "xquant2" => "k = int(2, channel), v = int(2, token), source = x(latent)",
            "xquant4" => "k = int(4, channel), v = int(4, token), source = x(latent)",
            _ => "k = int(2, channel), v = int(2, token), source = x(cross_layer)",
        }
        .parse()
        .unwrap();
        for len in [4096usize, 32768] {
            let (lk, lv) = (&x32k.0[..len * r], &x32k.1[..len * r]);
            let one = if text == "xquant-cl2" {
                let base = (&base32k.0[..len * r], &base32k.1[..len * r]);
                XQuantCache::from_cross_layer_latents(&spec, (lk, lv), base, &proj, layer.rope)
            } else {
                XQuantCache::from_latents(&spec, lk, lv, &proj, layer.rope)
            }
            .unwrap();
            for batch in [1usize, 16] {
                let caches = vec![one.clone(); batch];
                let gpu = XQuantDeviceCache::upload(&stream, &caches).unwrap();
                let per = kv * gqa * d;
                let (q_bits, _) = random_queries(batch * per, Dtype::F16, 3).unwrap();
                let q_dev = stream.clone_htod(&q_bits).unwrap();
                let mut out = stream.alloc_zeros::<u16>(batch * per).unwrap();
                let mut scratch = XQuantScratch::new(&stream).unwrap();
                for precision in [RebuildPrecision::F32, RebuildPrecision::F16] {
                    // KVQ_TIME_ONLY="xquant2 F16 B=16 L=4096" (a part of the label) times one
                    // configuration, e.g. under a profiler.
                    let label = format!("{text} {precision:?} B={batch} L={len}");
                    if std::env::var("KVQ_TIME_ONLY").is_ok_and(|f| !label.contains(&f)) {
                        continue;
                    }
                    let shape = KernelShape::new(d as u32, gqa as u32, Dtype::F16);
                    let kernel =
                        XQuantKernel::load(&jit, &spec, &shape, kv, dm, precision).unwrap();
                    if len == 4096 && batch == 1 {
                        let (regs, local, ctas) = kernel.footprint().unwrap();
                        println!(
                            "{text} {precision:?}: {regs} registers, {local} spilled bytes a \
                             thread, {ctas} CTAs an SM"
                        );
                    }
                    let mut time = |splits: usize| {
                        timer
                            .time(&stream, 2, 10, |s| {
                                kernel.attend(s, &gpu, &q_dev, &mut out, splits, &mut scratch)
                            })
                            .unwrap()
                            .median_us()
                    };
                    let default_splits = kernel.default_splits(batch, len);
                    let default_us = time(default_splits);
                    let mut best = (default_us, default_splits);
                    for splits in [1usize, 2, 4, 8, 16, 32, 64] {
                        if splits * 128 <= len && splits != default_splits {
                            let us = time(splits);
                            if us < best.0 {
                                best = (us, splits);
                            }
                        }
                    }
                    let flops = 2.0 * (batch * len * kv * r * d) as f64;
                    println!(
                        "{label}: {default_us:.1} us at the default {default_splits} splits (K \
                         rebuild {:.0} TFLOP/s of useful work); best {:.1} us at {} splits",
                        flops / default_us / 1e6,
                        best.0,
                        best.1
                    );
                }
            }
        }
    }
}
