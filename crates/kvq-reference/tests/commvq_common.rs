//! Shared helpers of the CommVQ tests (included with `mod`, not a test target of its own).
#![allow(dead_code)]

use kvq_reference::commvq::{self, CalibrationData, Codebooks, EmSchedule, TrainOptions};
use kvq_reference::synth::{generate, SynthConfig, SynthKv};
use kvq_spec::SchemeSpec;

/// A small layer: 2 KV heads of 64 channels, GQA 2.
pub fn layer(tokens: usize, seed: u64) -> SynthKv {
    generate(&SynthConfig {
        tokens,
        kv_heads: 2,
        gqa: 2,
        head_dim: 64,
        d_model: 96,
        seed,
        ..Default::default()
    })
}

/// A cheap scheme with every region: 4 sink tokens, 32 local, pages of 64.
pub fn small_scheme(span: &str) -> SchemeSpec {
    SchemeSpec::parse(&format!(
        "k = codebook(rope_commutative, levels = 16, residuals = 3, pairs_per_code = 8, span = {span}), \
         v = codebook(additive, rows = 64, span = {span}), page = 64, sink = 4, local = 32"
    ))
    .unwrap()
}

pub fn fast_options(seed: u64) -> TrainOptions {
    TrainOptions {
        em: EmSchedule {
            steps: 3,
            ..Default::default()
        },
        ..TrainOptions::seeded(seed)
    }
}

pub fn train(spec: &SchemeSpec, s: &SynthKv, seed: u64) -> Codebooks {
    let data = CalibrationData {
        k_pre_rope: &s.k_pre_rope,
        v: &s.v,
        rope: s.rope,
    };
    commvq::train_with(spec, &data, &fast_options(seed)).unwrap()
}

/// Relative difference `|a − b| / max(|b|, floor)`.
pub fn rel(a: f64, b: f64, floor: f64) -> f64 {
    (a - b).abs() / b.abs().max(floor)
}

/// Tokens `start .. start + n` of a layer as a sequence of their own (keys re-rotated to `0..n`).
/// Seeds change a synthetic layer's weights, so held-out data of the *same* layer (what a per-layer
/// codebook is for) is another window of one sequence.
pub fn window(s: &SynthKv, start: usize, n: usize) -> SynthKv {
    let cut = |x: &kvq_reference::KvTensor| {
        let mut out = kvq_reference::KvTensor::zeros(x.kv_heads, n, x.head_dim);
        for h in 0..x.kv_heads {
            for t in 0..n {
                out.row_mut(h, t).copy_from_slice(x.row(h, start + t));
            }
        }
        out
    };
    let mut o = s.clone();
    o.k_pre_rope = cut(&s.k_pre_rope);
    o.v = cut(&s.v);
    o.k = o.k_pre_rope.clone();
    for h in 0..o.k.kv_heads {
        for t in 0..n {
            s.rope.apply(o.k.row_mut(h, t), t);
        }
    }
    o.config.tokens = n;
    o
}
