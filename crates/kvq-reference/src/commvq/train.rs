//! Offline training of a scheme's codebooks from calibration K/V (the paper trains per layer on
//! activations collected from a calibration corpus; here: any `KvTensor`s, e.g. a synthetic layer).

use super::additive::{self, AdditiveCodebook};
use super::additive_train::{train_book, AdditiveSchedule};
use super::key::KeyCodebook;
use super::key_em::{train_group, EmSchedule};
use super::{pairs, vectors};
use crate::par;
use crate::rope::Rope;
use crate::{KvTensor, RefError};
use kvq_spec::{Codebook, CodebookSpan, SchemeSpec, TensorQuant};

/// A trained codebook of one tensor.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorCodebook {
    RopeCommutative(KeyCodebook),
    Additive(AdditiveCodebook),
}

/// The codebooks of one layer: `None` for an FP16 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Codebooks {
    pub k: Option<TensorCodebook>,
    pub v: Option<TensorCodebook>,
}

/// Calibration activations of one layer.
#[derive(Debug, Clone, Copy)]
pub struct CalibrationData<'a> {
    /// Keys before RoPE (what a RoPE-commutative codebook encodes).
    pub k_pre_rope: &'a KvTensor,
    pub v: &'a KvTensor,
    /// Applied to the keys only when they use an additive codebook (which encodes post-RoPE keys).
    pub rope: Rope,
}

/// Training knobs; [`TrainOptions::seeded`] gives the defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainOptions {
    pub seed: u64,
    pub em: EmSchedule,
    pub additive: AdditiveSchedule,
    /// Worker threads (0 = all cores); results do not depend on it.
    pub threads: usize,
}

impl TrainOptions {
    pub fn seeded(seed: u64) -> Self {
        Self {
            seed,
            em: EmSchedule::default(),
            additive: AdditiveSchedule::default(),
            threads: 0,
        }
    }

    /// Two EM steps a round and two additive iterations: codebooks in seconds, for work whose
    /// result does not depend on their quality (timing kernels, checking a kernel or a file
    /// against the reference on the same codebooks).
    pub fn quick(seed: u64) -> Self {
        Self {
            em: EmSchedule {
                steps: 2,
                ..EmSchedule::default()
            },
            additive: AdditiveSchedule {
                iterations: 2,
                ..AdditiveSchedule::default()
            },
            ..Self::seeded(seed)
        }
    }
}

/// Trains the codebooks `spec` needs with default options.
pub fn train(
    spec: &SchemeSpec,
    data: &CalibrationData<'_>,
    seed: u64,
) -> Result<Codebooks, RefError> {
    train_with(spec, data, &TrainOptions::seeded(seed))
}

/// Trains the codebooks `spec` needs; deterministic for a given `options.seed`.
pub fn train_with(
    spec: &SchemeSpec,
    data: &CalibrationData<'_>,
    options: &TrainOptions,
) -> Result<Codebooks, RefError> {
    let (k, v) = (data.k_pre_rope, data.v);
    super::check_inputs(spec, k, v)?;
    let k = match spec.k {
        TensorQuant::Codebook(c) => Some(match c.codebook {
            Codebook::RopeCommutative {
                levels,
                residuals,
                pairs_per_code,
            } => TensorCodebook::RopeCommutative(train_key(
                k,
                c.span,
                (levels as usize, residuals as usize, pairs_per_code as usize),
                options,
            )?),
            Codebook::Additive { rows } => {
                let post = super::post_rope(k, data.rope);
                TensorCodebook::Additive(train_additive(&post, c.span, rows as usize, options, 1)?)
            }
        }),
        _ => None,
    };
    let v = match spec.v {
        TensorQuant::Codebook(c) => match c.codebook {
            Codebook::Additive { rows } => Some(TensorCodebook::Additive(train_additive(
                v,
                c.span,
                rows as usize,
                options,
                2,
            )?)),
            Codebook::RopeCommutative { .. } => {
                return Err(RefError::WrongEntryPoint(
                    "a RoPE-commutative codebook is for keys; values use an additive codebook"
                        .into(),
                ))
            }
        },
        _ => None,
    };
    Ok(Codebooks { k, v })
}

/// A distinct, well-mixed seed per job (SplitMix64 finaliser).
fn job_seed(seed: u64, tensor: u64, job: u64) -> u64 {
    let mut z =
        seed ^ tensor.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ job.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn train_key(
    k: &KvTensor,
    span: CodebookSpan,
    (levels, residuals, g): (usize, usize, usize),
    options: &TrainOptions,
) -> Result<KeyCodebook, RefError> {
    let mut cb = KeyCodebook::zeros(k.kv_heads, k.head_dim, levels, residuals, g);
    let groups = cb.groups();
    let scales = vectors::key_scales(k, span)?;
    let jobs = k.kv_heads * groups;
    let results = par::map(jobs, options.threads, |job| {
        let (h, group) = (job / groups, job % groups);
        let mut data = Vec::with_capacity(k.tokens * 2 * g);
        for t in 0..k.tokens {
            let s = scales[vectors::key_scale_index(span, k.kv_heads, k.tokens, h, t)];
            let inv = if s > 0.0 { 1.0 / s as f64 } else { 0.0 };
            data.extend(pairs::gather(k.row(h, t), g, group, inv));
        }
        train_group(
            &data,
            2 * g,
            levels,
            residuals,
            &options.em,
            job_seed(options.seed, 1, job as u64),
        )
    })?;
    for (job, rounds) in results.into_iter().enumerate() {
        let (h, group) = (job / groups, job % groups);
        for (r, table) in rounds?.into_iter().enumerate() {
            cb.table_mut(h, group, r).copy_from_slice(&table);
        }
    }
    Ok(cb)
}

fn train_additive(
    x: &KvTensor,
    span: CodebookSpan,
    rows: usize,
    options: &TrainOptions,
    tensor: u64,
) -> Result<AdditiveCodebook, RefError> {
    let books = additive::books(span, x.kv_heads);
    let dim = additive::dim(span, x.kv_heads, x.head_dim);
    // Per book: the mean μ, then the scale σ = mean |v − μ|, both f16-exact.
    let (mut mean, mut scale) = (vec![0.0f32; books * dim], vec![0.0f32; books * dim]);
    let n = x.tokens as f64;
    for b in 0..books {
        let mut m = vec![0.0f64; dim];
        for t in 0..x.tokens {
            for (acc, v) in m.iter_mut().zip(vectors::additive_vector(x, span, b, t)) {
                *acc += v as f64 / n;
            }
        }
        for (dst, v) in mean[b * dim..(b + 1) * dim].iter_mut().zip(&m) {
            *dst = super::f16_of_f64(*v).to_f32();
        }
        let mut s = vec![0.0f64; dim];
        for t in 0..x.tokens {
            let v = vectors::additive_vector(x, span, b, t);
            for ((acc, v), mu) in s.iter_mut().zip(v).zip(&mean[b * dim..(b + 1) * dim]) {
                *acc += (v - mu).abs() as f64 / n;
            }
        }
        for (dst, v) in scale[b * dim..(b + 1) * dim].iter_mut().zip(&s) {
            let h = super::f16_of_f64(*v);
            *dst = if h.to_f32() > 0.0 && h.is_finite() {
                h.to_f32()
            } else {
                1.0
            };
        }
    }
    let tables = par::map(books, options.threads, |b| {
        let (mu, s) = (
            &mean[b * dim..(b + 1) * dim],
            &scale[b * dim..(b + 1) * dim],
        );
        let mut targets = Vec::with_capacity(x.tokens * dim);
        for t in 0..x.tokens {
            let u = additive::normalise(&vectors::additive_vector(x, span, b, t), mu, s);
            let norm = u.iter().map(|a| a * a).sum::<f64>().sqrt();
            if norm > 0.0 {
                targets.extend(u.iter().map(|a| a / norm));
            }
        }
        train_book(
            &targets,
            dim,
            rows,
            &options.additive,
            job_seed(options.seed, tensor, b as u64),
        )
    })?;
    let mut table = Vec::with_capacity(books * rows * dim);
    for t in tables {
        table.extend(t?);
    }
    Ok(AdditiveCodebook {
        span,
        kv_heads: x.kv_heads,
        head_dim: x.head_dim,
        rows,
        table,
        channel_scale: scale,
        mean,
    })
}
