//! The autotuner on a GPU: tunes a few shapes of the configuration (32 query heads, 8 KV
//! heads, head_dim 128) into a temporary store and checks the contract: the winner passed the
//! reference check, is never slower than the default it was timed against, tuning takes under
//! 30 s, the result is stored, and the policies read it back. Prints a line per shape.
//!
//! Runs under its own harness: without a GPU the test shows as ignored, with the reason;
//! `KVQ_REQUIRE_GPU=1` makes that a failure.

mod gated;

use std::time::Duration;

use kvq_codegen::{Dtype, KernelShape};
use kvq_runtime::tune::{tolerance, ChoiceSource, TunePolicy, TuneProblem, TuneStore, Tuner};
use kvq_runtime::{Device, Jit};
use kvq_spec::SchemeSpec;

/// Every test of this file, by name.
const TESTS: &[(&str, fn())] = &[(
    "gpu_tuning_picks_a_correct_configuration_no_slower_than_the_default",
    gpu_tuning_picks_a_correct_configuration_no_slower_than_the_default,
)];

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
