//! A stack of synthetic layers for XQuant-CL's GPU tests: each layer's synthetic weights and
//! input (`kvq_reference::synth`), its projections (the reference's SVD) and its input rounded to
//! the layer input's 16-bit format, as the tests hand it to the device.

use kvq_codegen::Dtype;
use kvq_reference::synth::{generate, SynthConfig, SynthKv};
use kvq_reference::xquant::Projections;

use crate::tune::synth::round_to_word;

/// Layers of one shape, layer `l` generated from `cfg` with seed `cfg.seed + l`.
pub struct LayerStack {
    pub layers: Vec<SynthKv>,
    pub projections: Vec<Projections>,
    /// Each layer's input `[tokens][d_model]` as X-format words.
    pub x: Vec<Vec<u16>>,
}

impl LayerStack {
    /// `depth` layers of `cfg`'s shape with X in `dtype`; panics (a test helper) where the
    /// reference refuses the shape.
    pub fn new(depth: usize, cfg: &SynthConfig, dtype: Dtype) -> Self {
        let layers: Vec<SynthKv> = (0..depth as u64)
            .map(|l| {
                generate(&SynthConfig {
                    seed: cfg.seed.wrapping_add(l),
                    ..*cfg
                })
            })
            .collect();
        let (dm, h, d) = (cfg.d_model, cfg.kv_heads, cfg.head_dim);
        let projections = layers
            .iter()
            .map(|l| {
                Projections::from_weights(&l.layer.w_k, &l.layer.w_v, dm, h, d)
                    .expect("projections of the synthetic layer")
            })
            .collect();
        let x = layers
            .iter()
            .map(|l| {
                l.layer
                    .x
                    .iter()
                    .map(|&v| round_to_word(v, dtype).0)
                    .collect()
            })
            .collect();
        Self {
            layers,
            projections,
            x,
        }
    }
}
