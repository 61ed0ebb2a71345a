//! Decode attention: one query token per sequence, any number of query heads per KV head (GQA).
//!
//! Scores are `q·k / sqrt(head_dim)`. With calibration (CalibQuant), the scores of tokens whose keys
//! came from quantized pages are mapped by `g(x) = (δ−γ+τ1−τ2)/(δ−γ)·(x−γ) + γ−τ1`, where `[γ, δ]`
//! is the min/max of those same scores for that query head; FP16 tokens keep their scores. Dot
//! products and the softmax run in f64, so this is also the "exact" reference when fed unquantized K/V.

use crate::{Dequantized, KvTensor, RefError};
use kvq_spec::Calibration;

/// Query heads `[q_heads][head_dim]` for one sequence's decode step.
#[derive(Debug, Clone, PartialEq)]
pub struct Queries {
    pub data: Vec<f32>,
    pub q_heads: usize,
    pub head_dim: usize,
}

impl Queries {
    pub fn head(&self, h: usize) -> &[f32] {
        &self.data[h * self.head_dim..(h + 1) * self.head_dim]
    }
}

fn check(q: &Queries, k: &KvTensor, v: &KvTensor) -> Result<usize, RefError> {
    if k.kv_heads != v.kv_heads || k.tokens != v.tokens || k.head_dim != v.head_dim {
        return Err(RefError::Mismatch("K and V shapes differ".into()));
    }
    if q.head_dim != k.head_dim || q.data.len() != q.q_heads * q.head_dim {
        return Err(RefError::Mismatch(format!(
            "queries [{} x {}] against head_dim {}",
            q.q_heads, q.head_dim, k.head_dim
        )));
    }
    if k.kv_heads == 0 || q.q_heads % k.kv_heads != 0 {
        return Err(RefError::Mismatch(format!(
            "{} query heads are not a multiple of {} KV heads",
            q.q_heads, k.kv_heads
        )));
    }
    if k.tokens == 0 {
        return Err(RefError::Mismatch(
            "attention over an empty sequence".into(),
        ));
    }
    Ok(q.q_heads / k.kv_heads)
}

/// The calibration map of CalibQuant for a score range `[lo, hi]`.
pub fn calibrate_score(c: &Calibration, x: f64, lo: f64, hi: f64) -> f64 {
    let (t1, t2) = (c.tau1 as f64, c.tau2 as f64);
    if hi - lo <= f64::EPSILON {
        return x - t1;
    }
    (hi - lo + t1 - t2) / (hi - lo) * (x - lo) + lo - t1
}

/// Scaled scores `q·k / sqrt(head_dim)` of one query head against tokens `[0, row.len())` of KV
/// head `kv`, into `row`, calibrated where asked: the range is that of the quantized tokens among
/// them (what a query that sees only these tokens can know).
pub(crate) fn scores_into(
    qh: &[f32],
    k: &KvTensor,
    kv: usize,
    k_quantized: &[bool],
    calibrate: Option<&Calibration>,
    row: &mut [f64],
) {
    let scale = 1.0 / (k.head_dim as f64).sqrt();
    for (t, s) in row.iter_mut().enumerate() {
        let kt = k.row(kv, t);
        *s = qh
            .iter()
            .zip(kt)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum::<f64>()
            * scale;
    }
    if let Some(c) = calibrate {
        let quantized = || {
            row.iter()
                .zip(k_quantized)
                .filter(|(_, q)| **q)
                .map(|(s, _)| *s)
        };
        let lo = quantized().fold(f64::INFINITY, f64::min);
        let hi = quantized().fold(f64::NEG_INFINITY, f64::max);
        if lo.is_finite() {
            for (s, _) in row.iter_mut().zip(k_quantized).filter(|(_, q)| **q) {
                *s = calibrate_score(c, *s, lo, hi);
            }
        }
    }
}

/// Scores into probabilities in place; returns (max, Σ exp(s − max)) of the scores.
pub(crate) fn softmax_in_place(row: &mut [f64]) -> (f64, f64) {
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = row
        .iter_mut()
        .map(|s| {
            *s = (*s - m).exp();
            *s
        })
        .sum();
    row.iter_mut().for_each(|s| *s /= sum);
    (m, sum)
}

/// Softmax probabilities `[q_heads][tokens]` (f64), calibrated where asked.
pub fn probabilities(
    q: &Queries,
    k: &KvTensor,
    k_quantized: &[bool],
    calibrate: Option<&Calibration>,
) -> Result<Vec<f64>, RefError> {
    let group = check(q, k, k)?;
    if k_quantized.len() != k.tokens {
        return Err(RefError::Mismatch(
            "k_quantized length differs from tokens".into(),
        ));
    }
    let mut probs = vec![0.0f64; q.q_heads * k.tokens];
    for h in 0..q.q_heads {
        let row = &mut probs[h * k.tokens..(h + 1) * k.tokens];
        scores_into(q.head(h), k, h / group, k_quantized, calibrate, row);
        softmax_in_place(row);
    }
    Ok(probs)
}

/// Attention output `[q_heads][head_dim]` for given probabilities and values.
pub fn weighted_values(probs: &[f64], q_heads: usize, v: &KvTensor) -> Vec<f32> {
    let group = q_heads / v.kv_heads;
    let mut out = vec![0.0f32; q_heads * v.head_dim];
    for h in 0..q_heads {
        let mut acc = vec![0.0f64; v.head_dim];
        for t in 0..v.tokens {
            let p = probs[h * v.tokens + t];
            for (a, x) in acc.iter_mut().zip(v.row(h / group, t)) {
                *a += p * *x as f64;
            }
        }
        for (o, a) in out[h * v.head_dim..(h + 1) * v.head_dim]
            .iter_mut()
            .zip(acc)
        {
            *o = a as f32;
        }
    }
    out
}

/// Decode attention over a dequantized cache.
pub fn decode(
    q: &Queries,
    kv: &Dequantized,
    calibrate: Option<&Calibration>,
) -> Result<Vec<f32>, RefError> {
    check(q, &kv.k, &kv.v)?;
    let probs = probabilities(q, &kv.k, &kv.k_quantized, calibrate)?;
    Ok(weighted_values(&probs, q.q_heads, &kv.v))
}

/// Exact attention over unquantized K/V (f64 accumulation): the ground truth of error tables.
pub fn exact(q: &Queries, k: &KvTensor, v: &KvTensor) -> Result<Vec<f32>, RefError> {
    check(q, k, v)?;
    let probs = probabilities(q, k, &vec![false; k.tokens], None)?;
    Ok(weighted_values(&probs, q.q_heads, v))
}

/// ‖a − b‖ / ‖b‖ (f64).
pub fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// Mean squared difference of two equally long sequences.
pub fn mse<A: Copy + Into<f64>, B: Copy + Into<f64>>(a: &[A], b: &[B]) -> f64 {
    let n = a.len().max(1) as f64;
    a.iter()
        .zip(b)
        .map(|(x, y)| ((*x).into() - (*y).into()).powi(2))
        .sum::<f64>()
        / n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibration_maps_range_ends() {
        let c = Calibration {
            tau1: 0.5,
            tau2: 0.2,
        };
        assert!((calibrate_score(&c, 1.0, 1.0, 3.0) - 0.5).abs() < 1e-12);
        assert!((calibrate_score(&c, 3.0, 1.0, 3.0) - 2.8).abs() < 1e-6);
    }

    #[test]
    fn single_token_attention_returns_its_value() {
        let q = Queries {
            data: vec![1.0, 2.0, 0.5, -1.0],
            q_heads: 2,
            head_dim: 2,
        };
        let k = KvTensor::new(vec![0.3, 0.1], 1, 1, 2).unwrap();
        let v = KvTensor::new(vec![4.0, -2.0], 1, 1, 2).unwrap();
        assert_eq!(exact(&q, &k, &v).unwrap(), vec![4.0, -2.0, 4.0, -2.0]);
    }

    #[test]
    fn gqa_heads_share_kv_and_mismatch_is_an_error() {
        let q = Queries {
            data: vec![1.0; 6],
            q_heads: 3,
            head_dim: 2,
        };
        let k = KvTensor::new(vec![0.3, 0.1, 0.2, 0.2], 2, 1, 2).unwrap();
        assert!(matches!(exact(&q, &k, &k), Err(RefError::Mismatch(_))));
    }
}
