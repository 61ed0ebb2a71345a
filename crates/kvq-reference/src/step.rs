//! A step of several query tokens a sequence (speculative-decoding verification, chunked
//! prefill), causal, with the log-sum-exp of every query row, and the merge of partial results
//! computed over parts of a sequence's tokens (context parallelism).
//!
//! The step's `q_len` query tokens are the last `q_len` tokens of the cache (their K/V are written
//! before the step): query token `i` sees tokens `[0, tokens − q_len + i + 1)`. The LSE of a row is
//! `ln Σ exp(s)` over the scores it sees, `s = q·k / sqrt(head_dim)` (calibrated where the scheme
//! asks), the convention of FlashAttention and vLLM. A row's attention state over any subset of
//! its tokens is `(O, LSE)` with `O` the softmax-weighted values of that subset; [`merge`] combines
//! the states of disjoint subsets into the state over their union. With calibration, every part
//! is scored with the range of all the quantized tokens the row sees, so merged parts equal the
//! whole (an engine splitting a calibrated sequence must reduce that range across parts first).
//!
//! ```
//! use kvq_reference::{step, synth, Dequantized};
//! let s = synth::generate(&synth::SynthConfig { tokens: 300, head_dim: 64, ..Default::default() });
//! let kv = Dequantized { k: s.k.clone(), v: s.v.clone(), k_quantized: vec![false; 300] };
//! let q = step::StepQueries::repeat(&s.q, 3); // 3 query tokens, each with s.q's heads
//! let whole = step::attend(&q, &kv, None).unwrap();
//! let a = step::attend_part(&q, &kv, None, 0..120).unwrap();
//! let b = step::attend_part(&q, &kv, None, 120..300).unwrap();
//! let merged = step::merge(&[a, b]).unwrap();
//! assert!(kvq_reference::attention::relative_error(&merged.out, &whole.out) < 1e-6);
//! ```

use crate::attention::{scores_into, Queries};
use crate::{Dequantized, RefError};
use kvq_spec::Calibration;
use std::ops::Range;

/// Query tokens of one sequence's step, `[q_len][q_heads][head_dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct StepQueries {
    pub data: Vec<f32>,
    pub q_len: usize,
    pub q_heads: usize,
    pub head_dim: usize,
}

impl StepQueries {
    /// One query token's heads `[q_heads][head_dim]`.
    pub fn token(&self, i: usize) -> &[f32] {
        let n = self.q_heads * self.head_dim;
        &self.data[i * n..(i + 1) * n]
    }

    /// Query token `i`, head `h`.
    pub fn row(&self, i: usize, h: usize) -> &[f32] {
        &self.token(i)[h * self.head_dim..(h + 1) * self.head_dim]
    }

    /// One decode step's queries as a step of one token.
    pub fn single(q: &Queries) -> StepQueries {
        StepQueries {
            data: q.data.clone(),
            q_len: 1,
            q_heads: q.q_heads,
            head_dim: q.head_dim,
        }
    }

    /// `q_len` tokens, token `i` being `q`'s heads scaled by `1 + i/8` (distinct rows for tests
    /// and examples).
    pub fn repeat(q: &Queries, q_len: usize) -> StepQueries {
        let mut data = Vec::with_capacity(q_len * q.data.len());
        for i in 0..q_len {
            let f = 1.0 + i as f32 / 8.0;
            data.extend(q.data.iter().map(|x| x * f));
        }
        StepQueries {
            data,
            q_len,
            q_heads: q.q_heads,
            head_dim: q.head_dim,
        }
    }
}

/// Attention state of a step: outputs `[q_len][q_heads][head_dim]` and LSEs `[q_len][q_heads]`
/// (`-inf` where a row saw no token: its output is then zeros).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionState {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    pub q_len: usize,
    pub q_heads: usize,
    pub head_dim: usize,
}

impl AttentionState {
    /// Output row of query token `i`, head `h`.
    pub fn out_row(&self, i: usize, h: usize) -> &[f32] {
        let at = (i * self.q_heads + h) * self.head_dim;
        &self.out[at..at + self.head_dim]
    }
}

fn check(q: &StepQueries, kv: &Dequantized) -> Result<usize, RefError> {
    let (k, v) = (&kv.k, &kv.v);
    if k.kv_heads != v.kv_heads || k.tokens != v.tokens || k.head_dim != v.head_dim {
        return Err(RefError::Mismatch("K and V shapes differ".into()));
    }
    if kv.k_quantized.len() != k.tokens {
        return Err(RefError::Mismatch(
            "k_quantized length differs from tokens".into(),
        ));
    }
    let group = check_heads(q, k)?;
    if q.q_len == 0 || q.q_len > k.tokens {
        return Err(RefError::Mismatch(format!(
            "a step of {} query tokens over a cache of {} tokens (the step's tokens are the \
             cache's last)",
            q.q_len, k.tokens
        )));
    }
    Ok(group)
}

/// Checks the queries' size against their shape and `k`'s head size and KV heads; returns the
/// query heads a KV head.
pub(crate) fn check_heads(q: &StepQueries, k: &crate::KvTensor) -> Result<usize, RefError> {
    if q.head_dim != k.head_dim || q.data.len() != q.q_len * q.q_heads * q.head_dim {
        return Err(RefError::Mismatch(format!(
            "queries [{} x {} x {}] ({} values) against head_dim {}",
            q.q_len,
            q.q_heads,
            q.head_dim,
            q.data.len(),
            k.head_dim
        )));
    }
    if k.kv_heads == 0 || q.q_heads == 0 || q.q_heads % k.kv_heads != 0 {
        return Err(RefError::Mismatch(format!(
            "{} query heads are not a positive multiple of {} KV heads",
            q.q_heads, k.kv_heads
        )));
    }
    Ok(q.q_heads / k.kv_heads)
}

/// The step's attention over the whole cache.
pub fn attend(
    q: &StepQueries,
    kv: &Dequantized,
    calibrate: Option<&Calibration>,
) -> Result<AttentionState, RefError> {
    attend_part(q, kv, calibrate, 0..kv.k.tokens)
}

/// The step's attention state over the cache tokens in `part` (each row over those of them it
/// sees), for merging with the other parts' states.
pub fn attend_part(
    q: &StepQueries,
    kv: &Dequantized,
    calibrate: Option<&Calibration>,
    part: Range<usize>,
) -> Result<AttentionState, RefError> {
    let group = check(q, kv)?;
    let (k, v) = (&kv.k, &kv.v);
    if part.start > part.end || part.end > k.tokens {
        return Err(RefError::Mismatch(format!(
            "part {part:?} of a cache of {} tokens",
            k.tokens
        )));
    }
    let d = k.head_dim;
    let mut state = AttentionState {
        out: vec![0.0; q.q_len * q.q_heads * d],
        lse: vec![f32::NEG_INFINITY; q.q_len * q.q_heads],
        q_len: q.q_len,
        q_heads: q.q_heads,
        head_dim: d,
    };
    let mut scores = vec![0.0f64; k.tokens];
    for i in 0..q.q_len {
        let visible = k.tokens - q.q_len + i + 1;
        let (lo, hi) = (part.start.min(visible), part.end.min(visible));
        if lo == hi {
            continue;
        }
        for h in 0..q.q_heads {
            let kvh = h / group;
            let row = &mut scores[..visible];
            scores_into(q.row(i, h), k, kvh, &kv.k_quantized, calibrate, row);
            let seen = &mut row[lo..hi];
            let (m, sum) = crate::attention::softmax_in_place(seen);
            let mut acc = vec![0.0f64; d];
            for (t, p) in (lo..hi).zip(seen.iter()) {
                for (a, x) in acc.iter_mut().zip(v.row(kvh, t)) {
                    *a += p * *x as f64;
                }
            }
            let at = (i * q.q_heads + h) * d;
            for (o, a) in state.out[at..at + d].iter_mut().zip(acc) {
                *o = a as f32;
            }
            state.lse[i * q.q_heads + h] = (m + sum.ln()) as f32;
        }
    }
    Ok(state)
}

/// The state over the union of disjoint parts, from each part's state: per row, outputs weighted
/// by `exp(LSE_j − LSE)` with `LSE = ln Σ exp(LSE_j)`. Rows no part saw stay `-inf` and zeros.
pub fn merge(parts: &[AttentionState]) -> Result<AttentionState, RefError> {
    let first = parts
        .first()
        .ok_or_else(|| RefError::Mismatch("merge of no attention states".into()))?;
    let (q_len, q_heads, d) = (first.q_len, first.q_heads, first.head_dim);
    for p in parts {
        if (p.q_len, p.q_heads, p.head_dim) != (q_len, q_heads, d)
            || p.out.len() != q_len * q_heads * d
            || p.lse.len() != q_len * q_heads
        {
            return Err(RefError::Mismatch(format!(
                "merging a state of [{} x {} x {}] with one of [{q_len} x {q_heads} x {d}]",
                p.q_len, p.q_heads, p.head_dim
            )));
        }
    }
    let mut merged = AttentionState {
        out: vec![0.0; q_len * q_heads * d],
        lse: vec![f32::NEG_INFINITY; q_len * q_heads],
        q_len,
        q_heads,
        head_dim: d,
    };
    for r in 0..q_len * q_heads {
        let m = parts
            .iter()
            .map(|p| p.lse[r] as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            continue;
        }
        let weights: Vec<f64> = parts.iter().map(|p| (p.lse[r] as f64 - m).exp()).collect();
        let total: f64 = weights.iter().sum();
        for c in 0..d {
            let o: f64 = parts
                .iter()
                .zip(&weights)
                .map(|(p, w)| w * p.out[r * d + c] as f64)
                .sum();
            merged.out[r * d + c] = (o / total) as f32;
        }
        merged.lse[r] = (m + total.ln()) as f32;
    }
    Ok(merged)
}
