//! The binary additive codebook (CommVQ's values): `v̂ = μ + w · (s·C) ⊙ σ` with a code `s ∈ {0,1}^rows`.
//!
//! - `σ` is a per-channel scale (mean |v − μ| over the calibration data, the paper's frozen "learnable
//!   scale"), so channels of very different magnitude share one codebook fairly.
//! - `μ` is the calibration mean, an addition to the paper: without it the code must spend rows on the
//!   offset every token shares (massive activations), and what it misses is a bias that attention's
//!   weighted sum does not average away. It costs one vector per codebook and `Σ_t p_t μ = μ` in attention.
//! - A vector `u = (v − μ) ⊘ σ` is encoded by its direction `u/‖u‖`; `w = ‖u‖ / ‖s·C‖` (one f16 per
//!   vector) restores its norm, as the paper's pre/post-scale pair does, folded into one factor.
//! - Rows come in pairs `(2j, 2j+1)` whose two bits take all four values: the paper's 4-way choice per
//!   2-bit group. The encoder is iterated conditional modes over those groups (a greedy pass from the
//!   zero code, then passes until nothing changes), a deterministic stand-in for the paper's learned MLP
//!   encoder, which needs end-to-end training with the model.
//!
//! A vector spans one KV head (`span = head`, one codebook per KV head) or all KV heads of a token
//! (`span = token`, one codebook over the concatenation).

use super::key::dot;
use crate::RefError;
use kvq_spec::CodebookSpan;

/// Trained binary additive codebook of one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct AdditiveCodebook {
    pub span: CodebookSpan,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Bits of a code (rows of `C`).
    pub rows: usize,
    /// `[book][row][dim]`, f16-exact.
    pub table: Vec<f32>,
    /// `[book][dim]` per-channel scale `σ`, f16-exact and positive.
    pub channel_scale: Vec<f32>,
    /// `[book][dim]` calibration mean `μ`, f16-exact.
    pub mean: Vec<f32>,
}

impl AdditiveCodebook {
    /// Codebooks: one per KV head for `span = head`, one for `span = token`.
    pub fn books(&self) -> usize {
        books(self.span, self.kv_heads)
    }

    /// Scalars of one vector.
    pub fn dim(&self) -> usize {
        dim(self.span, self.kv_heads, self.head_dim)
    }

    /// Rows of book `b` (`[row][dim]`).
    pub(crate) fn book(&self, b: usize) -> &[f32] {
        let n = self.rows * self.dim();
        &self.table[b * n..(b + 1) * n]
    }

    pub(crate) fn scale(&self, b: usize) -> &[f32] {
        &self.channel_scale[b * self.dim()..(b + 1) * self.dim()]
    }

    pub(crate) fn mean(&self, b: usize) -> &[f32] {
        &self.mean[b * self.dim()..(b + 1) * self.dim()]
    }

    pub(crate) fn check(
        &self,
        span: CodebookSpan,
        rows: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<(), RefError> {
        if self.span != span
            || self.rows != rows
            || self.kv_heads != kv_heads
            || self.head_dim != head_dim
        {
            return Err(RefError::Mismatch(format!(
                "additive codebook ({:?} span, {} rows, {} KV heads of {}) does not match the scheme and cache \
                 ({span:?} span, {rows} rows, {kv_heads} KV heads of {head_dim})",
                self.span, self.rows, self.kv_heads, self.head_dim
            )));
        }
        let (b, d) = (self.books(), self.dim());
        if self.table.len() != b * rows * d
            || self.channel_scale.len() != b * d
            || self.mean.len() != b * d
        {
            return Err(RefError::Mismatch(
                "additive codebook tensors have the wrong length".into(),
            ));
        }
        if self.table.iter().chain(&self.mean).any(|x| !x.is_finite())
            || self
                .channel_scale
                .iter()
                .any(|x| !(x.is_finite() && *x > 0.0))
        {
            return Err(RefError::Mismatch(
                "additive codebook holds a non-finite entry or a non-positive channel scale".into(),
            ));
        }
        Ok(())
    }
}

pub(crate) fn books(span: CodebookSpan, kv_heads: usize) -> usize {
    match span {
        CodebookSpan::Head => kv_heads,
        CodebookSpan::Token => 1,
    }
}

pub(crate) fn dim(span: CodebookSpan, kv_heads: usize, head_dim: usize) -> usize {
    match span {
        CodebookSpan::Head => head_dim,
        CodebookSpan::Token => kv_heads * head_dim,
    }
}

/// Precomputed row norms and in-pair cross products of one book, for the encoder.
pub(crate) struct BookEncoder {
    pub rows: Vec<f64>,
    pub norm: Vec<f64>,
    pub pair_cross: Vec<f64>,
    dim: usize,
}

impl BookEncoder {
    pub fn new(book: &[f64], rows: usize, dim: usize) -> Self {
        let row = |j: usize| &book[j * dim..(j + 1) * dim];
        Self {
            norm: (0..rows).map(|j| dot(row(j), row(j))).collect(),
            pair_cross: (0..rows / 2)
                .map(|j| dot(row(2 * j), row(2 * j + 1)))
                .collect(),
            rows: book.to_vec(),
            dim,
        }
    }

    fn row(&self, j: usize) -> &[f64] {
        &self.rows[j * self.dim..(j + 1) * self.dim]
    }

    /// Improves `code` (one bool per row) for `target` by at most `sweeps` passes over the 2-bit groups;
    /// returns the squared error `‖target − s·C‖²`.
    pub fn encode(&self, target: &[f64], code: &mut [bool], sweeps: usize) -> f64 {
        let mut r = target.to_vec();
        for (j, on) in code.iter().enumerate() {
            if *on {
                sub(self.row(j), &mut r);
            }
        }
        for _ in 0..sweeps {
            let mut changed = false;
            for grp in 0..code.len() / 2 {
                let (a, b) = (2 * grp, 2 * grp + 1);
                let (sa, sb) = (code[a] as u8 as f64, code[b] as u8 as f64);
                let q = self.pair_cross[grp];
                // Projections of the residual with this group's own contribution put back.
                let da = dot(&r, self.row(a)) + sa * self.norm[a] + sb * q;
                let db = dot(&r, self.row(b)) + sb * self.norm[b] + sa * q;
                let cost = |oa: f64, ob: f64| {
                    -2.0 * (oa * da + ob * db)
                        + oa * self.norm[a]
                        + ob * self.norm[b]
                        + 2.0 * oa * ob * q
                };
                let mut best = (0.0, (false, false));
                for (oa, ob) in [(true, false), (false, true), (true, true)] {
                    let c = cost(oa as u8 as f64, ob as u8 as f64);
                    if c < best.0 {
                        best = (c, (oa, ob));
                    }
                }
                let (oa, ob) = best.1;
                if (oa, ob) != (code[a], code[b]) {
                    changed = true;
                    for (j, old, new) in [(a, code[a], oa), (b, code[b], ob)] {
                        match (old, new) {
                            (true, false) => add(self.row(j), &mut r),
                            (false, true) => sub(self.row(j), &mut r),
                            _ => {}
                        }
                    }
                    code[a] = oa;
                    code[b] = ob;
                }
            }
            if !changed {
                break;
            }
        }
        r.iter().map(|x| x * x).sum()
    }

    /// `s·C`.
    pub fn decode(&self, code: &[bool]) -> Vec<f64> {
        let mut out = vec![0.0; self.dim];
        for (j, on) in code.iter().enumerate() {
            if *on {
                add(self.row(j), &mut out);
            }
        }
        out
    }
}

fn add(x: &[f64], y: &mut [f64]) {
    y.iter_mut().zip(x).for_each(|(a, b)| *a += b);
}

fn sub(x: &[f64], y: &mut [f64]) {
    y.iter_mut().zip(x).for_each(|(a, b)| *a -= b);
}

/// Passes of the encoder when filling a cache (training uses fewer, warm-started).
pub(crate) const ENCODE_SWEEPS: usize = 6;

/// `(v − μ) ⊘ σ`.
pub(crate) fn normalise(v: &[f32], mean: &[f32], scale: &[f32]) -> Vec<f64> {
    v.iter()
        .zip(mean)
        .zip(scale)
        .map(|((x, m), s)| (*x as f64 - *m as f64) / *s as f64)
        .collect()
}

/// Encodes one vector `v` (`dim` values) with book `b`: its code and its f16 factor `w`.
pub(crate) fn encode_vector(
    enc: &BookEncoder,
    cb: &AdditiveCodebook,
    b: usize,
    v: &[f32],
) -> (Vec<bool>, f32) {
    let rows = cb.rows;
    let u = normalise(v, cb.mean(b), cb.scale(b));
    let norm = u.iter().map(|x| x * x).sum::<f64>().sqrt();
    let mut code = vec![false; rows];
    if norm == 0.0 {
        return (code, 0.0);
    }
    let target: Vec<f64> = u.iter().map(|x| x / norm).collect();
    enc.encode(&target, &mut code, ENCODE_SWEEPS);
    let decoded = enc.decode(&code);
    let dn = decoded.iter().map(|x| x * x).sum::<f64>().sqrt();
    let w = if dn > 0.0 { norm / dn } else { 0.0 };
    (code, super::f16_of_f64(w).to_f32())
}
