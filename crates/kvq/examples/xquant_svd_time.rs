//! How long the CPU reference takes to factor one XQuant projection (`W = down · up` by the SVD,
//! `kvq_reference::xquant::svd`, one-sided Jacobi in f64), and how exactly the factors rebuild `W`.
//!
//! ```sh
//! cargo run --release -p kvq --example xquant_svd_time -- 4096 1024
//! ```
//! Arguments: `d_model` and the projection's output width (`kv_heads · head_dim`); the weight is
//! random (Gaussian, scaled by 1/√d_model), which is the slow case for Jacobi: a trained weight's
//! decaying spectrum converges in fewer sweeps.

use kvq::reference::xquant::LatentProjection;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let d_model: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(4096);
    let out: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1024);
    // A fixed-seed xorshift and Box–Muller: no dependency for a timing example.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut uniform = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let scale = 1.0 / (d_model as f64).sqrt();
    let w: Vec<f32> = (0..d_model * out)
        .map(|_| {
            let (a, b) = (uniform(), uniform());
            ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos() * scale) as f32
        })
        .collect();
    let start = Instant::now();
    let p = match LatentProjection::from_weight(&w, d_model, out) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("cannot factor a [{d_model}][{out}] weight: {e}");
            std::process::exit(2);
        }
    };
    let took = start.elapsed();
    // Rebuild a few rows of W from the factors: the error is the f32 rounding of down and up.
    let rows = d_model.min(64);
    let rebuilt = p.expand(&p.down[..rows * p.rank]);
    let worst = rebuilt
        .iter()
        .zip(&w[..rows * out])
        .map(|(a, b)| (a - b).abs() as f64)
        .fold(0.0f64, f64::max);
    println!(
        "[{d_model}][{out}] → rank {}: {:.1} s on {} threads; largest |W − down·up| over {rows} rows {worst:.2e}",
        p.rank,
        took.as_secs_f64(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
}
