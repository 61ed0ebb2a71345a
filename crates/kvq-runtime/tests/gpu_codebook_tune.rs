//! The codebook decode's tuner on a GPU: CommVQ-1 and CommVQ-2 caches filled by the GPU encoders,
//! tuned into a temporary store. The contract: the winner's output agrees with the default's, it
//! is never slower than the default in the same pass, tuning ends in reasonable time, the result
//! is stored, and the policies read it back. Prints a line per scheme.
//!
//! Runs under its own harness: without a GPU the test shows as ignored, with the reason;
//! `KVQ_REQUIRE_GPU=1` makes that a failure.

mod gated;

use std::time::Instant;

use half::f16;
use kvq_codegen::{CodebookParams, Dtype, KernelShape};
use kvq_reference::commvq::{self, CalibrationData, TrainOptions};
use kvq_reference::synth::{generate, SynthConfig};
use kvq_runtime::codebook::{
    CodebookCache, CodebookEncoder, CodebookKernel, CodebookScratch, EncodeInputs,
};
use kvq_runtime::tune::{tolerance, ChoiceSource, TunePolicy, TuneProblem, TuneStore, Tuner};
use kvq_runtime::{Device, Jit};
use kvq_spec::SchemeSpec;

const TESTS: &[(&str, fn())] = &[(
    "codebook_tuning_picks_a_correct_launch_no_slower_than_the_default",
    codebook_tuning_picks_a_correct_launch_no_slower_than_the_default,
)];

fn main() {
    gated::run_gpu_tests(TESTS)
}

const SCHEMES: &[(&str, &str)] = &[
    (
        "CommVQ-1",
        "k = codebook(rope_commutative, levels = 64, residuals = 10, pairs_per_code = 64, span = token), \
         v = codebook(additive, rows = 128)",
    ),
    (
        "CommVQ-2",
        "k = codebook(rope_commutative, levels = 64, residuals = 21, pairs_per_code = 64, span = token), \
         v = codebook(additive, rows = 256)",
    ),
];

fn codebook_tuning_picks_a_correct_launch_no_slower_than_the_default() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.default_stream();
    let dir = std::env::temp_dir().join(format!("kvq-cb-tune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.join("tune.json");
    let (kv_heads, d, batch, len) = (8usize, 128usize, 4usize, 8192usize);
    let shape = KernelShape::new(d as u32, 4, Dtype::F16);
    for (name, text) in SCHEMES {
        let spec: SchemeSpec = text.parse().expect("scheme");
        let cal = generate(&SynthConfig {
            tokens: 512,
            kv_heads,
            gqa: 1,
            head_dim: d,
            d_model: 256,
            seed: 9,
            ..Default::default()
        });
        let data = CalibrationData {
            k_pre_rope: &cal.k_pre_rope,
            v: &cal.v,
            rope: cal.rope,
        };
        let books = commvq::train_with(&spec, &data, &TrainOptions::quick(9)).expect("training");
        let encoder =
            CodebookEncoder::load(&jit, &spec, &books, d, kv_heads, Dtype::F16).expect("encoder");
        let words: Vec<u16> = (0..len * kv_heads * d)
            .map(|i| {
                let x = ((i.wrapping_mul(2_654_435_761) >> 9) % 2001) as f32 / 1000.0 - 1.0;
                f16::from_f32(x).to_bits()
            })
            .collect();
        let x = stream.clone_htod(&words).expect("upload");
        let inputs = EncodeInputs {
            k_pre_rope: &x,
            k_post_rope: &x,
            v: &x,
            tokens: len,
        };
        let mut caches: Vec<CodebookCache> = Vec::new();
        for _ in 0..2 {
            let mut c = encoder
                .new_cache(&stream, batch, len, 10_000.0)
                .expect("cache");
            for slot in 0..batch {
                encoder
                    .append(&stream, &mut c, slot, &inputs)
                    .expect("append");
            }
            caches.push(c);
        }
        let refs: Vec<&CodebookCache> = caches.iter().collect();
        let q_words: Vec<u16> = (0..batch * kv_heads * 4 * d)
            .map(|i| f16::from_f32(((i * 7919 % 997) as f32 / 498.0) - 1.0).to_bits())
            .collect();
        let q = stream.clone_htod(&q_words).expect("q");
        let problem = TuneProblem::new(spec, shape, kv_heads, batch, len);
        let mut tuner = Tuner::with_store(&jit, TunePolicy::Full, TuneStore::empty(&path));
        let t = Instant::now();
        let report = tuner
            .tune_codebook_on(&problem, &refs, &q)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let took = t.elapsed();
        println!(
            "{name} B={batch} L={len}: default {} {:.1} µs, chosen {} {:.1} µs (×{:.3}), {} launches ({} rejected), {:.1} s",
            report.default,
            report.default_us,
            report.chosen,
            report.chosen_us,
            report.speedup(),
            report.candidates,
            report.rejected,
            took.as_secs_f64()
        );
        assert!(report.chosen_us <= report.default_us, "{report:?}");
        assert!(report.candidates > 10 && report.rejected < report.candidates);
        assert!(took.as_secs() < 240, "tuning took {took:?}");
        assert_eq!(report.saved_to.as_deref(), Some(path.as_path()));
        // The winner's output agrees with the default's.
        let out_of = |params: &CodebookParams, splits: usize| -> Vec<u16> {
            let k =
                CodebookKernel::load_with(&jit, &spec, &shape, kv_heads, params).expect("kernel");
            let mut out = stream
                .clone_htod(&vec![0x7e00u16; q_words.len()])
                .expect("out");
            let mut scratch = CodebookScratch::new(&stream).expect("scratch");
            k.attend(&stream, &caches[0], &q, &mut out, splits, &mut scratch)
                .expect("decode");
            stream.clone_dtoh(&out).expect("download")
        };
        let a = out_of(&report.default.params, report.default.splits);
        let b = out_of(&report.chosen.params, report.chosen.splits);
        let scale = a
            .iter()
            .map(|&w| f16::from_bits(w).to_f64().abs())
            .fold(0.0, f64::max);
        for (x, y) in a.iter().zip(&b) {
            let (x, y) = (f16::from_bits(*x).to_f64(), f16::from_bits(*y).to_f64());
            assert!(
                y.is_finite() && (x - y).abs() <= tolerance(Dtype::F16) * scale,
                "{x} vs {y}"
            );
        }
        // The store answers, and the policies read it.
        assert_eq!(tuner.codebook_lookup(&problem), Some(report.chosen));
        let mut cached = Tuner::with_store(&jit, TunePolicy::Cached, TuneStore::open(&path));
        let (l, source) = cached.choose_codebook(&problem, &refs, &q).expect("cached");
        assert_eq!((l, source), (report.chosen, ChoiceSource::Stored));
        let mut off = Tuner::with_store(&jit, TunePolicy::Off, TuneStore::open(&path));
        let (l, source) = off.choose_codebook(&problem, &refs, &q).expect("off");
        assert_eq!((l, source), (report.default, ChoiceSource::Heuristic));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
