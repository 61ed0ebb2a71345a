//! Fused GPU decode against the CPU reference on the same quantized cache, for every integer and
//! FP16 built-in scheme (CalibQuant's also with the keys scored twice, KIVI-4's also on the
//! short staging path and with its few-pairs block, FP16's also with its few-pairs block),
//! calibrated schemes of other key widths and layouts (`other_calibrated_schemes`) and
//! uncalibrated ones of FP16 keys with 2-bit values and of 1-bit K and V
//! (`other_uncalibrated_schemes`), × head_dim {64, 80, 96, 112, 128, 160, 192, 256} × {f16,
//! bf16} × GQA {1, 4, 7, 8, 11, 16} (11 and 16 in head groups, 11's second starting early), in one
//! batch of odd, unequal lengths. Inputs are fresh random data each run (seed printed; `KVQ_SEED` repeats one); each
//! case draws its own from (seed, case name), so a filter does not change what a case sees.
//! Outputs are poisoned with NaN before every launch, and NaN never passes. Every output element
//! is held to its own error bound, derived from the computation (`common::expected`). Where a
//! step's kernels overlap each other (compute capability 9.0 on), each step is repeated with
//! plain launches and must give the same bits.
//!
//! Runs under its own harness (`harness = false`): without a GPU the GPU tests show as ignored,
//! with the reason; `KVQ_REQUIRE_GPU=1` makes that a failure. Each reference output is computed
//! once for all the split and piece cases of its queries. At head_dim 64/128/256 alone (before GQA 7)
//! the whole run took 484 s on an H100; the 8 GPU built-ins at 160 and 192 alone took 221 s on an H200
//! (54 s of it NVRTC), so the whole test does not fit one device call of 10 minutes: split it by
//! `KVQ_TEST_SCHEMES=kivi2,kitty` and `KVQ_TEST_HEAD_DIMS=80,96` (each checks only what it names,
//! printed), which also lets a change to some kernels be checked first on a short device lease.
//! A second test runs steps of several query tokens a sequence (q_len 1, 2, 4, 8) against the
//! reference's causal step at head_dim 64, 128 and 256.

mod common;
use common::{
    case_seed, expected, integer_schemes, judge, needs, other_calibrated_schemes,
    other_uncalibrated_schemes, plain, run_trials, seed, selected_head_dims, Expected,
};
use kvq::codegen::{Dtype, KernelShape, TuneParams};
use kvq::reference::attention::{self, Queries};
use kvq::reference::int::IntCache;
use kvq::reference::synth::{self, Tails};
use kvq::reference::{Dequantized, KvTensor};
use kvq::runtime::decode::{few_pairs_blocks, one_tile_blocks, whole_pairs_blocks};
use kvq::runtime::testing::Need;
use kvq::runtime::tune::synth::{random_queries, round_to_word, word_to_f32};
use kvq::runtime::{DecodeKernel, DecodeScratch, Device, GpuCache, Jit, MergeKernel, Pieces};
use std::time::Instant;

fn main() {
    run_trials(vec![
        needs(
            Need::Gpu,
            "gpu_decode_matches_the_reference_for_every_integer_scheme",
            gpu_decode_matches_the_reference_for_every_integer_scheme,
        ),
        needs(
            Need::Gpu,
            "gpu_steps_of_several_query_tokens_match_the_reference",
            gpu_steps_of_several_query_tokens_match_the_reference,
        ),
        needs(
            Need::Gpu,
            "gpu_jit_warm_start_report",
            gpu_jit_warm_start_report,
        ),
        needs(
            Need::Gpu,
            "gpu_merge_matches_the_reference_merge",
            gpu_merge_matches_the_reference_merge,
        ),
        plain(
            "test_schemes_filter_keeps_the_named_schemes_in_order",
            test_schemes_filter_keeps_the_named_schemes_in_order,
        ),
        plain(
            "test_schemes_filter_refuses_an_unknown_name",
            test_schemes_filter_refuses_an_unknown_name,
        ),
        plain(
            "case_inputs_depend_on_the_seed_and_the_case_only",
            case_inputs_depend_on_the_seed_and_the_case_only,
        ),
        plain(
            "error_bound_admits_kernel_rounding_and_catches_bugs",
            error_bound_admits_kernel_rounding_and_catches_bugs,
        ),
    ]);
}

const LENGTHS: &[usize] = &[1, 127, 128, 129, 4097, 33000];
const KV_HEADS: usize = 2;
/// Every head_dim the tensor-core kernel serves as one slab (64, 128, 256) and as several (the
/// others: docs/LAYOUT.md §9). `KVQ_TEST_HEAD_DIMS=80,96` checks only those (printed).
const HEAD_DIMS: &[u32] = &[64, 80, 96, 112, 128, 160, 192, 256];
/// 11 and 16 take the tensor-core kernel in two head groups: of 6 query heads, the second
/// starting a head early (sharing one with the first), and of 8. FP16's kernels at head_dim ≤ 128
/// take them in one row of two head tiles instead, and are also checked at 29 heads: at head_dim
/// 128 two rows of 15 in two tiles, the second starting a head early; at 64 one row in four.
/// 7 fills no tile.
const GQAS: &[u32] = &[1, 4, 7, 8, 11, 16];
const FP16_GQAS: &[u32] = &[1, 4, 7, 8, 11, 16, 29];

/// [`HEAD_DIMS`], or those `KVQ_TEST_HEAD_DIMS` names.
fn head_dims() -> Vec<u32> {
    selected_head_dims(HEAD_DIMS).unwrap_or_else(|| HEAD_DIMS.to_vec())
}

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

/// The schemes a comma list names, in the list's order; an unknown name is an error (a typo must
/// not pass by checking nothing).
fn selected_schemes(
    all: Vec<(&'static str, kvq::SchemeSpec)>,
    names: &str,
) -> Result<Vec<(&'static str, kvq::SchemeSpec)>, String> {
    let picked = names
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| {
            all.iter()
                .find(|(name, _)| *name == n)
                .copied()
                .ok_or_else(|| {
                    let known: Vec<_> = all.iter().map(|(name, _)| *name).collect();
                    format!("KVQ_TEST_SCHEMES names `{n}`; known: {known:?}")
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if picked.is_empty() {
        return Err("KVQ_TEST_SCHEMES names no scheme".to_string());
    }
    Ok(picked)
}

/// One sequence's K/V: the reference's fast generator with heavy tails and outlier key channels
/// (the structure that makes quantization hard), never zeros, seeded by the case.
fn case_kv(seed: u64, case: &str, tokens: usize, head_dim: usize) -> (KvTensor, KvTensor) {
    synth::random_kv(
        KV_HEADS,
        tokens,
        head_dim,
        case_seed(seed, case),
        Tails::Laplace,
    )
    .expect("synthetic K/V")
}

/// Queries rounded to the kernel's dtype, seeded by the case: the device words and the f32
/// values the reference sees.
fn case_queries(seed: u64, case: &str, n: usize, dtype: Dtype) -> (Vec<u16>, Vec<f32>) {
    random_queries(n, dtype, case_seed(seed, case)).expect("synthetic queries")
}

fn gpu_decode_matches_the_reference_for_every_integer_scheme() {
    let device = Device::open(0).expect("GPU");
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
        schemes = selected_schemes(schemes, &only).unwrap_or_else(|e| panic!("{e}"));
        println!(
            "KVQ_TEST_SCHEMES: checking only {:?}",
            schemes.iter().map(|(n, _)| *n).collect::<Vec<_>>()
        );
    }

    // Compile every variant up front, in parallel (NVRTC is the slow part; the JIT is thread-safe).
    let dims = head_dims();
    let started = Instant::now();
    let mut variants = Vec::new();
    for (name, spec) in &schemes {
        for &d in &dims {
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

    let mut failures = Vec::new();
    let mut checked = 0usize;
    let mut overlapped = 0usize; // steps also repeated with plain launches
    let mut lse_checked = 0usize; // rows whose log-sum-exp was checked
    let mut worst = Vec::new();
    let mut kernel_iter = kernels.iter_mut();
    for (name, spec) in &schemes {
        for &d in &dims {
            let caches: Vec<IntCache> = LENGTHS
                .iter()
                .map(|&len| {
                    let (k, v) = case_kv(seed, &format!("{name} d{d} len{len}"), len, d as usize);
                    IntCache::build(spec, &k, &v).expect("reference cache")
                })
                .collect();
            let dequantized: Vec<Dequantized> = caches.iter().map(IntCache::dequantize).collect();
            let refs: Vec<&IntCache> = caches.iter().collect();
            let gpu = GpuCache::upload(&stream, &refs).expect("upload");
            for &dtype in DTYPES {
                for &gqa in gqas_for(name) {
                    let kernel = kernel_iter.next().expect("one kernel per variant");
                    assert_eq!(kernel.generated().shape, KernelShape::new(d, gqa, dtype));
                    let q_heads = KV_HEADS * gqa as usize;
                    let n = LENGTHS.len() * q_heads * d as usize;
                    let (q_bits, q_vals) =
                        case_queries(seed, &format!("{name} d{d} {dtype} gqa{gqa}"), n, dtype);
                    let q = stream.clone_htod(&q_bits).expect("upload q");
                    // The reference outputs of these queries, once for every split and piece
                    // case below, one thread a sequence (the longest sets the pace).
                    let per = q_heads * d as usize;
                    let wants: Vec<Expected> = std::thread::scope(|s| {
                        let handles: Vec<_> = dequantized
                            .iter()
                            .enumerate()
                            .map(|(b, deq)| {
                                let queries = Queries {
                                    data: q_vals[b * per..(b + 1) * per].to_vec(),
                                    q_heads,
                                    head_dim: d as usize,
                                };
                                s.spawn(move || {
                                    expected(&queries, deq, spec, dtype).expect("reference")
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
                        if splits == heuristic || splits == 1 {
                            // With the log-sum-exp: the same output bits (the combine merges one
                            // part exactly as the decode kernel writes it), and each row's LSE
                            // within its bound.
                            lse_checked += check_lse(
                                kernel,
                                &stream,
                                gpu.view(),
                                &q,
                                &mut scratch,
                                &got,
                                &wants,
                                q_heads,
                                &format!("{name} d{d} {dtype} gqa{gqa} splits{splits} {pieces}"),
                                &mut failures,
                            );
                        }
                        for (b, want) in wants.iter().enumerate() {
                            let have: Vec<f32> = got[b * per..(b + 1) * per]
                                .iter()
                                .map(|&x| word_to_f32(x, dtype))
                                .collect();
                            let judged = judge(&have, want);
                            let err = attention::relative_error(&have, &want.want);
                            checked += 1;
                            let what = format!(
                                "{name} d{d} {dtype} gqa{gqa} len{} splits{splits} {pieces}",
                                LENGTHS[b]
                            );
                            worst.push((judged.worst_ratio, err, what.clone()));
                            if !judged.passed() {
                                failures.push(format!("{what}: {judged}; rel err {err:.3e}"));
                            }
                        }
                    }
                }
            }
        }
    }
    worst.sort_by(|a, b| b.0.total_cmp(&a.0));
    println!("checked the log-sum-exp of {lse_checked} rows against their bounds");
    println!(
        "{overlapped} steps with overlapped launches (programmatic dependent launch) gave the bits of plain ones"
    );
    println!(
        "checked {checked} (scheme, shape, sequence, split) outputs element by element against \
         their error bounds; closest to the bound (share of bound, rel. L2 error):"
    );
    for (ratio, e, what) in worst.iter().take(8) {
        println!("  {ratio:.3}  {e:.3e}  {what}");
    }
    // Per dtype: how close each scheme comes to its bound, and its relative L2 error.
    println!("largest share of the bound (and rel. L2 error) per scheme and dtype:");
    for (name, _) in &schemes {
        let per_dtype: Vec<String> = DTYPES
            .iter()
            .map(|dtype| {
                let mine = || {
                    worst
                        .iter()
                        .filter(|(_, _, w)| w.starts_with(&format!("{name} ")))
                        .filter(|(_, _, w)| w.contains(&format!(" {dtype} ")))
                };
                let r = mine().map(|(r, _, _)| *r).fold(0.0, f64::max);
                let e = mine().map(|(_, e, _)| *e).fold(0.0, f64::max);
                format!("{dtype} {r:.3} ({e:.2e})")
            })
            .collect();
        println!("  {name}: {}", per_dtype.join(", "));
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} outputs past their error bounds:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Loads every variant through a fresh JIT on the same disk cache: run after the test above in a
/// second process, it compiles nothing. Here it checks what holds in any order: every variant
/// loads, each was compiled or found exactly once (the in-process cache serves repeats), and a
/// second JIT on the same disk cache compiles nothing.
fn gpu_jit_warm_start_report() {
    let device = Device::open(0).expect("GPU");
    let load_all = |jit: &Jit| -> usize {
        let mut n = 0;
        for (name, spec) in integer_schemes() {
            for &d in &head_dims() {
                for &dtype in DTYPES {
                    for &gqa in gqas_for(name) {
                        let shape = KernelShape::new(d, gqa, dtype);
                        DecodeKernel::load_with(
                            jit,
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
        n
    };
    let jit = Jit::new(&device).expect("JIT");
    let started = Instant::now();
    let n = load_all(&jit);
    let first = jit.stats();
    println!(
        "first start: {n} kernel variants in {:.1} ms: {first:?}; disk cache {}",
        started.elapsed().as_secs_f64() * 1e3,
        jit.disk_cache()
            .map_or("off".to_string(), |c| format!("{}", c.stats()))
    );
    assert!(n > 0, "no kernel variant loaded");
    if jit.disk_cache().is_none() {
        println!("no disk cache here (KVQ_CACHE_DIR unusable?): the warm start is not checked");
        return;
    }
    // A second JIT on the same disk cache, as a second process start: nothing compiles.
    let warm = Jit::new(&device).expect("JIT");
    let started = Instant::now();
    assert_eq!(load_all(&warm), n);
    let stats = warm.stats();
    println!(
        "warm start: {n} kernel variants in {:.1} ms: {stats:?}",
        started.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(stats.compiled, 0, "a warm start compiled: {stats:?}");
}

fn test_schemes_filter_keeps_the_named_schemes_in_order() {
    let picked = selected_schemes(integer_schemes(), " kitty, kivi2 ,").expect("known names");
    let names: Vec<_> = picked.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["kitty", "kivi2"]);
}

fn test_schemes_filter_refuses_an_unknown_name() {
    let e = selected_schemes(integer_schemes(), "kivi2,kivi3").expect_err("an unknown name");
    assert!(e.contains("KVQ_TEST_SCHEMES names `kivi3`"), "{e}");
    let e = selected_schemes(integer_schemes(), " , ").expect_err("no name");
    assert!(e.contains("names no scheme"), "{e}");
}

/// A case's inputs follow from the seed and its name alone: the same whichever cases run
/// before it, different for another name or seed.
fn case_inputs_depend_on_the_seed_and_the_case_only() {
    let a = case_kv(7, "kivi2 d64 len127", 127, 64);
    let _ = case_kv(7, "kitty d64 len127", 127, 64); // another case in between changes nothing
    assert_eq!(a, case_kv(7, "kivi2 d64 len127", 127, 64));
    assert_ne!(a.0, case_kv(7, "kitty d64 len127", 127, 64).0);
    assert_ne!(a.0, case_kv(8, "kivi2 d64 len127", 127, 64).0);
    let q = case_queries(7, "kivi2 d64 f16 gqa4", 512, Dtype::F16);
    assert_eq!(q, case_queries(7, "kivi2 d64 f16 gqa4", 512, Dtype::F16));
    assert_ne!(
        q.0,
        case_queries(7, "kivi2 d64 f16 gqa8", 512, Dtype::F16).0
    );
}

/// The error bound on the CPU: outputs computed as a kernel rounds (probabilities and values
/// rounded to the dtype, f32 sums, the output rounded) pass; with `u` the dtype's unit roundoff,
/// one output moved by `100u` of the outputs' scale (4.9% for f16, 39% for bf16), a V scale off
/// by `100u`, and a softmax scale off by `100u` fail: the bound is tens of `u`, as an f16 or bf16
/// computation's worst case is, and a real bug (a wrong group, token or scale) is far past it.
fn error_bound_admits_kernel_rounding_and_catches_bugs() {
    for (scheme, dtype, tokens) in [
        ("kivi2", Dtype::F16, 700),
        ("kitty", Dtype::F16, 4097),
        ("int8", Dtype::Bf16, 300),
        ("kivi4", Dtype::F16, 1000),
    ] {
        let spec = kvq::schemes::by_name(scheme).expect("built-in").spec;
        let (d, gqa) = (64usize, 4usize);
        let case = format!("bound {scheme} {dtype}");
        let (k, v) = case_kv(11, &case, tokens, d);
        let deq = IntCache::build(&spec, &k, &v).expect("cache").dequantize();
        let q_heads = KV_HEADS * gqa;
        let (_, data) = case_queries(11, &case, q_heads * d, dtype);
        let queries = Queries {
            data,
            q_heads,
            head_dim: d,
        };
        let e = expected(&queries, &deq, &spec, dtype).expect("reference");
        let what = format!("{scheme} {dtype} {tokens} tokens");

        // As a kernel computes it: p rounded relative to the running maximum, values rounded,
        // products summed in f32, the output rounded.
        let round = |x: f64| word_to_f32(round_to_word(x as f32, dtype).0, dtype);
        let p =
            attention::probabilities(&queries, &deq.k, &deq.k_quantized, spec.calibrate.as_ref())
                .expect("probabilities");
        let mut emulated = vec![0.0f32; q_heads * d];
        for h in 0..q_heads {
            let ph = &p[h * tokens..(h + 1) * tokens];
            let p_max = ph.iter().copied().fold(0.0, f64::max);
            for c in 0..d {
                let mut acc = 0.0f32;
                for (t, &pt) in ph.iter().enumerate() {
                    let vt = f64::from(deq.v.row(h / gqa, t)[c]);
                    acc += round(pt / p_max) * round(vt);
                }
                emulated[h * d + c] = round(f64::from(acc) * p_max);
            }
        }
        let j = judge(&emulated, &e);
        assert!(
            j.passed(),
            "{what}: kernel-like rounding failed its bound: {j}"
        );
        println!(
            "{what}: kernel-like rounding at {:.3} of its bound",
            j.worst_ratio
        );

        let bug = 100.0 * common::unit_roundoff(dtype) as f32;
        // One output moved by 100u of the largest output.
        let scale = e.want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let mut moved = e.want.clone();
        moved[3 * d + 5] += bug * scale;
        assert!(!judge(&moved, &e).passed(), "{what}: a moved output passed");

        // A V scale off by 100u (every value of V that much large).
        let mut wrong_v = deq.v.clone();
        wrong_v.data.iter_mut().for_each(|x| *x *= 1.0 + bug);
        let have = attention::weighted_values(&p, q_heads, &wrong_v);
        let j = judge(&have, &e);
        assert!(!j.passed(), "{what}: a V scale off by {bug} passed: {j}");

        // A softmax scale off by 100u (queries that much large).
        let mut wrong_q = queries.clone();
        wrong_q.data.iter_mut().for_each(|x| *x *= 1.0 + bug);
        let have = attention::decode(&wrong_q, &deq, spec.calibrate.as_ref()).expect("reference");
        let j = judge(&have, &e);
        assert!(
            !j.passed(),
            "{what}: a softmax scale off by {bug} passed: {j}"
        );

        // The log-sum-exp as a kernel computes it (f32 scores, max and sum) passes its bound; one
        // in base 2, or without the denominator's log, does not.
        let lse_passes = |lse: &dyn Fn(f32, f32) -> f32| {
            (0..q_heads).all(|h| {
                let scores: Vec<f32> = (0..tokens)
                    .map(|t| {
                        let dot: f32 = queries
                            .head(h)
                            .iter()
                            .zip(deq.k.row(h / gqa, t))
                            .map(|(a, b)| a * b)
                            .sum();
                        dot / (d as f32).sqrt()
                    })
                    .collect();
                let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let l: f32 = scores.iter().map(|s| (s - m).exp()).sum();
                let err = (f64::from(lse(m, l)) - f64::from(e.lse[h])).abs();
                err <= e.lse_bound[h]
            })
        };
        assert!(
            lse_passes(&|m, l| m + l.ln()),
            "{what}: a kernel-like LSE failed its bound"
        );
        assert!(
            !lse_passes(&|m, l| (m + l.ln()) * std::f32::consts::LOG2_E),
            "{what}: an LSE in base 2 passed"
        );
        assert!(
            !lse_passes(&|m, _| m),
            "{what}: an LSE without the denominator passed"
        );
    }
}

/// Query tokens a sequence the step test runs: 1 (the step path at decode) to 8.
const Q_LENS: &[usize] = &[1, 2, 4, 8];
/// Sequence lengths of the step test, each at least the longest step: around the sink, the local
/// window and a page (a step there sees tokens on both sides of a page's edge) and long.
const STEP_LENGTHS: &[usize] = &[8, 131, 290, 4100];

/// `deq`'s first `tokens` tokens: what a query token of a step sees (the rest of the step's tokens
/// are after it; the regions, already set by the whole length, are unchanged).
fn first_tokens(deq: &Dequantized, tokens: usize) -> Dequantized {
    Dequantized {
        k: deq.k.prefix(tokens),
        v: deq.v.prefix(tokens),
        k_quantized: deq.k_quantized[..tokens].to_vec(),
    }
}

/// Steps of several query tokens a sequence (speculative-decoding verification) against the CPU
/// reference (`kvq_reference::step`: query token `j` of a step of `q_len` sees the sequence's first
/// `len − (q_len − 1 − j)` tokens, as the whole length's cache holds them), for every integer and
/// FP16 built-in × head_dim {64, 128, 256} (or those `KVQ_TEST_HEAD_DIMS` names) × {f16, bf16} ×
/// q_len {1, 2, 4, 8} at GQA 4, the heuristic's launch for that many rows. Each row's output is
/// held to its own error bound and its LSE to its bound, on outputs poisoned with NaN.
fn gpu_steps_of_several_query_tokens_match_the_reference() {
    let device = Device::open(0).expect("GPU");
    let seed = seed();
    println!(
        "device {}, seed {seed} (KVQ_SEED={seed} repeats this run)",
        device.props().name
    );
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.default_stream();
    let mut schemes = integer_schemes();
    if let Ok(only) = std::env::var("KVQ_TEST_SCHEMES") {
        // The other test's variants are not step schemes: skipped here, checked there; a list
        // left with no scheme of this test is an error, not a run that checks nothing.
        let names: Vec<&str> = only
            .split(',')
            .map(str::trim)
            .filter(|n| schemes.iter().any(|(s, _)| s == n))
            .collect();
        schemes = selected_schemes(schemes, &names.join(",")).unwrap_or_else(|e| panic!("{e}"));
        println!(
            "KVQ_TEST_SCHEMES: checking only {:?}",
            schemes.iter().map(|(n, _)| *n).collect::<Vec<_>>()
        );
    }
    let dims: Vec<u32> = head_dims()
        .into_iter()
        .filter(|d| [64, 128, 256].contains(d))
        .collect();
    let (gqa, sm) = (4u32, device.props().sm_count as usize);
    let q_heads = KV_HEADS * gqa as usize;
    let batch = STEP_LENGTHS.len();
    let (mut failures, mut checked, mut worst) = (Vec::new(), 0usize, 0.0f64);
    for (name, spec) in &schemes {
        for &d in &dims {
            let caches: Vec<IntCache> = STEP_LENGTHS
                .iter()
                .map(|&len| {
                    let (k, v) =
                        case_kv(seed, &format!("step {name} d{d} len{len}"), len, d as usize);
                    IntCache::build(spec, &k, &v).expect("reference cache")
                })
                .collect();
            let dequantized: Vec<Dequantized> = caches.iter().map(IntCache::dequantize).collect();
            let refs: Vec<&IntCache> = caches.iter().collect();
            let gpu = GpuCache::upload(&stream, &refs).expect("upload");
            let per = q_heads * d as usize;
            for &dtype in DTYPES {
                let shape = KernelShape::new(d, gqa, dtype);
                let kernel =
                    DecodeKernel::load(&jit, spec, &shape, &TuneParams::default_for(spec, &shape))
                        .unwrap_or_else(|e| panic!("{name} {shape:?}: {e}"));
                for &q_len in Q_LENS {
                    let rows = batch * q_len;
                    let what = format!("{name} d{d} {dtype} q_len {q_len}");
                    let (q_bits, q_vals) = case_queries(seed, &what, rows * per, dtype);
                    let q = stream.clone_htod(&q_bits).expect("upload q");
                    let splits = kernel
                        .default_splits(rows, KV_HEADS, gpu.max_len(), sm)
                        .expect("occupancy");
                    let pieces = kernel.default_pieces(gpu.max_len(), splits);
                    let mut scratch = DecodeScratch::with_pieces(
                        &stream, rows, q_heads, d as usize, splits, pieces,
                    )
                    .expect("scratch");
                    let mut out = stream
                        .clone_htod(&vec![0xFFFFu16; rows * per])
                        .expect("out");
                    let mut lse = stream
                        .clone_htod(&vec![f32::NAN; rows * q_heads])
                        .expect("lse");
                    kernel
                        .attend_step(
                            &stream,
                            gpu.view(),
                            q_len,
                            &q,
                            &mut out,
                            Some(&mut lse),
                            &mut scratch,
                        )
                        .expect("launch");
                    let got: Vec<u16> = stream.clone_dtoh(&out).expect("download");
                    let got_lse: Vec<f32> = stream.clone_dtoh(&lse).expect("download lse");
                    for (b, deq) in dequantized.iter().enumerate() {
                        for j in 0..q_len {
                            let r = b * q_len + j;
                            let seen = STEP_LENGTHS[b] - (q_len - 1 - j);
                            let queries = Queries {
                                data: q_vals[r * per..(r + 1) * per].to_vec(),
                                q_heads,
                                head_dim: d as usize,
                            };
                            let want = expected(&queries, &first_tokens(deq, seen), spec, dtype)
                                .expect("reference");
                            let have: Vec<f32> = got[r * per..(r + 1) * per]
                                .iter()
                                .map(|&x| word_to_f32(x, dtype))
                                .collect();
                            let judged = judge(&have, &want);
                            checked += 1;
                            worst = worst.max(judged.worst_ratio);
                            let at = format!("{what} len{} token {j}", STEP_LENGTHS[b]);
                            if !judged.passed() {
                                failures.push(format!("{at}: {judged}"));
                            }
                            for h in 0..q_heads {
                                let have = got_lse[r * q_heads + h];
                                let err = (f64::from(have) - f64::from(want.lse[h])).abs();
                                if err.is_nan() || err > want.lse_bound[h] {
                                    failures.push(format!(
                                        "{at} head {h}: LSE {have} for {} (bound {:.2e})",
                                        want.lse[h], want.lse_bound[h]
                                    ));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    println!(
        "checked {checked} step rows (scheme, head_dim, dtype, q_len, sequence, token) and their \
         LSEs; largest share of a bound {worst:.3}"
    );
    assert!(checked > 0, "no scheme or head_dim selected");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Runs `kernel` again with the log-sum-exp (on the same scratch, outputs poisoned): its output
/// must be `got` bit for bit, and each row's LSE within its bound of the reference's. Pushes what
/// fails to `failures`; returns the rows checked.
#[allow(clippy::too_many_arguments)]
fn check_lse(
    kernel: &DecodeKernel,
    stream: &std::sync::Arc<kvq::runtime::cudarc::driver::CudaStream>,
    view: kvq::runtime::CacheView<'_>,
    q: &kvq::runtime::cudarc::driver::CudaSlice<u16>,
    scratch: &mut DecodeScratch,
    got: &[u16],
    wants: &[Expected],
    q_heads: usize,
    what: &str,
    failures: &mut Vec<String>,
) -> usize {
    let mut out = stream
        .clone_htod(&vec![0xFFFFu16; got.len()])
        .expect("poisoned output");
    let mut lse = stream
        .clone_htod(&vec![f32::NAN; wants.len() * q_heads])
        .expect("poisoned lse");
    kernel
        .attend_with_lse(stream, view, q, &mut out, &mut lse, scratch)
        .expect("launch with lse");
    let out: Vec<u16> = stream.clone_dtoh(&out).expect("download");
    let lse: Vec<f32> = stream.clone_dtoh(&lse).expect("download lse");
    if out != got {
        failures.push(format!(
            "{what}: the output with the LSE differs from the one without"
        ));
    }
    for (b, want) in wants.iter().enumerate() {
        for h in 0..q_heads {
            let (have, expect, bound) = (lse[b * q_heads + h], want.lse[h], want.lse_bound[h]);
            let err = (f64::from(have) - f64::from(expect)).abs();
            if err.is_nan() || err > bound {
                failures.push(format!(
                    "{what}: sequence {b} head {h}: LSE {have} for {expect} (bound {bound:.2e})"
                ));
            }
        }
    }
    wants.len() * q_heads
}

/// The merge kernel combines attention states of disjoint token parts as the reference's
/// `step::merge` does, from states with random outputs and LSEs: parts that saw none of a row's
/// tokens (LSE −inf) drop out, and a row no part saw comes out as zeros and −inf. Outputs within
/// their dtype's rounding plus the f32 sums, LSEs within 2^-20 of their magnitude.
fn gpu_merge_matches_the_reference_merge() {
    use kvq::reference::step::{merge, AttentionState};
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.default_stream();
    let seed = seed();
    let (q_len, q_heads, parts) = (3usize, 8usize, 4usize);
    let rows = q_len * q_heads;
    let mut failures = Vec::new();
    for &dtype in DTYPES {
        for d in [64u32, 80, 128, 256] {
            let kernel = MergeKernel::load(&jit, d, dtype).expect("merge kernel");
            let d = d as usize;
            let case = format!("merge d{d} {dtype}");
            let (out_bits, out_vals) = case_queries(seed, &case, parts * rows * d, dtype);
            let (_, lse_raw) = case_queries(seed, &format!("{case} lse"), parts * rows, dtype);
            let mut lse_vals: Vec<f32> = lse_raw.iter().map(|x| 8.0 * x + 4.0).collect();
            for p in 0..parts {
                // Row 5 seen by no part; rows 0..3 not by part 1.
                lse_vals[p * rows + 5] = f32::NEG_INFINITY;
            }
            for r in 0..3 {
                lse_vals[rows + r] = f32::NEG_INFINITY;
            }
            let states: Vec<AttentionState> = (0..parts)
                .map(|p| AttentionState {
                    out: out_vals[p * rows * d..(p + 1) * rows * d].to_vec(),
                    lse: lse_vals[p * rows..(p + 1) * rows].to_vec(),
                    q_len,
                    q_heads,
                    head_dim: d,
                })
                .collect();
            let want = merge(&states).expect("reference merge");
            let out_parts = stream.clone_htod(&out_bits).expect("upload outputs");
            let lse_parts = stream.clone_htod(&lse_vals).expect("upload lse");
            let mut out = stream
                .clone_htod(&vec![0xFFFFu16; rows * d])
                .expect("poisoned output");
            let mut lse = stream
                .clone_htod(&vec![f32::NAN; rows])
                .expect("poisoned lse");
            kernel
                .merge(
                    &stream,
                    parts,
                    &out_parts,
                    &lse_parts,
                    &mut out,
                    Some(&mut lse),
                )
                .expect("merge");
            let have: Vec<f32> = stream
                .clone_dtoh(&out)
                .expect("download")
                .into_iter()
                .map(|x| word_to_f32(x, dtype))
                .collect();
            let have_lse: Vec<f32> = stream.clone_dtoh(&lse).expect("download lse");
            let u = common::unit_roundoff(dtype);
            for r in 0..rows {
                let (h, w) = (have_lse[r], want.lse[r]);
                let lse_ok = if w == f32::NEG_INFINITY {
                    h == w
                } else {
                    (f64::from(h) - f64::from(w)).abs()
                        <= 2f64.powi(-20) * (1.0 + f64::from(w).abs())
                };
                if !lse_ok {
                    failures.push(format!("{case} row {r}: LSE {h} for {w}"));
                }
                // The magnitude the f32 sums meet: the parts' outputs, weighted.
                let scale = (0..parts)
                    .flat_map(|p| states[p].out[r * d..(r + 1) * d].iter())
                    .fold(0.0f64, |m, x| m.max(f64::from(x.abs())));
                for c in 0..d {
                    let (h, w) = (have[r * d + c], want.out[r * d + c]);
                    let bound = u * f64::from(w.abs()) + 2f64.powi(-20) * scale;
                    if !h.is_finite() || (f64::from(h) - f64::from(w)).abs() > bound {
                        failures.push(format!(
                            "{case} row {r} channel {c}: {h} for {w} (bound {bound:.2e})"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} merged values off:\n{}",
        failures.len(),
        failures
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
