//! The XQuant decode's tuner on a GPU: XQuant-2 and XQuant-CL-2 over synthetic latents at the
//! standard shape (8 KV heads of 128, GQA 4, d_model 4,096: latents of 1,024), tuned into a
//! temporary store. The contract: tuning runs through the synthetic path (`tune_xquant`) and the
//! caller's batches (`choose_xquant` under `full`), the winner's output agrees with the default's,
//! it is never slower than the default in the same pass, the result is stored, and the policies
//! read it back (`off` never does). Prints a line per scheme and shape.
//!
//! Runs under its own harness: without a GPU the test shows as ignored, with the reason;
//! `KVQ_REQUIRE_GPU=1` makes that a failure.

mod gated;

use std::time::Instant;

use kvq_codegen::{Dtype, KernelShape, RebuildPrecision};
use kvq_runtime::tune::synth::random_queries;
use kvq_runtime::tune::{
    relative_difference, tolerance, ChoiceSource, TunePolicy, TuneProblem, TuneStore, Tuner,
};
use kvq_runtime::xquant::{
    synthetic_cache, XQuantDeviceCache, XQuantKernel, XQuantScratch, XQUANT_MAX_SPLITS,
};
use kvq_runtime::{Device, Jit};
use kvq_spec::SchemeSpec;

const TESTS: &[(&str, fn())] = &[(
    "xquant_tuning_picks_a_correct_split_count_no_slower_than_the_default",
    xquant_tuning_picks_a_correct_split_count_no_slower_than_the_default,
)];

fn main() {
    gated::run_gpu_tests(TESTS)
}

const SCHEMES: &[(&str, &str)] = &[
    (
        "XQuant-2",
        "k = int(2, channel), v = int(2, token), source = x(latent)",
    ),
    (
        "XQuant-CL-2",
        "k = int(2, channel), v = int(2, token), source = x(cross_layer)",
    ),
];

fn xquant_tuning_picks_a_correct_split_count_no_slower_than_the_default() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.default_stream();
    let dir = std::env::temp_dir().join(format!("kvq-xq-tune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.join("tune.json");
    let (kv, d, d_model) = (8usize, 128usize, 4096usize);
    let shape = KernelShape::new(d as u32, 4, Dtype::F16);
    let precision = RebuildPrecision::F16;
    for (name, text) in SCHEMES {
        let spec: SchemeSpec = text.parse().expect("scheme");
        // B=1: one wave takes many splits; B=8: few.
        for (batch, len) in [(1usize, 8192usize), (8, 4096)] {
            let problem = TuneProblem::new(spec, shape, kv, batch, len);
            let mut tuner = Tuner::with_store(&jit, TunePolicy::Full, TuneStore::empty(&path));
            let t = Instant::now();
            let report = tuner
                .tune_xquant(&problem, d_model, precision)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let took = t.elapsed();
            println!(
                "{name} B={batch} L={len}: default {} splits {:.1} µs, chosen {} {:.1} µs (×{:.3}), \
                 {} candidates ({} rejected), {:.1} s",
                report.default,
                report.default_us,
                report.chosen,
                report.chosen_us,
                report.speedup(),
                report.candidates.len(),
                report.rejected(),
                took.as_secs_f64()
            );
            assert!(report.chosen_us <= report.default_us, "{report:?}");
            assert!((1..=XQUANT_MAX_SPLITS).contains(&report.chosen));
            assert!(report.candidates.len() > 1 && report.rejected() < report.candidates.len());
            assert!(took.as_secs() < 120, "tuning took {took:?}");
            assert_eq!(report.saved_to.as_deref(), Some(path.as_path()));

            // The policies over the caller's batch: off → the default, cached and full → stored.
            let kernel =
                XQuantKernel::load(&jit, &spec, &shape, kv, d_model, precision).expect("kernel");
            assert_eq!(report.default, kernel.default_splits(batch, len));
            let one = synthetic_cache(&spec, (kv, d, d_model), len, 5).expect("cache");
            let gpu = XQuantDeviceCache::upload(&stream, &vec![one; batch]).expect("upload");
            let (q_words, _) = random_queries(batch * kv * 4 * d, Dtype::F16, 3).expect("q");
            let q = stream.clone_htod(&q_words).expect("q");
            let mut reader = Tuner::with_store(&jit, TunePolicy::Off, TuneStore::open(&path));
            let choose = |t: &mut Tuner<'_>| t.choose_xquant(&problem, &kernel, &[&gpu], &q);
            assert_eq!(
                choose(&mut reader).expect("off"),
                (report.default, ChoiceSource::Heuristic)
            );
            for policy in [TunePolicy::Cached, TunePolicy::Full] {
                reader.set_policy(policy);
                assert_eq!(
                    choose(&mut reader).expect("stored"),
                    (report.chosen, ChoiceSource::Stored),
                    "{policy}"
                );
            }

            // The winner's output agrees with the default's on another batch.
            let out_of = |splits: usize| -> Vec<u16> {
                let mut out = stream
                    .clone_htod(&vec![0x7e00u16; q_words.len()])
                    .expect("out");
                let mut scratch = XQuantScratch::new(&stream).expect("scratch");
                kernel
                    .attend(&stream, &gpu, &q, &mut out, splits, &mut scratch)
                    .expect("decode");
                stream.clone_dtoh(&out).expect("download")
            };
            let (a, b) = (out_of(report.default), out_of(report.chosen));
            let diff = relative_difference(&b, &a, Dtype::F16).expect("finite outputs");
            assert!(diff <= tolerance(Dtype::F16), "{name}: {diff:.2e}");
        }
    }
    // `full` without a stored result tunes on the caller's batches and stores under their key.
    let spec: SchemeSpec = SCHEMES[0].1.parse().expect("scheme");
    let (batch, len) = (2usize, 2048usize);
    let problem = TuneProblem::new(spec, shape, kv, batch, len);
    let kernel = XQuantKernel::load(&jit, &spec, &shape, kv, d_model, precision).expect("kernel");
    let one = synthetic_cache(&spec, (kv, d, d_model), len, 8).expect("cache");
    let gpu = XQuantDeviceCache::upload(&stream, &vec![one; batch]).expect("upload");
    let (q_words, _) = random_queries(batch * kv * 4 * d, Dtype::F16, 4).expect("q");
    let q = stream.clone_htod(&q_words).expect("q");
    let mut tuner = Tuner::with_store(&jit, TunePolicy::Full, TuneStore::open(&path));
    assert!(tuner.xquant_lookup(&problem, &kernel).is_none());
    let (splits, source) = tuner
        .choose_xquant(&problem, &kernel, &[&gpu], &q)
        .expect("tuned on the caller's batch");
    assert_eq!(source, ChoiceSource::Tuned);
    assert_eq!(tuner.xquant_lookup(&problem, &kernel), Some(splits));
    println!("XQuant-2 B={batch} L={len} on the caller's batch: {splits} splits");
    let _ = std::fs::remove_dir_all(&dir);
}
