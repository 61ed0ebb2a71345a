//! Every built-in scheme: its grammar text, effective bits per element at 4K and 32K tokens, and its
//! attention error on a seeded synthetic layer, all from the CPU reference (`kvq::evaluate`).
//!
//! `cargo run --release -p kvq --example schemes` (a few seconds; a debug build works too, slower).

use kvq::evaluate::{self, Workload};
use kvq::reference::synth::SynthConfig;
use kvq::schemes::BUILTIN;
use std::process::ExitCode;
use std::time::Instant;

/// Memory is reported for a LLaMA-3.1-8B-shaped layer.
const HEAD_DIM: u32 = 128;
const KV_HEADS: u32 = 8;
/// Cached tokens of the synthetic sequence: 16 pages, so every scheme quantizes most of it.
const TOKENS: usize = 2048;
/// Held-out tokens CommVQ trains its codebooks on: small, to keep the example fast (the paper trains
/// on about a million vectors per layer; more calibration lowers CommVQ's error, docs/CODEBOOKS.md §4).
const CALIBRATION: usize = 1024;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), evaluate::EvalError> {
    let start = Instant::now();
    let cfg = SynthConfig {
        tokens: TOKENS,
        ..SynthConfig::default()
    };
    let w = Workload::generate(&cfg, CALIBRATION)?;
    let em_steps = w.training().em.steps;

    let header = [
        "kvq built-in schemes on the CPU reference (quantize → pack → unpack → decode attention)".into(),
        String::new(),
        format!(
            "bits/elem  one sequence of a layer with {KV_HEADS} KV heads × head_dim {HEAD_DIM}: payload + metadata + FP16"
        ),
        "           windows as allocated; CommVQ's per-layer codebooks are listed below, not counted in it.".into(),
        format!(
            "error      synthetic layer, SynthConfig::default() shape and seed ({:#x}: {} KV heads × {}, GQA {},",
            cfg.seed, cfg.kv_heads, cfg.head_dim, cfg.gqa
        ),
        format!(
            "           d_model {}), {TOKENS} cached tokens + {CALIBRATION} held-out ones; one decode step: attention-output",
            cfg.d_model
        ),
        "           relative error ‖o − o*‖/‖o*‖ and softmax MSE against exact FP32 attention (f64 accumulation).".into(),
        format!(
            "CommVQ     codebooks trained on the {CALIBRATION} held-out tokens ({em_steps} EM steps per round): a small set,"
        ),
        "           for speed; more calibration lowers CommVQ's error.".into(),
        String::new(),
    ];
    for line in header {
        println!("{line}");
    }
    println!(
        "{:<12} {:>9} {:>9} {:>10} {:>10} {:>11} {:>7}  scheme text",
        "name", "bits @4K", "bits @32K", "saved @32K", "attn err", "softmax MSE", "time"
    );
    let mut codebooks = Vec::new();
    for b in BUILTIN {
        let t = Instant::now();
        let at = |len| evaluate::memory(&b.spec, HEAD_DIM, KV_HEADS, len);
        let (m4, m32) = (at(4096)?, at(32768)?);
        let e = evaluate::evaluate(&b.spec, &w)?;
        println!(
            "{:<12} {:>9.3} {:>9.3} {:>9.1}% {:>10.4} {:>11.2e} {:>6.2}s  {}",
            b.name,
            m4.bits_per_element(),
            m32.bits_per_element(),
            100.0 * m32.saved_vs_fp16(),
            e.output_error,
            e.softmax_mse,
            t.elapsed().as_secs_f64(),
            b.spec
        );
        if m32.codebooks > 0 {
            codebooks.push((b.name, m32.codebooks));
        }
    }
    println!();
    for (name, bytes) in codebooks {
        println!(
            "{name}: codebooks {:.2} MiB per layer ({KV_HEADS} KV heads × {HEAD_DIM}), shared by all sequences",
            bytes as f64 / (1 << 20) as f64
        );
    }
    println!();
    println!(
        "Ran on the CPU reference ({} build) in {:.1}s; the GPU demo comes later in the `kvq` CLI.",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
