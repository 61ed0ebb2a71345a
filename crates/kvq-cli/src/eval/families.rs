//! `kvq eval` for the schemes that cache more than K and V's codes: CommVQ (pre-RoPE keys, and
//! codebooks trained on calibration tokens of the same layer) and XQuant (the layer input,
//! rematerialised through the layer's K and V projections). The capture becomes the evaluation
//! workload `kvq demo` builds from synthetic layers, so both report the same quantities.

use std::path::Path;

use kvq::evaluate::{self, Family, HeldOut, Workload};
use kvq::reference::rope::Rope;
use kvq::reference::synth::{SynthConfig, SynthKv, SynthLayer};
use kvq::reference::KvTensor;
use kvq::SchemeSpec;

use super::{input, Layer, LayerResult, LONG_CONTEXT};
use crate::error::{CliError, Result};

/// What a layer of the file holds beyond K, V and the queries (read when present).
#[derive(Debug, Clone, Default)]
pub struct Extra {
    /// Keys before RoPE, `[kv_heads][tokens][head_dim]` (`layer.{i}.k_pre_rope`).
    pub k_pre_rope: Option<KvTensor>,
    /// The layer input `[tokens][d_model]` (`layer.{i}.x`) and the previous layer's
    /// (`layer.{i}.x_prev`, cross-layer XQuant).
    pub x: Option<Vec<f32>>,
    pub x_prev: Option<Vec<f32>>,
    /// K and V projections `[d_model][kv_heads·head_dim]` (`layer.{i}.w_k`, `layer.{i}.w_v`).
    pub w_k: Option<Vec<f32>>,
    pub w_v: Option<Vec<f32>>,
    pub d_model: usize,
    /// Calibration tokens of the same layer: keys (`calib.{i}.k_pre_rope`, or `calib.{i}.k` after
    /// RoPE: `true`) and values (`calib.{i}.v`).
    pub calib_k: Option<(KvTensor, bool)>,
    pub calib_v: Option<KvTensor>,
}

/// Keys back before RoPE: token `t` rotated back from position `t`.
pub fn unrotate(k: &KvTensor, rope: Rope) -> KvTensor {
    let mut out = k.clone();
    for h in 0..k.kv_heads {
        for t in 0..k.tokens {
            rope.unapply(out.row_mut(h, t), t);
        }
    }
    out
}

fn needs(path: &Path, layer: usize, scheme: &str, what: &str) -> CliError {
    input(
        path,
        format!("layer {layer}: `{scheme}` needs {what} (docs/CLI.md, `kvq eval`)"),
    )
}

/// Evaluates a CommVQ or XQuant scheme on one layer of the capture.
pub fn evaluate_layer(
    spec: &SchemeSpec,
    label: &str,
    family: Family,
    layer: &Layer,
    rope_theta: Option<f64>,
    path: &Path,
) -> Result<LayerResult> {
    let i = layer.index;
    let (h, n, d) = (layer.k.kv_heads, layer.k.tokens, layer.k.head_dim);
    // A capture made for every decode step serves these schemes at its last step.
    let note = layer.steps.as_ref().map(|_| {
        format!(
            "layer {i}: `{label}` is evaluated at the last token's queries (every decode step: \
             integer and FP16 schemes)"
        )
    });
    let theta = rope_theta.ok_or_else(|| {
        needs(
            path,
            i,
            label,
            "the model's RoPE base, --rope-theta (it applies RoPE itself)",
        )
    })?;
    let rope = Rope { theta };
    let e = &layer.extra;
    // CommVQ reads no layer input: its workload's stays empty.
    let mut calibration = None;
    let (mut x, mut x_prev, mut w_k, mut w_v, mut d_model) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0);
    match family {
        Family::CommVq => {
            let (Some((k, rotated)), Some(v)) = (&e.calib_k, &e.calib_v) else {
                return Err(needs(
                    path,
                    i,
                    label,
                    &format!(
                        "calibration tokens of the same layer to train its codebooks: \
                         `calib.{i}.v` with `calib.{i}.k_pre_rope` (or `calib.{i}.k` after RoPE)"
                    ),
                ));
            };
            calibration = Some(HeldOut {
                k_pre_rope: if *rotated {
                    unrotate(k, rope)
                } else {
                    k.clone()
                },
                v: v.clone(),
            });
        }
        Family::XQuant | Family::XQuantCrossLayer => {
            let missing =
                |t: &str, what: &str| needs(path, i, label, &format!("`layer.{i}.{t}` ({what})"));
            let proj = "[d_model, kv_heads·head_dim]";
            x =
                e.x.clone()
                    .ok_or_else(|| missing("x", "[tokens, d_model], the layer input"))?;
            w_k = e.w_k.clone().ok_or_else(|| missing("w_k", proj))?;
            w_v = e.w_v.clone().ok_or_else(|| missing("w_v", proj))?;
            if family == Family::XQuantCrossLayer {
                x_prev = e
                    .x_prev
                    .clone()
                    .ok_or_else(|| missing("x_prev", "the previous layer's input"))?;
            }
            d_model = e.d_model;
        }
        Family::Int => {
            return Err(CliError::Usage(
                "integer schemes are evaluated by eval::evaluate_layer".into(),
            ))
        }
    }
    let k_pre_rope = match &e.k_pre_rope {
        Some(k) => k.clone(),
        None => unrotate(&layer.k, rope),
    };
    let data = SynthKv {
        config: SynthConfig {
            tokens: n,
            kv_heads: h,
            gqa: layer.q.q_heads / h,
            head_dim: d,
            d_model,
            outlier_pairs: 0,
            sink_tokens: 0,
            ..SynthConfig::default()
        },
        k_pre_rope,
        k: layer.k.clone(),
        v: layer.v.clone(),
        q: layer.q.clone(),
        rope,
        layer: SynthLayer {
            x,
            x_prev,
            w_k,
            w_v,
            d_model,
        },
    };
    let w = match calibration {
        Some(held) => Workload::with_calibration(data, held)?,
        None => Workload::new(data)?,
    };
    let ev = evaluate::evaluate(spec, &w)?;
    let rank = match family {
        Family::XQuant | Family::XQuantCrossLayer => w.projections()?.k.rank,
        _ => h * d,
    };
    let long = evaluate::memory_with_rank(spec, d as u32, h as u32, rank, LONG_CONTEXT)?;
    Ok(LayerResult {
        index: i,
        tokens: n,
        quantized_tokens: ev.quantized_tokens,
        kv_heads: h,
        q_heads: layer.q.q_heads,
        head_dim: d,
        captured_queries: layer.captured_queries,
        steps: 1,
        worst_step_error: ev.output_error,
        attn_error: ev.output_error,
        gpu_error: None,
        heads: Vec::new(),
        k_rel_mse: ev.k_rel_mse,
        v_rel_mse: ev.v_rel_mse,
        bits_per_element: ev.memory.bits_per_element(),
        bits_per_element_long: long.bits_per_element(),
        gpu_note: note,
    })
}
