//! The autotuner on a GPU: tunes a few shapes of the configuration (32 query heads, 8 KV
//! heads, head_dim 128) into a temporary store and checks the contract: the winner passed the
//! reference check, is never slower than the default it was timed against, tuning takes under
//! 30 s, the result is stored, and the policies read it back; and that the launch rules' untuned
//! choice is never slower than the tuner's winner beyond noise. Prints a line per shape.
//!
//! Runs under its own harness: without a GPU the tests show as ignored, with the reason;
//! `KVQ_REQUIRE_GPU=1` makes that a failure.

mod gated;

use std::time::Duration;

use kvq_codegen::{Dtype, KernelShape};
use kvq_runtime::tune::{tolerance, ChoiceSource, TunePolicy, TuneProblem, TuneStore, Tuner};
use kvq_runtime::{Device, Jit};
use kvq_spec::SchemeSpec;

/// Every test of this file, by name.
const TESTS: &[(&str, fn())] = &[
    (
        "gpu_tuning_picks_a_correct_configuration_no_slower_than_the_default",
        gpu_tuning_picks_a_correct_configuration_no_slower_than_the_default,
    ),
    (
        "gpu_untuned_rules_are_never_slower_than_the_tuned_choice_beyond_noise",
        gpu_untuned_rules_are_never_slower_than_the_tuned_choice_beyond_noise,
    ),
];

fn main() {
    gated::run_gpu_tests(TESTS)
}

fn temp_store(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvq-tune-gpu-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir.join("tune.json")
}

fn gpu_tuning_picks_a_correct_configuration_no_slower_than_the_default() {
    let device = Device::open(0).expect("GPU");
    println!("{}", device.props());
    let jit = Jit::new(&device).expect("JIT");
    let path = temp_store("contract");
    let mut tuner = Tuner::with_store(&jit, TunePolicy::Full, TuneStore::empty(&path));
    let kivi2: SchemeSpec = "k = int(2, channel), v = int(2, token), local = 128"
        .parse()
        .unwrap();
    let fp16: SchemeSpec = "k = fp16, v = fp16".parse().unwrap();
    let calib1: SchemeSpec = "k = int(1, channel), v = int(1, channel), sink = 32, local = 128, \
                              calibrate = calibrate(tau1 = -1.5, tau2 = 3.25)"
        .parse()
        .unwrap();
    let cases = [
        (kivi2, Dtype::F16, 16, 32_768),
        (kivi2, Dtype::F16, 1, 32_768),
        (fp16, Dtype::F16, 16, 4096),
        (calib1, Dtype::Bf16, 1, 4096),
    ];
    for (spec, dtype, batch, len) in cases {
        let problem = TuneProblem::new(spec, KernelShape::new(128, 4, dtype), 8, batch, len);
        let heuristic = tuner.heuristic(&problem).expect("heuristic");
        let selection = tuner.choose(&problem).expect("tune");
        assert_eq!(selection.source, ChoiceSource::Tuned);
        let entry = tuner
            .store()
            .lookup(tuner.gpu(), &problem.key())
            .expect("stored")
            .clone();
        assert_eq!(entry.choice, selection.choice);
        let winner = entry.choice;
        println!(
            "{spec} {dtype} B={batch} L={len}: default {heuristic} {:.1} µs → tuned {winner} {:.1} µs (×{:.3}), {} candidates, {} rejected",
            entry.default_us,
            entry.tuned_us,
            entry.default_us / entry.tuned_us,
            entry.candidates,
            entry.rejected
        );
        assert!(entry.tuned_us <= entry.default_us, "never slower");
        if entry.rejected > 0 {
            println!(
                "  NOTE: {} candidate(s) rejected (wrong output or no build)",
                entry.rejected
            );
        }

        // A fresh session reports timing and errors in detail.
        let report = tuner.tune(&problem).expect("tune again");
        let chosen = report
            .candidates
            .iter()
            .find(|c| c.choice == report.chosen)
            .expect("winner among candidates");
        let err = chosen.error.expect("winner was checked");
        assert!(err <= tolerance(dtype), "{err}");
        assert!(
            report.elapsed < Duration::from_secs(30),
            "tuning took {:?}",
            report.elapsed
        );
        for c in report.candidates.iter().filter(|c| c.rejected.is_some()) {
            println!(
                "  rejected {}: {}",
                c.choice,
                c.rejected.as_deref().unwrap_or("")
            );
        }
        println!(
            "  second session: {} in {:.1} s, {} copies, rel err {err:.1e}, truncated {}",
            report.chosen,
            report.elapsed.as_secs_f64(),
            report.copies,
            report.truncated
        );
    }

    // The stored results are what the other policies see.
    let problem = TuneProblem::new(kivi2, KernelShape::new(128, 4, Dtype::F16), 8, 12, 30_000);
    let mut cached = Tuner::with_store(&jit, TunePolicy::Cached, TuneStore::open(&path));
    let s = cached.choose(&problem).unwrap();
    assert_eq!(s.source, ChoiceSource::Stored);
    cached.set_policy(TunePolicy::Off);
    let s = cached.choose(&problem).unwrap();
    assert_eq!(s.source, ChoiceSource::Heuristic);
    assert_eq!(s.choice, cached.heuristic(&problem).unwrap());
    let unknown = TuneProblem::new(kivi2, KernelShape::new(64, 4, Dtype::F16), 8, 12, 30_000);
    cached.set_policy(TunePolicy::Cached);
    assert_eq!(
        cached.choose(&unknown).unwrap().source,
        ChoiceSource::Heuristic
    );
    if let Some(dir) = path.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// On a GPU: for the lead shapes (32 query heads over 8 KV heads, head_dim 128, f16, B ∈ {1, 16}
/// × L ∈ {4K, 32K}), the launch rules' untuned choice is never slower than the tuner's winner,
/// timed in the same session, by more than the noise (`KVQ_RULES_NOISE`, default 0.05). Prints
/// each shape's ratio.
fn gpu_untuned_rules_are_never_slower_than_the_tuned_choice_beyond_noise() {
    let device = Device::open(0).expect("GPU");
    let noise: f64 = std::env::var("KVQ_RULES_NOISE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.05);
    let jit = Jit::new(&device).expect("JIT");
    let path = temp_store("rules");
    let mut tuner = Tuner::with_store(&jit, TunePolicy::Full, TuneStore::empty(&path));
    let mut options = tuner.options().clone();
    options.progress = false;
    options.time_budget = std::time::Duration::from_secs(10);
    tuner.set_options(options);
    let mut slower = Vec::new();
    for (scheme, text) in [
        ("fp16", "k = fp16, v = fp16"),
        (
            "int8",
            "k = int(8, channel, symmetric), v = int(8, channel, symmetric)",
        ),
        (
            "kivi4",
            "k = int(4, channel), v = int(4, token), local = 128",
        ),
        (
            "kivi2",
            "k = int(2, channel), v = int(2, token), local = 128",
        ),
        (
            "kitty",
            "k = int(2, channel, boost = boost(4, ratio = 0.125, by = magnitude)), \
             v = int(2, token, local = 128), sink = 32, page = 128",
        ),
        (
            "calibquant1",
            "k = int(1, channel), v = int(1, channel), sink = 32, local = 128, \
             calibrate = calibrate(tau1 = -1.5, tau2 = 3.25)",
        ),
    ] {
        let spec: SchemeSpec = text.parse().unwrap();
        for (batch, len) in [(1, 4096), (1, 32_768), (16, 4096), (16, 32_768)] {
            let p = TuneProblem::new(spec, KernelShape::new(128, 4, Dtype::F16), 8, batch, len);
            let r = tuner.tune(&p).expect("tuning");
            let ratio = r.default_us / r.chosen_us;
            println!(
                "{scheme} B={batch} L={len}: rules {} {:.1} µs, tuned {} {:.1} µs, ×{ratio:.3}",
                r.default, r.default_us, r.chosen, r.chosen_us
            );
            if ratio > 1.0 + noise {
                slower.push(format!("{scheme} B={batch} L={len} ×{ratio:.3}"));
            }
        }
    }
    if let Some(dir) = path.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
    assert!(
        slower.is_empty(),
        "untuned launches slower than the tuned choice by more than {noise}: {slower:?}"
    );
}
