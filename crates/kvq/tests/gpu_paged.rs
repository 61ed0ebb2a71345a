//! The GPU paged cache against the CPU reference on the same token stream: prefill + appends (crossing
//! page boundaries with sink and local windows in play) must produce exactly the reference's page
//! bytes (codes, scales, zeros, boost planes and maps), sink and live tail-ring rows; attention over it
//! must match the reference, each output element within its error bound (`common::expected`).
//! Shapes: head_dim 128 (f16) and 64 (bf16) in every page quantizer form, and 80, 96, 112, 160
//! and 192 (rows that are not a power of two of 8-channel chunks, or not whole 32-channel units)
//! for every scheme in its default forms and some others, two of them also in bf16
//! ([`SHAPES`]; `KVQ_TEST_HEAD_DIMS=80,112` checks only those, printed).
//! Plus the cache's error paths. Fresh random inputs each run (seed printed, `KVQ_SEED` repeats
//! one), each case's drawn from (seed, case name), so a test-name filter does not change them.
//! Runs under its own harness: without a GPU every test shows as ignored, with the reason;
//! `KVQ_REQUIRE_GPU=1` makes that a failure.

mod common;
use common::{
    case_seed, expected, integer_schemes, judge, needs, run_trials, seed, selected_head_dims,
};
use half::f16;
use kvq::codegen::{Dtype, KernelShape, QuantizerForm, QuantizerForms, TuneParams};
use kvq::reference::attention::{self, Queries};
use kvq::reference::int::IntCache;
use kvq::reference::synth::{self, Tails};
use kvq::reference::KvTensor;
use kvq::runtime::paged::{forms_or_tiled, tune_forms};
use kvq::runtime::testing::Need;
use kvq::runtime::tune::synth::{random_queries, round_to_word};
use kvq::runtime::{
    CacheConfig, DecodeKernel, DecodeScratch, Device, Jit, PagedKvCache, RuntimeError, SeqId,
};
use kvq::SchemeSpec;

fn main() {
    run_trials(vec![
        needs(
            Need::Gpu,
            "gpu_paged_cache_matches_the_reference_for_every_integer_scheme",
            gpu_paged_cache_matches_the_reference_for_every_integer_scheme,
        ),
        needs(
            Need::Gpu,
            "gpu_paged_cache_errors_leave_the_cache_intact",
            gpu_paged_cache_errors_leave_the_cache_intact,
        ),
        needs(
            Need::Gpu,
            "gpu_prefill_quantize_bandwidth",
            gpu_prefill_quantize_bandwidth,
        ),
        needs(
            Need::Gpu,
            "gpu_packed_prefill_equals_separate_prefills",
            gpu_packed_prefill_equals_separate_prefills,
        ),
        needs(
            Need::Gpu,
            "gpu_quantizer_form_tuning_picks_a_bit_exact_winner",
            gpu_quantizer_form_tuning_picks_a_bit_exact_winner,
        ),
    ]);
}

const KV_HEADS: usize = 2;
const GQA: usize = 4;
/// Prompt lengths of the sequences, then appends for every sequence: crosses sink (32), local (128)
/// and several 128-token pages from each starting point.
const PROMPTS: &[usize] = &[0, 31, 200, 1100];
const APPENDS: usize = 420;

/// The shapes every scheme runs at, with the page quantizer forms tried there besides the
/// defaults (tiled for a tensor a form does not take): every form at head_dim 128 and at 64 in
/// bf16; at the other head_dims in f16 one more form, so the naive and tiled forms' per-element
/// paths (80, 112), their warp-per-row paths (96, 192) and the coarsened form's 16-bit loads
/// (160) run beside the defaults (mostly the vectorized form, whose rows there leave lanes idle);
/// two of them also in bf16.
const SHAPES: &[(usize, Dtype, &[QuantizerForm])] = &[
    (128, Dtype::F16, &QuantizerForm::ALL),
    (64, Dtype::Bf16, &QuantizerForm::ALL),
    (80, Dtype::F16, &[QuantizerForm::Tiled]),
    (96, Dtype::F16, &[QuantizerForm::Tiled]),
    (112, Dtype::F16, &[QuantizerForm::Naive]),
    (160, Dtype::F16, &[QuantizerForm::Coarsened]),
    (192, Dtype::F16, &[QuantizerForm::Tiled]),
    (80, Dtype::Bf16, &[]),
    (192, Dtype::Bf16, &[]),
];

/// [`SHAPES`], or those whose head_dim `KVQ_TEST_HEAD_DIMS` names (each must be one of them).
fn shapes() -> Vec<(usize, Dtype, &'static [QuantizerForm])> {
    let known: Vec<u32> = SHAPES.iter().map(|s| s.0 as u32).collect();
    let Some(dims) = selected_head_dims(&known) else {
        return SHAPES.to_vec();
    };
    SHAPES
        .iter()
        .filter(|s| dims.contains(&(s.0 as u32)))
        .copied()
        .collect()
}

/// The forms a case runs at a shape: the defaults, then each listed form for both tensors (tiled
/// for a tensor it does not take), skipping a form neither tensor takes and repeats.
fn case_forms(spec: &SchemeSpec, d: usize, forms: &[QuantizerForm]) -> Vec<QuantizerForms> {
    let mut out = vec![QuantizerForms::default_for(spec, d as u32)];
    for &form in forms {
        let f = forms_or_tiled(spec, d as u32, form);
        if (f == QuantizerForms::both(form) || form == QuantizerForm::Tiled) && !out.contains(&f) {
            out.push(f);
        }
    }
    out
}

/// Built-ins plus schemes that reach the quantizer's other paths: 3-bit planes, token-axis keys with
/// several groups per token, symmetric boosted codes ranked by variance, a 64-token page.
fn all_paths() -> Vec<(&'static str, SchemeSpec)> {
    let mut schemes = integer_schemes();
    for (name, text) in [
        ("3bit-token", "k = int(3, token, group = 32), v = int(3, channel), sink = 16, page = 64"),
        (
            "sym-boost-var",
            "k = int(4, channel, symmetric, boost = boost(8, ratio = 0.25, by = variance)), v = int(2, token, group = 32), local = 64",
        ),
    ] {
        schemes.push((name, SchemeSpec::parse(text).expect("test scheme")));
    }
    schemes
}

/// A token stream `[tokens][kv_heads][head_dim]` as device words and as the f32 values they encode.
struct Stream {
    bits: Vec<u16>,
    values: Vec<f32>,
}

/// A case's K and V token streams: the reference's fast generator (heavy tails, outlier key
/// channels), seeded by (run seed, case), rounded to `dtype` and laid out token-major.
fn streams(
    seed: u64,
    case: &str,
    tokens: usize,
    head_dim: usize,
    dtype: Dtype,
) -> (Stream, Stream) {
    let (k, v) = synth::random_kv(
        KV_HEADS,
        tokens,
        head_dim,
        case_seed(seed, case),
        Tails::Laplace,
    )
    .expect("synthetic K/V");
    let token_major = |x: &KvTensor| {
        let (bits, values) = (0..tokens)
            .flat_map(|t| (0..KV_HEADS).map(move |h| (t, h)))
            .flat_map(|(t, h)| x.row(h, t).iter().map(|&v| round_to_word(v, dtype)))
            .unzip();
        Stream { bits, values }
    };
    (token_major(&k), token_major(&v))
}

/// Token-major `[tokens][kv_heads][d]` values → the reference's head-major tensor.
fn head_major(values: &[f32], tokens: usize, d: usize) -> KvTensor {
    let mut x = KvTensor::zeros(KV_HEADS, tokens, d);
    for t in 0..tokens {
        for h in 0..KV_HEADS {
            x.row_mut(h, t)
                .copy_from_slice(&values[(t * KV_HEADS + h) * d..(t * KV_HEADS + h + 1) * d]);
        }
    }
    x
}

fn rows(s: &Stream, from: usize, to: usize, d: usize) -> Vec<u16> {
    s.bits[from * KV_HEADS * d..to * KV_HEADS * d].to_vec()
}

/// Compares a sequence's device state with the reference built from the same tokens; returns a list
/// of differences (empty when bit-exact).
fn compare_state(cache: &PagedKvCache, id: SeqId, reference: &IntCache) -> Vec<String> {
    cache.snapshot(id).expect("snapshot").differences(reference)
}

fn gpu_paged_cache_matches_the_reference_for_every_integer_scheme() {
    let device = Device::open(0).expect("GPU");
    let seed = seed();
    println!(
        "device {}, seed {seed} (KVQ_SEED={seed} repeats this run)",
        device.props().name
    );
    let jit = Jit::new(&device).expect("JIT");
    let stream_ = device.default_stream();
    let mut failures = Vec::new();
    let mut report = Vec::new();
    let shapes = shapes();
    for (name, spec) in all_paths() {
        for (d, dtype, forms) in shapes
            .iter()
            // A token group that does not divide the row: the spec refuses that shape.
            .filter(|(d, _, _)| spec.check_shape_usize(*d, KV_HEADS).is_ok())
            .flat_map(|&(d, t, f)| case_forms(&spec, d, f).into_iter().map(move |f| (d, t, f)))
        {
            // The attention check runs once per shape, on the default forms.
            let default_forms = forms == QuantizerForms::default_for(&spec, d as u32);
            let cfg = CacheConfig {
                kv_heads: KV_HEADS,
                head_dim: d,
                max_seqs: PROMPTS.len(),
                pool_pages: 64,
                max_tokens: 4096,
                input_dtype: dtype,
            };
            let mut cache =
                PagedKvCache::with_forms(&jit, stream_.clone(), &spec, cfg, forms).expect("cache");
            let total: Vec<usize> = PROMPTS.iter().map(|p| p + APPENDS).collect();
            let (ks, vs): (Vec<Stream>, Vec<Stream>) = total
                .iter()
                .enumerate()
                .map(|(i, &n)| streams(seed, &format!("{name} d{d} {dtype} seq{i}"), n, d, dtype))
                .unzip();
            let ids: Vec<SeqId> = PROMPTS
                .iter()
                .map(|_| cache.add_sequence().expect("slot"))
                .collect();
            for (i, &p) in PROMPTS.iter().enumerate() {
                let k = stream_.clone_htod(&rows(&ks[i], 0, p, d)).expect("upload");
                let v = stream_.clone_htod(&rows(&vs[i], 0, p, d)).expect("upload");
                cache.prefill(ids[i], &k, &v, p, dtype).expect("prefill");
            }
            for step in 0..APPENDS {
                let mut kb = Vec::new();
                let mut vb = Vec::new();
                for (i, &p) in PROMPTS.iter().enumerate() {
                    kb.extend(rows(&ks[i], p + step, p + step + 1, d));
                    vb.extend(rows(&vs[i], p + step, p + step + 1, d));
                }
                let k = stream_.clone_htod(&kb).expect("upload");
                let v = stream_.clone_htod(&vb).expect("upload");
                cache.append(&ids, &k, &v, dtype).expect("append");
            }
            // State: bit-exact with the reference built from the same tokens.
            let mut refs = Vec::new();
            for (i, &n) in total.iter().enumerate() {
                assert_eq!(cache.len(ids[i]).unwrap(), n);
                let r = IntCache::build(
                    &spec,
                    &head_major(&ks[i].values, n, d),
                    &head_major(&vs[i].values, n, d),
                )
                .expect("reference");
                for diff in compare_state(&cache, ids[i], &r) {
                    failures.push(format!(
                        "{name} d{d} {dtype} {forms} seq {i} (len {n}): {diff}"
                    ));
                }
                refs.push(r);
            }
            if !default_forms {
                report.push(format!("{name:12} d{d} {dtype} {forms}: bit-exact checked"));
                continue;
            }
            // Attention over the cache the appends built.
            let shape = KernelShape::new(d as u32, GQA as u32, Dtype::F16);
            let kernel = match DecodeKernel::load_with(
                &jit,
                &spec,
                &shape,
                &TuneParams::default_for(&spec, &shape),
                kvq::runtime::LoadOptions::ALLOW_SLOW_PATH,
            ) {
                Ok(k) => k,
                Err(e) => {
                    // The cache's bytes were checked; say why its attention was not.
                    failures.push(format!("{name} d{d} {dtype}: no decode kernel: {e}"));
                    continue;
                }
            };
            let q_heads = KV_HEADS * GQA;
            let n = PROMPTS.len() * q_heads * d;
            let (q_bits, q_vals) = random_queries(
                n,
                Dtype::F16,
                case_seed(seed, &format!("{name} d{d} {dtype} queries")),
            )
            .expect("queries");
            let q = stream_.clone_htod(&q_bits).expect("q");
            let mut out = stream_.clone_htod(&vec![0xFFFFu16; n]).expect("out");
            let splits = kernel
                .default_splits(
                    PROMPTS.len(),
                    KV_HEADS,
                    cache.max_len(),
                    device.props().sm_count as usize,
                )
                .expect("occupancy");
            let pieces = kernel.default_pieces(cache.max_len(), splits);
            let mut scratch =
                DecodeScratch::with_pieces(&stream_, PROMPTS.len(), q_heads, d, splits, pieces)
                    .expect("scratch");
            cache
                .attend(&kernel, &q, &mut out, &mut scratch)
                .expect("attend");
            let got: Vec<u16> = stream_.clone_dtoh(&out).expect("download");
            let mut worst = 0.0f64;
            let mut worst_ratio = 0.0f64;
            for (i, r) in refs.iter().enumerate() {
                let per = q_heads * d;
                let queries = Queries {
                    data: q_vals[i * per..(i + 1) * per].to_vec(),
                    q_heads,
                    head_dim: d,
                };
                // The decode kernel runs in f16 whatever the cache's input dtype was.
                let want =
                    expected(&queries, &r.dequantize(), &spec, Dtype::F16).expect("reference");
                let have: Vec<f32> = got[i * per..(i + 1) * per]
                    .iter()
                    .map(|&x| f16::from_bits(x).to_f32())
                    .collect();
                let judged = judge(&have, &want);
                let err = attention::relative_error(&have, &want.want);
                worst = worst.max(err);
                worst_ratio = worst_ratio.max(judged.worst_ratio);
                if !judged.passed() {
                    failures.push(format!(
                        "{name} d{d} {dtype} seq {i}: attention {judged}; rel err {err:.3e}"
                    ));
                }
            }
            let mem = cache.memory().expect("memory");
            report.push(format!(
                "{name:12} d{d} {dtype} {forms}: pages {}/{}, {:.3} bits/element held, attention max rel err {worst:.2e}, {worst_ratio:.3} of its bound",
                mem.pages_used, mem.pages_total, mem.bits_per_element
            ));
        }
    }
    for line in &report {
        println!("{line}");
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn gpu_paged_cache_errors_leave_the_cache_intact() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let s = device.default_stream();
    let spec = kvq::schemes::by_name("kitty").unwrap().spec;
    let d = 128;
    let cfg = CacheConfig {
        kv_heads: KV_HEADS,
        head_dim: d,
        max_seqs: 2,
        pool_pages: 3,
        max_tokens: 1000,
        input_dtype: Dtype::F16,
    };
    let mut cache = PagedKvCache::new(&jit, s.clone(), &spec, cfg).unwrap();
    let seed = seed();
    let a = cache.add_sequence().unwrap();
    let b = cache.add_sequence().unwrap();
    assert!(matches!(
        cache.add_sequence(),
        Err(RuntimeError::NoFreeSlot(2))
    ));
    let (prompt, _) = streams(seed, "errors prompt", 400, d, Dtype::F16);
    let k = s.clone_htod(&prompt.bits).unwrap();
    cache.prefill(a, &k, &k, 400, Dtype::F16).unwrap();
    let before = cache.snapshot(a).unwrap();
    // b's prefill needs 2 more pages; only 1 is free.
    let err = cache.prefill(b, &k, &k, 400, Dtype::F16).unwrap_err();
    assert!(matches!(err, RuntimeError::PoolExhausted { .. }), "{err}");
    assert_eq!(cache.len(b).unwrap(), 0);
    assert_eq!(
        cache.snapshot(a).unwrap(),
        before,
        "a failed call changed another sequence"
    );
    // Wrong shapes and dtypes, unknown sequences, capacity.
    let one = s.clone_htod(&prompt.bits[..KV_HEADS * d]).unwrap();
    assert!(matches!(
        cache.append(&[a], &k, &one, Dtype::F16),
        Err(RuntimeError::InvalidInput(_))
    ));
    assert!(matches!(
        cache.append(&[a], &one, &one, Dtype::Bf16),
        Err(RuntimeError::InvalidInput(_))
    ));
    assert!(matches!(
        cache.append(&[SeqId(7)], &one, &one, Dtype::F16),
        Err(RuntimeError::UnknownSequence(7))
    ));
    cache.remove_sequence(b).unwrap();
    assert!(matches!(
        cache.append(&[b], &one, &one, Dtype::F16),
        Err(RuntimeError::UnknownSequence(1))
    ));
    let big = s
        .clone_htod(&streams(seed, "errors big", 1001, d, Dtype::F16).1.bits)
        .unwrap();
    let c = cache.add_sequence().unwrap();
    assert!(matches!(
        cache.prefill(c, &big, &big, 1001, Dtype::F16),
        Err(RuntimeError::CapacityExceeded { .. })
    ));
    assert_eq!(cache.snapshot(a).unwrap(), before);
    println!(
        "pool exhausted, shape, dtype, unknown sequence and capacity errors left the cache intact"
    );
}

/// Prefill quantize/pack bandwidth at 16 sequences × 32K tokens × 8 KV heads × head_dim 128 (f16
/// input; every sequence from its own input, so nothing is served from L2), against a 2 GiB
/// device-to-device copy (4 GiB read + written) measured in the same run. Prints a table; asserts only
/// that the numbers are sane — the ≥ 80% criterion is recorded in docs/BENCHMARKS.md.
fn gpu_prefill_quantize_bandwidth() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let s = device.default_stream();
    let (seqs, tokens, heads, d) = (16usize, 32768usize, 8usize, 128usize);
    // Copy baseline.
    let n = 1usize << 30; // u16 elements: 2 GiB
    let src = s.alloc_zeros::<u16>(n).expect("copy source");
    let mut dst = s.alloc_zeros::<u16>(n).expect("copy destination");
    let timer = kvq::runtime::GpuTimer::new(&jit).expect("GPU timer");
    let copy = timer
        .time(&s, 2, 10, |st| {
            st.memcpy_dtod(&src, &mut dst)
                .map_err(|e| RuntimeError::driver("memcpy_dtod", e))
        })
        .expect("copy timing");
    drop((src, dst));
    let copy_gbps = 4.0 * (1u64 << 30) as f64 / (copy.median_us() * 1e3);
    println!(
        "copy: 4 GiB (read + write) in {:.0} us median = {copy_gbps:.0} GB/s",
        copy.median_us()
    );
    // The prompts packed back to back, as an engine's batched prefill holds them (1 GiB each for
    // K and V, so nothing is served from L2).
    let mut rng = synth::SynthRng::new(case_seed(seed(), "bandwidth"));
    let k_words: Vec<u16> = (0..seqs * tokens * heads * d)
        .map(|_| f16::from_f32(3.0 * rng.symmetric()).to_bits())
        .collect();
    let v_words: Vec<u16> = k_words.iter().rev().copied().collect();
    let (k_packed, v_packed) = (
        s.clone_htod(&k_words).expect("k"),
        s.clone_htod(&v_words).expect("v"),
    );
    drop((k_words, v_words));
    println!(
        "| scheme | quantizer form (k, v) | MiB read + written | median µs | GB/s | % of copy |"
    );
    println!("|---|---|---|---|---|---|");
    for (name, spec) in integer_schemes().into_iter().filter(|(n, _)| *n != "fp16") {
        let cfg = CacheConfig {
            kv_heads: heads,
            head_dim: d,
            max_seqs: seqs,
            pool_pages: seqs * (tokens / 128 + 1),
            max_tokens: tokens,
            input_dtype: Dtype::F16,
        };
        let mut seen = Vec::new();
        for form in QuantizerForm::ALL {
            let forms = forms_or_tiled(&spec, d as u32, form);
            if seen.contains(&forms) {
                continue;
            }
            seen.push(forms);
            let mut cache =
                PagedKvCache::with_forms(&jit, s.clone(), &spec, cfg, forms).expect("cache");
            let prompts: Vec<(SeqId, usize)> = (0..seqs)
                .map(|_| (cache.add_sequence().unwrap(), tokens))
                .collect();
            cache
                .prefill_packed(&prompts, &k_packed, &v_packed, Dtype::F16)
                .expect("prefill");
            let t = cache
                .time_packed_prefill_quantizers(&prompts, &k_packed, &v_packed, 10)
                .expect("timing");
            let gbps = t.gbps();
            println!(
                "| {name} | {forms} | {:.0} | {:.0} | {gbps:.0} | {:.0}% |",
                (t.bytes_read + t.bytes_written) as f64 / (1 << 20) as f64,
                t.median_us,
                100.0 * gbps / copy_gbps
            );
            if name == "int8" {
                let elements = 2 * seqs * tokens * heads * d;
                println!(
                    "INT8 {form}: {elements} elements ({:.2e}) quantized and packed in {:.2} ms",
                    elements as f64,
                    t.median_us / 1e3
                );
            }
            assert!(gbps.is_finite() && gbps > 0.0);
        }
    }
}

fn gpu_packed_prefill_equals_separate_prefills() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let s = device.default_stream();
    let seed = seed();
    let lens = [300usize, 0, 1000, 129];
    let d = 128;
    for (name, spec) in integer_schemes() {
        let cfg = CacheConfig {
            kv_heads: KV_HEADS,
            head_dim: d,
            max_seqs: lens.len(),
            pool_pages: 32,
            max_tokens: 2048,
            input_dtype: Dtype::F16,
        };
        let total: usize = lens.iter().sum();
        let (k, v) = streams(seed, &format!("packed {name}"), total, d, Dtype::F16);
        let mut packed = PagedKvCache::new(&jit, s.clone(), &spec, cfg).expect("cache");
        let mut separate = PagedKvCache::new(&jit, s.clone(), &spec, cfg).expect("cache");
        let prompts: Vec<(SeqId, usize)> = lens
            .iter()
            .map(|&n| (packed.add_sequence().unwrap(), n))
            .collect();
        let (kd, vd) = (
            s.clone_htod(&k.bits).expect("k"),
            s.clone_htod(&v.bits).expect("v"),
        );
        packed
            .prefill_packed(&prompts, &kd, &vd, Dtype::F16)
            .expect("packed prefill");
        let mut first = 0;
        for &(id, n) in &prompts {
            // Slots are handed out in the same order in both caches, so the ids coincide.
            assert_eq!(separate.add_sequence().unwrap(), id);
            let kk = s.clone_htod(&rows(&k, first, first + n, d)).expect("k");
            let vv = s.clone_htod(&rows(&v, first, first + n, d)).expect("v");
            separate
                .prefill(id, &kk, &vv, n, Dtype::F16)
                .expect("prefill");
            assert_eq!(
                packed.snapshot(id).unwrap(),
                separate.snapshot(id).unwrap(),
                "{name}: sequence of {n} tokens"
            );
            first += n;
        }
    }
    println!("packed prefill of {lens:?} tokens equals separate prefills for every integer scheme");
}

fn gpu_quantizer_form_tuning_picks_a_bit_exact_winner() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let s = device.default_stream();
    for name in ["int8", "kivi2", "kitty"] {
        let spec = kvq::schemes::by_name(name).expect("built-in").spec;
        let started = std::time::Instant::now();
        let entry = tune_forms(&jit, &s, &spec, 128, Dtype::F16).expect("tuning");
        let seconds = started.elapsed().as_secs_f64();
        println!("{name}: winner {} in {seconds:.1} s", entry.forms);
        for c in &entry.candidates {
            println!(
                "  {}: {:.1} us, {:.0} GB/s, bit-exact {}",
                c.forms, c.median_us, c.gbps, c.bit_exact
            );
        }
        assert_eq!(
            entry.candidates.len(),
            4,
            "every form is a candidate at d128"
        );
        assert!(entry.candidates.iter().all(|c| c.bit_exact));
        let best = entry
            .candidates
            .iter()
            .map(|c| c.median_us)
            .fold(f64::INFINITY, f64::min);
        let winner = entry.candidates.iter().find(|c| c.forms == entry.forms);
        assert_eq!(winner.map(|c| c.median_us), Some(best));
        assert!(seconds < 30.0, "tuning took {seconds:.1} s");
    }
}
