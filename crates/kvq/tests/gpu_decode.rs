//! Fused GPU decode against the CPU reference on the same quantized cache, for every integer and
//! FP16 built-in scheme (CalibQuant's also with the keys scored twice, KIVI-4's also on the
//! short staging path and with its few-pairs block, FP16's also with its few-pairs block),
//! calibrated schemes of other key widths and layouts (`other_calibrated_schemes`) and
//! uncalibrated ones of FP16 keys with 2-bit values and of 1-bit K and V
//! (`other_uncalibrated_schemes`), × head_dim {64, 128, 256} × {f16, bf16} × GQA {1, 4, 8, 11,
//! 16} (11 and 16 in head groups, 11's second starting early), in one batch of odd, unequal lengths. Inputs are fresh random data each run (seed printed;
//! `KVQ_SEED` repeats one), outputs are poisoned with NaN before every launch, and NaN never passes. Where a step's
//! kernels overlap each other (compute capability 9.0 on), each step is repeated with plain
//! launches and must give the same bits.
//!
//! Skips with a printed reason without a GPU; fails when `KVQ_REQUIRE_GPU=1`. With GQA 12 (now 11)
//! and 16 the whole run took 484 s on an H100, split in two by `KVQ_TEST_SCHEMES` (272 s with a cold
//! kernel cache, 91 s of it NVRTC, and 212 s); each reference output is computed once for all the
//! split and piece cases of its queries. `KVQ_TEST_SCHEMES=kivi2,kitty` checks only the schemes it
//! names (printed), so a change to some kernels can be checked first on a short device lease, and
//! the whole test fits device calls of 10 minutes in two halves.

mod common;
use common::{integer_schemes, other_calibrated_schemes, other_uncalibrated_schemes, seed};
use kvq::codegen::{Dtype, KernelShape, TuneParams};
use kvq::reference::attention::{self, Queries};
use kvq::reference::int::IntCache;
use kvq::reference::{Dequantized, KvTensor};
use kvq::runtime::decode::{few_pairs_blocks, one_tile_blocks, whole_pairs_blocks};
use kvq::runtime::testing::require_gpu;
use kvq::runtime::tune::synth::{round_to_word, word_to_f32};
use kvq::runtime::{DecodeKernel, DecodeScratch, GpuCache, Jit, Pieces};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StudentT};
use std::time::Instant;

const LENGTHS: &[usize] = &[1, 127, 128, 129, 4097, 33000];
const KV_HEADS: usize = 2;
const HEAD_DIMS: &[u32] = &[64, 128, 256];
/// 11 and 16 take the tensor-core kernel in two head groups: of 6 query heads, the second
/// starting a head early (sharing one with the first), and of 8. FP16's kernels at head_dim ≤ 128
/// take them in one row of two head tiles instead, and are also checked at 29 heads: at head_dim
/// 128 two rows of 15 in two tiles, the second starting a head early; at 64 one row in four.
const GQAS: &[u32] = &[1, 4, 8, 11, 16];
const FP16_GQAS: &[u32] = &[1, 4, 8, 11, 16, 29];

/// The query heads a KV head each scheme (or variant) is checked at.
fn gqas_for(name: &str) -> &'static [u32] {
    if name.starts_with("fp16") {
        FP16_GQAS
    } else {
        GQAS
    }
}
const DTYPES: &[Dtype] = &[Dtype::F16, Dtype::Bf16];

/// KIVI-4's kernels on the short staging path (`TuneParams::short_staging`), which untuned launches
/// take where warps' shares are long: checked as a scheme of their own.
const KIVI4_SHORT_STAGING: &str = "kivi4-short-staging";

/// CalibQuant's kernels with the keys scored twice (`TuneParams::store_scores` false: the range
/// pass keeps only the ranges and the decode kernel reads K), which untuned launches take at
/// short contexts: checked as schemes of their own.
const CALIBQUANT1_KEYS_TWICE: &str = "calibquant1-keys-twice";
const CALIBQUANT2_KEYS_TWICE: &str = "calibquant2-keys-twice";

/// FP16's and KIVI-4's blocks for launches with few (sequence, KV head) pairs
/// (`kvq_runtime::decode::few_pairs_blocks`, at head_dim 128: FP16 four-warp CTAs of 32-token
/// tiles, KIVI-4 32-token tiles on the short staging path), which untuned launches take at small
/// batches: checked as schemes of their own.
const FP16_FEW_PAIRS: &str = "fp16-few-pairs";
const KIVI4_FEW_PAIRS: &str = "kivi4-few-pairs";

/// The one-tile blocks (`kvq_runtime::decode::one_tile_blocks`, at head_dim 128: four-warp CTAs
/// of 16-token tiles for FP16, Kitty and Kitty-Pro; FP16's second, of 32-token tiles, is its
/// few-pairs block), which untuned launches take at small batches over short contexts:
/// `-one-tile-N` checks block N.
const ONE_TILE: &[(&str, &str)] = &[
    ("fp16-one-tile-0", "fp16"),
    ("kitty-one-tile-0", "kitty"),
    ("kitty-pro-one-tile-0", "kitty-pro"),
];

/// The uncalibrated 1- and 2-bit kernels' few-pairs block (32-token tiles, Kitty's boosted plane
/// unpacked), which untuned launches take at middle batches over short contexts.
const FEW_PAIRS: &[(&str, &str)] = &[("kivi2-few-pairs", "kivi2"), ("kitty-few-pairs", "kitty")];

/// The whole-pairs blocks (`kvq_runtime::decode::whole_pairs_blocks`, at head_dim 128: one split
/// a (sequence, KV head), in eight-, four- or two-warp CTAs by the waves the pairs take), which
/// untuned launches take where the pairs fill whole waves of SMs over short contexts: `-whole-N`
/// checks the scheme's block N as launched (CalibQuant's with or without stored scores, as each
/// says): each block shape of the 1- and 2-bit family (on kivi2, Kitty or Kitty-Pro), CalibQuant's,
/// INT8's and FP16's that is not also the codegen default or a few-pairs block.
const WHOLE_PAIRS: &[(&str, &str)] = &[
    ("kivi2-whole-0", "kivi2"),
    ("kivi2-whole-3", "kivi2"),
    ("kitty-whole-1", "kitty"),
    ("kitty-pro-whole-0", "kitty-pro"),
    ("kitty-pro-whole-3", "kitty-pro"),
    ("int8-whole-0", "int8"),
    ("calibquant1-whole-0", "calibquant1"),
    ("calibquant1-whole-1", "calibquant1"),
    ("calibquant2-whole-1", "calibquant2"),
    ("calibquant1-whole-2", "calibquant1"),
    ("calibquant2-whole-3", "calibquant2"),
    ("calibquant1-whole-4", "calibquant1"),
    ("fp16-whole-0", "fp16"),
    ("fp16-whole-1", "fp16"),
    ("kivi4-whole-0", "kivi4"),
];

/// The block parameters a variant is checked with: the default, for [`KIVI4_SHORT_STAGING`] the
/// short staging path, for the `-few-pairs` variants the few-pairs block and for the `-whole-N` and
/// `-one-tile-N` variants the N-th whole-pairs or one-tile block where the shape has them, and for
/// the `-keys-twice` variants no stored scores.
fn params_for(name: &str, spec: &kvq::SchemeSpec, shape: &KernelShape) -> TuneParams {
    let default = TuneParams::default_for(spec, shape);
    if name.ends_with("-few-pairs") {
        return few_pairs_blocks(spec, shape)
            .first()
            .map_or(default, |b| b.params);
    }
    if let Some((_, n)) = name.rsplit_once("-one-tile-") {
        let n: usize = n.parse().expect("a one-tile block's index");
        return one_tile_blocks(spec, shape)
            .get(n)
            .map_or(default, |b| b.params);
    }
    if let Some((_, n)) = name.rsplit_once("-whole-") {
        let n: usize = n.parse().expect("a whole-pairs block's index");
        return whole_pairs_blocks(spec, shape)
            .get(n)
            .map_or(default, |b| b.params);
    }
    TuneParams {
        short_staging: name == KIVI4_SHORT_STAGING,
        store_scores: default.store_scores
            && ![CALIBQUANT1_KEYS_TWICE, CALIBQUANT2_KEYS_TWICE].contains(&name),
        ..default
    }
}

/// The schemes a comma list names, in the list's order; an unknown name fails the test (a typo must
/// not pass by checking nothing).
fn selected_schemes(
    all: Vec<(&'static str, kvq::SchemeSpec)>,
    names: &str,
) -> Vec<(&'static str, kvq::SchemeSpec)> {
    let picked: Vec<_> = names
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| {
            all.iter()
                .find(|(name, _)| *name == n)
                .copied()
                .unwrap_or_else(|| {
                    let known: Vec<_> = all.iter().map(|(name, _)| *name).collect();
                    panic!("KVQ_TEST_SCHEMES names `{n}`; known: {known:?}")
                })
        })
        .collect();
    assert!(!picked.is_empty(), "KVQ_TEST_SCHEMES names no scheme");
    picked
}

/// Heavy-tailed K/V with a few outlier channels per head (the structure that makes quantization
/// hard), never zeros.
fn random_kv(rng: &mut ChaCha8Rng, tokens: usize, head_dim: usize) -> (KvTensor, KvTensor) {
    let t = StudentT::new(4.0).unwrap();
    let mut gen = |outliers: bool| {
        let gains: Vec<f32> = (0..KV_HEADS * head_dim)
            .map(|_| {
                if outliers && rng.random_bool(0.05) {
                    rng.random_range(4.0..10.0)
                } else {
                    1.0
                }
            })
            .collect();
        let mut x = KvTensor::zeros(KV_HEADS, tokens, head_dim);
        for h in 0..KV_HEADS {
            for tok in 0..tokens {
                for (c, v) in x.row_mut(h, tok).iter_mut().enumerate() {
                    *v = (t.sample(rng) as f32 * 0.7 + 0.3).clamp(-40.0, 40.0)
                        * gains[h * head_dim + c];
                }
            }
        }
        x
    };
    let k = gen(true);
    let v = gen(false);
    (k, v)
}

/// Queries rounded to the kernel's dtype: returns the device words and the f32 values the
/// reference sees.
fn random_queries(rng: &mut ChaCha8Rng, n: usize, dtype: Dtype) -> (Vec<u16>, Vec<f32>) {
    let t = StudentT::new(5.0).unwrap();
    (0..n)
        .map(|_| round_to_word(t.sample(rng) as f32 * 0.8, dtype))
        .unzip()
}

#[test]
fn gpu_decode_matches_the_reference_for_every_integer_scheme() {
    let Some(device) = require_gpu("gpu_decode_matches_the_reference_for_every_integer_scheme")
    else {
        return;
    };
    let seed = seed();
    println!(
        "device {} ({}), seed {seed} (KVQ_SEED={seed} repeats this run)",
        device.props().name,
        device.arch()
    );
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.default_stream();
    let mut schemes = integer_schemes();
    assert!(
        schemes.len() >= 8,
        "expected the 8 integer/FP16 built-ins, got {schemes:?}"
    );
    schemes.extend(other_calibrated_schemes());
    schemes.extend(other_uncalibrated_schemes());
    let kivi4 = schemes
        .iter()
        .find(|(n, _)| *n == "kivi4")
        .expect("kivi4")
        .1;
    schemes.push((KIVI4_SHORT_STAGING, kivi4));
    schemes.push((KIVI4_FEW_PAIRS, kivi4));
    for &(variant, of) in [
        (FP16_FEW_PAIRS, "fp16"),
        (CALIBQUANT1_KEYS_TWICE, "calibquant1"),
        (CALIBQUANT2_KEYS_TWICE, "calibquant2"),
    ]
    .iter()
    .chain(FEW_PAIRS)
    .chain(ONE_TILE)
    .chain(WHOLE_PAIRS)
    {
        let spec = schemes.iter().find(|(n, _)| *n == of).expect(of).1;
        schemes.push((variant, spec));
    }
    if let Ok(only) = std::env::var("KVQ_TEST_SCHEMES") {
        schemes = selected_schemes(schemes, &only);
        println!(
            "KVQ_TEST_SCHEMES: checking only {:?}",
            schemes.iter().map(|(n, _)| *n).collect::<Vec<_>>()
        );
    }

    // Compile every variant up front, in parallel (NVRTC is the slow part; the JIT is thread-safe).
    let started = Instant::now();
    let mut variants = Vec::new();
    for (name, spec) in &schemes {
        for &d in HEAD_DIMS {
            for &dtype in DTYPES {
                for &gqa in gqas_for(name) {
                    variants.push((*name, *spec, KernelShape::new(d, gqa, dtype)));
                }
            }
        }
    }
    let threads = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .min(16);
    let chunk = variants.len().div_ceil(threads);
    let mut kernels: Vec<DecodeKernel> = std::thread::scope(|s| {
        let handles: Vec<_> = variants
            .chunks(chunk)
            .map(|part| {
                let jit = &jit;
                s.spawn(move || {
                    part.iter()
                        .map(|(name, spec, shape)| {
                            DecodeKernel::load_with(
                                jit,
                                spec,
                                shape,
                                &params_for(name, spec, shape),
                                kvq::runtime::LoadOptions::ALLOW_SLOW_PATH,
                            )
                            .unwrap_or_else(|e| panic!("{name} {shape:?}: {e}"))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("compile thread"))
            .collect()
    });
    println!(
        "loaded {} kernel variants in {:.1} s: {:?}",
        kernels.len(),
        started.elapsed().as_secs_f64(),
        jit.stats()
    );

    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut failures = Vec::new();
    let mut checked = 0usize;
    let mut overlapped = 0usize; // steps also repeated with plain launches
    let mut worst = Vec::new();
    let mut kernel_iter = kernels.iter_mut();
    for (name, spec) in &schemes {
        for &d in HEAD_DIMS {
            let caches: Vec<IntCache> = LENGTHS
                .iter()
                .map(|&len| {
                    let (k, v) = random_kv(&mut rng, len, d as usize);
                    IntCache::build(spec, &k, &v).expect("reference cache")
                })
                .collect();
            let dequantized: Vec<Dequantized> = caches.iter().map(IntCache::dequantize).collect();
            let refs: Vec<&IntCache> = caches.iter().collect();
            let gpu = GpuCache::upload(&stream, &refs).expect("upload");
            for &dtype in DTYPES {
                let tol = match dtype {
                    Dtype::F16 => 2e-3,
                    Dtype::Bf16 => 1e-2,
                };
                for &gqa in gqas_for(name) {
                    let kernel = kernel_iter.next().expect("one kernel per variant");
                    assert_eq!(kernel.generated().shape, KernelShape::new(d, gqa, dtype));
                    let q_heads = KV_HEADS * gqa as usize;
                    let n = LENGTHS.len() * q_heads * d as usize;
                    let (q_bits, q_vals) = random_queries(&mut rng, n, dtype);
                    let q = stream.clone_htod(&q_bits).expect("upload q");
                    // The reference outputs of these queries, once for every split and piece
                    // case below, one thread a sequence (the longest sets the pace).
                    let per = q_heads * d as usize;
                    let wants: Vec<Vec<f32>> = std::thread::scope(|s| {
                        let handles: Vec<_> = dequantized
                            .iter()
                            .enumerate()
                            .map(|(b, deq)| {
                                let queries = Queries {
                                    data: q_vals[b * per..(b + 1) * per].to_vec(),
                                    q_heads,
                                    head_dim: d as usize,
                                };
                                let calibrate = spec.calibrate.as_ref();
                                s.spawn(move || {
                                    attention::decode(&queries, deq, calibrate).expect("reference")
                                })
                            })
                            .collect();
                        handles
                            .into_iter()
                            .map(|h| h.join().expect("reference thread"))
                            .collect()
                    });
                    let sm = device.props().sm_count as usize;
                    // The heuristic split count, and a single split: results must agree with both.
                    let heuristic = kernel
                        .default_splits(LENGTHS.len(), KV_HEADS, gpu.max_len(), sm)
                        .expect("occupancy");
                    // Pieces after the splits (kernels that do not run them must still take the
                    // launch): a quarter of the work in two pieces per split, most of it in five
                    // pieces after three splits, all but a thousandth in one piece after one split.
                    let cases = [
                        (heuristic, kernel.default_pieces(gpu.max_len(), heuristic)),
                        (1, Pieces::NONE),
                        (7, Pieces::NONE),
                        (67, Pieces::NONE),
                        (
                            heuristic,
                            Pieces {
                                count: 2 * heuristic,
                                permille: 250,
                            },
                        ),
                        (
                            3,
                            Pieces {
                                count: 5,
                                permille: 600,
                            },
                        ),
                        (
                            1,
                            Pieces {
                                count: 1,
                                permille: 999,
                            },
                        ),
                    ];
                    for (splits, pieces) in cases {
                        let mut out = stream
                            .clone_htod(&vec![0xFFFFu16; n])
                            .expect("poisoned output");
                        let mut scratch = DecodeScratch::with_pieces(
                            &stream,
                            LENGTHS.len(),
                            q_heads,
                            d as usize,
                            splits,
                            pieces,
                        )
                        .expect("scratch");
                        kernel
                            .attend(&stream, gpu.view(), &q, &mut out, &mut scratch)
                            .expect("launch");
                        let got: Vec<u16> = stream.clone_dtoh(&out).expect("download");
                        if kernel.overlaps_launches() {
                            // Plain launches (what an engine embedding the kernels makes) must
                            // give the same bits as the overlapped ones.
                            overlapped += 1;
                            kernel.set_overlap_launches(false);
                            let mut plain_out = stream
                                .clone_htod(&vec![0xFFFFu16; n])
                                .expect("poisoned output");
                            kernel
                                .attend(&stream, gpu.view(), &q, &mut plain_out, &mut scratch)
                                .expect("plain launch");
                            kernel.set_overlap_launches(true);
                            let plain: Vec<u16> = stream.clone_dtoh(&plain_out).expect("download");
                            if plain != got {
                                failures.push(format!(
                                    "{name} d{d} {dtype} gqa{gqa} splits {splits} {pieces}: overlapped and plain launches differ"
                                ));
                            }
                        }
                        for (b, want) in wants.iter().enumerate() {
                            let have: Vec<f32> = got[b * per..(b + 1) * per]
                                .iter()
                                .map(|&x| word_to_f32(x, dtype))
                                .collect();
                            let err = attention::relative_error(&have, want);
                            checked += 1;
                            let nan = have.iter().any(|x| !x.is_finite());
                            worst.push((
                                err,
                                format!(
                                    "{name} d{d} {dtype} gqa{gqa} len{} splits{splits} {pieces}",
                                    LENGTHS[b]
                                ),
                            ));
                            if nan || err.is_nan() || err > tol {
                                failures.push(format!(
                                    "{name} d{d} {dtype} gqa{gqa} len {} splits {splits} {pieces}: rel err {err:.3e} (tol {tol:.0e}){}",
                                    LENGTHS[b],
                                    if nan { ", non-finite output" } else { "" }
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    worst.sort_by(|a, b| b.0.total_cmp(&a.0));
    println!(
        "{overlapped} steps with overlapped launches (programmatic dependent launch) gave the bits of plain ones"
    );
    println!("checked {checked} (scheme, shape, sequence, split) outputs; largest errors:");
    for (e, what) in worst.iter().take(8) {
        println!("  {e:.3e}  {what}");
    }
    // Per dtype: bf16's tolerance is five times f16's, so one maximum over both hides f16's margin.
    println!("largest relative error per scheme and dtype:");
    for (name, _) in &schemes {
        let per_dtype: Vec<String> = DTYPES
            .iter()
            .map(|dtype| {
                let m = worst
                    .iter()
                    .filter(|(_, w)| w.starts_with(&format!("{name} ")))
                    .filter(|(_, w)| w.contains(&format!(" {dtype} ")))
                    .map(|(e, _)| *e)
                    .fold(0.0, f64::max);
                format!("{dtype} {m:.3e}")
            })
            .collect();
        println!("  {name}: {}", per_dtype.join(", "));
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} outputs out of tolerance:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Loads every variant through a fresh JIT on the same disk cache: run after the test above in a
/// second process, it must compile nothing.
#[test]
fn gpu_jit_warm_start_report() {
    let Some(device) = require_gpu("gpu_jit_warm_start_report") else {
        return;
    };
    let jit = Jit::new(&device).expect("JIT");
    let started = Instant::now();
    let mut n = 0;
    for (name, spec) in integer_schemes() {
        for &d in HEAD_DIMS {
            for &dtype in DTYPES {
                for &gqa in gqas_for(name) {
                    let shape = KernelShape::new(d, gqa, dtype);
                    DecodeKernel::load_with(
                        &jit,
                        &spec,
                        &shape,
                        &TuneParams::default_for(&spec, &shape),
                        kvq::runtime::LoadOptions::ALLOW_SLOW_PATH,
                    )
                    .unwrap_or_else(|e| panic!("{name} {shape:?}: {e}"));
                    n += 1;
                }
            }
        }
    }
    let stats = jit.stats();
    println!(
        "warm start: {n} kernel modules in {:.1} ms: {stats:?}; disk cache {}",
        started.elapsed().as_secs_f64() * 1e3,
        jit.disk_cache()
            .map_or("off".to_string(), |c| format!("{}", c.stats()))
    );
}

#[test]
fn test_schemes_filter_keeps_the_named_schemes_in_order() {
    let picked = selected_schemes(integer_schemes(), " kitty, kivi2 ,");
    let names: Vec<_> = picked.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["kitty", "kivi2"]);
}

#[test]
#[should_panic(expected = "KVQ_TEST_SCHEMES names `kivi3`")]
fn test_schemes_filter_refuses_an_unknown_name() {
    selected_schemes(integer_schemes(), "kivi2,kivi3");
}
