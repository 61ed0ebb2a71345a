//! Attention straight from the codes, the way a CommVQ kernel computes it (and the proof, in tests,
//! that it equals attention over the dequantized K̂/V̂).
//!
//! Keys: `q·RoPE_t(k̂) = s · Σ_pairs Re(e^{iθt} · Σ_rounds (P_a + i·P_b))` with `P_k = conj(q_pair)·c_k`
//! computed once per query for every codebook entry — RoPE is applied to a scalar per pair, never to a
//! decoded key. Values: `Σ_t p_t w_t (s_t·C) ⊙ σ = ((Σ_t p_t w_t s_t)·C) ⊙ σ`: the softmax weights are
//! summed into one vector over the code rows, then multiplied by the codebook once.

use super::additive::AdditiveCodebook;
use super::cache::{
    additive_bit, additive_factor, rope_code, rope_scale, Coding, CommVqCache, Stored,
};
use super::key::KeyCodebook;
use crate::attention::{calibrate_score, Queries};
use crate::RefError;
use kvq_spec::CodebookSpan;

impl CommVqCache {
    fn check_queries(&self, q: &Queries) -> Result<usize, RefError> {
        super::check_queries(q, self.kv_heads, self.head_dim, self.tokens)
    }

    /// Pre-softmax scores `q·k̂/√D` `[q_heads][tokens]`, computed from the codes without decoding keys.
    pub fn scores(&self, q: &Queries) -> Result<Vec<f64>, RefError> {
        let group = self.check_queries(q)?;
        let (d, len) = (self.head_dim, self.tokens);
        let inv_sqrt_d = 1.0 / (d as f64).sqrt();
        let mut out = vec![0.0; q.q_heads * len];
        for qh in 0..q.q_heads {
            let head = qh / group;
            let qv = q.head(qh);
            let row = &mut out[qh * len..(qh + 1) * len];
            for tok in self.k.regions.sink().chain(self.k.regions.tail()) {
                let k = self.k.fp16_row(head, tok, d);
                row[tok] = dot32(qv, &k) * inv_sqrt_d;
            }
            match &self.k.coding {
                Coding::Fp16 => {}
                Coding::Rope { codebook, span } => self.rope_scores(codebook, *span, qv, head, row),
                Coding::Additive(cb) => additive_scores(&self.k, cb, qv, head, row),
            }
            for tok in self.k.regions.quantized() {
                row[tok] *= inv_sqrt_d;
            }
        }
        Ok(out)
    }

    fn rope_scores(
        &self,
        cb: &KeyCodebook,
        span: CodebookSpan,
        q: &[f32],
        head: usize,
        row: &mut [f64],
    ) {
        let (g, half, levels) = (cb.pairs_per_code, self.head_dim / 2, cb.levels);
        // P[group][round][entry][pair] = conj(q_pair) · c_entry,pair, as (re, im).
        let mut p = vec![(0.0f64, 0.0f64); cb.groups() * cb.residuals * levels * g];
        for group in 0..cb.groups() {
            for r in 0..cb.residuals {
                let t = cb.table(head, group, r);
                for k in 0..levels {
                    for j in 0..g {
                        let pair = group * g + j;
                        let (qr, qi) = (q[pair] as f64, q[pair + half] as f64);
                        let (x, y) = (t[(k * g + j) * 2] as f64, t[(k * g + j) * 2 + 1] as f64);
                        p[((group * cb.residuals + r) * levels + k) * g + j] =
                            (qr * x + qi * y, qr * y - qi * x);
                    }
                }
            }
        }
        let regions = &self.k.regions;
        let mut acc = vec![(0.0f64, 0.0f64); g];
        for page in 0..regions.pages {
            for (i, tok) in regions.page_tokens(page).enumerate() {
                let mut score = 0.0;
                for group in 0..cb.groups() {
                    acc.iter_mut().for_each(|a| *a = (0.0, 0.0));
                    for r in 0..cb.residuals {
                        let (a, b) = rope_code(&self.k, cb, page, i, head, group, r);
                        let base = (group * cb.residuals + r) * levels;
                        let (pa, pb) = (
                            &p[(base + a as usize) * g..][..g],
                            &p[(base + b as usize) * g..][..g],
                        );
                        for j in 0..g {
                            // P_a + i·P_b
                            acc[j].0 += pa[j].0 - pb[j].1;
                            acc[j].1 += pa[j].1 + pb[j].0;
                        }
                    }
                    for (j, (re, im)) in acc.iter().enumerate() {
                        let (c, s) = self.rope.angle(self.head_dim, group * g + j, tok);
                        score += c * re - s * im;
                    }
                }
                row[tok] = score * rope_scale(&self.k, span, page, i, head);
            }
        }
    }

    /// Softmax probabilities `[q_heads][tokens]` from [`CommVqCache::scores`] (calibrated where the
    /// scheme asks, as [`crate::attention::probabilities`] does).
    pub fn probabilities(&self, q: &Queries) -> Result<Vec<f64>, RefError> {
        let mut s = self.scores(q)?;
        let len = self.tokens;
        for row in s.chunks_exact_mut(len) {
            if let Some(c) = &self.spec.calibrate {
                let quantized = self.k.regions.quantized();
                let lo = row[quantized.clone()]
                    .iter()
                    .cloned()
                    .fold(f64::INFINITY, f64::min);
                let hi = row[quantized.clone()]
                    .iter()
                    .cloned()
                    .fold(f64::NEG_INFINITY, f64::max);
                if lo.is_finite() {
                    for x in &mut row[quantized] {
                        *x = calibrate_score(c, *x, lo, hi);
                    }
                }
            }
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let mut sum = 0.0;
            for x in row.iter_mut() {
                *x = (*x - m).exp();
                sum += *x;
            }
            row.iter_mut().for_each(|x| *x /= sum);
        }
        Ok(s)
    }

    /// `Σ_t p_t v̂_t` `[q_heads][head_dim]` from the codes: additive tokens through `(p·W·S)·C`.
    pub fn weighted_values(&self, probs: &[f64], q_heads: usize) -> Result<Vec<f32>, RefError> {
        let (d, len) = (self.head_dim, self.tokens);
        if q_heads % self.kv_heads != 0 || probs.len() != q_heads * len {
            return Err(RefError::Mismatch(format!(
                "{} probabilities for {q_heads} query heads over {len} tokens",
                probs.len()
            )));
        }
        let group = q_heads / self.kv_heads;
        let mut out = vec![0.0f32; q_heads * d];
        for qh in 0..q_heads {
            let head = qh / group;
            let p = &probs[qh * len..(qh + 1) * len];
            let mut acc = vec![0.0f64; d];
            for tok in self.v.regions.sink().chain(self.v.regions.tail()) {
                for (a, x) in acc.iter_mut().zip(self.v.fp16_row(head, tok, d)) {
                    *a += p[tok] * x as f64;
                }
            }
            match &self.v.coding {
                Coding::Fp16 => {}
                Coding::Rope { .. } => {
                    return Err(RefError::WrongEntryPoint(
                        "values cannot use a RoPE-commutative codebook".into(),
                    ))
                }
                Coding::Additive(cb) => additive_values(&self.v, cb, p, head, &mut acc),
            }
            for (o, a) in out[qh * d..(qh + 1) * d].iter_mut().zip(acc) {
                *o = a as f32;
            }
        }
        Ok(out)
    }

    /// Decode attention computed from the codes: [`CommVqCache::probabilities`] then
    /// [`CommVqCache::weighted_values`].
    pub fn attend(&self, q: &Queries) -> Result<Vec<f32>, RefError> {
        let p = self.probabilities(q)?;
        self.weighted_values(&p, q.q_heads)
    }
}

fn dot32(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// The columns of book `b` that belong to `head` (all of them for `span = head`).
fn head_columns(cb: &AdditiveCodebook, head: usize) -> (usize, std::ops::Range<usize>) {
    let d = cb.head_dim;
    match cb.span {
        CodebookSpan::Head => (head, 0..d),
        CodebookSpan::Token => (0, head * d..(head + 1) * d),
    }
}

/// Additive keys: `q·k̂ = q·μ + w · Σ_{j∈s} (C_j ⊙ σ)·q`, with `(C_j ⊙ σ)·q` precomputed per row.
fn additive_scores(s: &Stored, cb: &AdditiveCodebook, q: &[f32], head: usize, row: &mut [f64]) {
    let (b, cols) = head_columns(cb, head);
    let (dim, book, scale) = (cb.dim(), cb.book(b), cb.scale(b));
    let q_mean: f64 = cols
        .clone()
        .zip(q)
        .map(|(c, qv)| cb.mean(b)[c] as f64 * *qv as f64)
        .sum();
    let qc: Vec<f64> = (0..cb.rows)
        .map(|j| {
            cols.clone()
                .zip(q)
                .map(|(c, qv)| book[j * dim + c] as f64 * scale[c] as f64 * *qv as f64)
                .sum()
        })
        .collect();
    for page in 0..s.regions.pages {
        for (i, tok) in s.regions.page_tokens(page).enumerate() {
            let sum: f64 = (0..cb.rows)
                .filter(|j| additive_bit(s, cb, page, i, b, *j))
                .map(|j| qc[j])
                .sum();
            row[tok] = q_mean + sum * additive_factor(s, page, i, b);
        }
    }
}

/// Additive values: `a = Σ_t p_t w_t s_t` over the code rows, then `(Σ_t p_t)·μ + (a·C) ⊙ σ` on the
/// head's columns.
fn additive_values(s: &Stored, cb: &AdditiveCodebook, p: &[f64], head: usize, acc: &mut [f64]) {
    let (b, cols) = head_columns(cb, head);
    let (dim, book, scale, mean) = (cb.dim(), cb.book(b), cb.scale(b), cb.mean(b));
    let mut a = vec![0.0f64; cb.rows];
    let mut mass = 0.0;
    for page in 0..s.regions.pages {
        for (i, tok) in s.regions.page_tokens(page).enumerate() {
            mass += p[tok];
            let pw = p[tok] * additive_factor(s, page, i, b);
            for (j, aj) in a.iter_mut().enumerate() {
                if additive_bit(s, cb, page, i, b, j) {
                    *aj += pw;
                }
            }
        }
    }
    for (o, c) in acc.iter_mut().zip(cols.clone()) {
        *o += mass * mean[c] as f64;
    }
    for (j, aj) in a.iter().enumerate() {
        if *aj != 0.0 {
            for (o, c) in acc.iter_mut().zip(cols.clone()) {
                *o += aj * book[j * dim + c] as f64 * scale[c] as f64;
            }
        }
    }
}
