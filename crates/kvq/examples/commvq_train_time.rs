//! How long the CPU reference takes to train a CommVQ scheme's codebooks (EM for the keys, the
//! additive codebook for the values), with the default schedules, on a synthetic layer.
//!
//! ```sh
//! cargo run --release -p kvq --example commvq_train_time -- commvq2 4096 2
//! ```
//! Arguments: the scheme (`commvq1`, `commvq2` or scheme text), calibration tokens, KV heads
//! (head_dim 128). Training runs one job per (KV head, key group) and per value book on all
//! cores, each job's time linear in the tokens: with a core per job, the time grows with the
//! tokens alone.

use kvq::reference::commvq::{self, CalibrationData, TrainOptions};
use kvq::reference::synth::{generate, SynthConfig};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scheme = args.first().map_or("commvq2", String::as_str);
    let tokens: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4096);
    let kv_heads: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(2);
    let spec = match kvq::schemes::by_name(scheme) {
        Some(b) => b.spec,
        None => match scheme.parse() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("`{scheme}` is neither a built-in nor scheme text: {e}");
                std::process::exit(2);
            }
        },
    };
    let layer = generate(&SynthConfig {
        tokens,
        kv_heads,
        gqa: 1,
        head_dim: 128,
        d_model: 256,
        seed: 1,
        ..Default::default()
    });
    let data = CalibrationData {
        k_pre_rope: &layer.k_pre_rope,
        v: &layer.v,
        rope: layer.rope,
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let start = Instant::now();
    match commvq::train_with(&spec, &data, &TrainOptions::seeded(1)) {
        Ok(_) => println!(
            "{scheme}: {tokens} tokens × {kv_heads} KV heads × 128 trained in {:.1} s on {cores} cores",
            start.elapsed().as_secs_f64()
        ),
        Err(e) => {
            eprintln!("training failed: {e}");
            std::process::exit(1);
        }
    }
}
