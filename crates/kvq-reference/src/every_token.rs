//! Every token of a sequence attending as decoding sees it: teacher forcing through the cache.
//!
//! Token `t`'s query attends to tokens `0..=t` as the cache holds them once token `t` is in it:
//! the pages full by then quantized, the sink and the tail in FP16, calibrated where the scheme
//! asks. A page's quantization depends only on its own tokens, so one build of the whole sequence
//! gives every page's decoded values; what changes with `t` is which pages exist yet. This is what
//! a perplexity measured through the quantized cache computes (`python -m kvq.eval`), in one pass
//! of `O(tokens²)` work per head, the heads in parallel.
//!
//! ```
//! use kvq_reference::{every_token, int, step::StepQueries, synth};
//! let spec = kvq_spec::SchemeSpec::parse("k = int(2, channel), v = int(2, token), local = 32, page = 32").unwrap();
//! let s = synth::generate(&synth::SynthConfig { tokens: 160, head_dim: 64, ..Default::default() });
//! let q = StepQueries::repeat(&s.q, 160); // one query token per cached token
//! let every = every_token::attend(&spec, &s.k, &s.v, &q).unwrap();
//! // The last token sees the whole sequence as the cache holds it: what a decode step computes.
//! let last = int::attend_step(&spec, &s.k, &s.v, &StepQueries {
//!     data: q.token(159).to_vec(), q_len: 1, q_heads: q.q_heads, head_dim: 64 }).unwrap();
//! assert!(kvq_reference::attention::relative_error(every.out_row(159, 0), last.out_row(0, 0)) < 1e-6);
//! ```

use crate::attention::{calibrate_score, softmax_in_place};
use crate::int::IntCache;
use crate::regions::TokenRegions;
use crate::step::{AttentionState, StepQueries};
use crate::{par, KvTensor, RefError};
use half::f16;
use kvq_spec::{SchemeSpec, TensorQuant};

/// Which tokens of one tensor are read from quantized pages when `len` tokens are cached.
#[derive(Clone, Copy)]
struct Pages {
    quantized: bool,
    sink: usize,
    local: usize,
    page: usize,
}

impl Pages {
    fn of(spec: &SchemeSpec, t: &TensorQuant) -> Self {
        Self {
            quantized: t.is_quantized(),
            sink: spec.sink as usize,
            local: spec.local_of(t) as usize,
            page: spec.page as usize,
        }
    }

    /// The tokens held in pages once `len` tokens are cached (empty for an FP16 tensor).
    fn at(&self, len: usize) -> std::ops::Range<usize> {
        if !self.quantized {
            return 0..0;
        }
        TokenRegions::new(len, self.sink, self.local, self.page).quantized()
    }
}

fn rounded(x: &KvTensor) -> KvTensor {
    KvTensor {
        data: x.data.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        ..x.clone()
    }
}

/// Attention of query token `t` (row `t` of `q`, whose `q_len` must equal the sequence's tokens)
/// over tokens `0..=t` as the cache holds them after token `t`, for every `t`: outputs and LSEs
/// as [`crate::step::attend`] gives them. Integer and FP16 schemes (the others' caches have their
/// own entry points and are refused).
pub fn attend(
    spec: &SchemeSpec,
    k: &KvTensor,
    v: &KvTensor,
    q: &StepQueries,
) -> Result<AttentionState, RefError> {
    let n = k.tokens;
    if q.q_len != n {
        return Err(RefError::Mismatch(format!(
            "{} query tokens for a sequence of {n}: every token needs its query",
            q.q_len
        )));
    }
    let group = crate::step::check_heads(q, k)?;
    let full = IntCache::build(spec, k, v)?.dequantize();
    let (kr, vr) = (rounded(k), rounded(v));
    let (kp, vp) = (Pages::of(spec, &spec.k), Pages::of(spec, &spec.v));
    let d = k.head_dim;
    let scale = 1.0 / (d as f64).sqrt();
    let per_head = par::map(q.q_heads, 0, |h| {
        let kvh = h / group;
        let mut out = vec![0.0f32; n * d];
        let mut lse = vec![0.0f32; n];
        let mut scores = vec![0.0f64; n];
        for t in 0..n {
            let (kq, vq) = (kp.at(t + 1), vp.at(t + 1));
            let row = &mut scores[..=t];
            let qh = q.row(t, h);
            for (i, s) in row.iter_mut().enumerate() {
                let key = if kq.contains(&i) {
                    full.k.row(kvh, i)
                } else {
                    kr.row(kvh, i)
                };
                *s = qh
                    .iter()
                    .zip(key)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * scale;
            }
            if let (Some(c), false) = (spec.calibrate.as_ref(), kq.is_empty()) {
                let seen = &row[kq.clone()];
                let lo = seen.iter().cloned().fold(f64::INFINITY, f64::min);
                let hi = seen.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                for s in &mut row[kq.clone()] {
                    *s = calibrate_score(c, *s, lo, hi);
                }
            }
            let (m, sum) = softmax_in_place(row);
            let mut acc = vec![0.0f64; d];
            for (i, p) in row.iter().enumerate() {
                let value = if vq.contains(&i) {
                    full.v.row(kvh, i)
                } else {
                    vr.row(kvh, i)
                };
                for (a, x) in acc.iter_mut().zip(value) {
                    *a += p * *x as f64;
                }
            }
            for (o, a) in out[t * d..(t + 1) * d].iter_mut().zip(acc) {
                *o = a as f32;
            }
            lse[t] = (m + sum.ln()) as f32;
        }
        (out, lse)
    })?;
    let mut state = AttentionState {
        out: vec![0.0; n * q.q_heads * d],
        lse: vec![0.0; n * q.q_heads],
        q_len: n,
        q_heads: q.q_heads,
        head_dim: d,
    };
    for (h, (out, lse)) in per_head.into_iter().enumerate() {
        for t in 0..n {
            let at = (t * q.q_heads + h) * d;
            state.out[at..at + d].copy_from_slice(&out[t * d..(t + 1) * d]);
            state.lse[t * q.q_heads + h] = lse[t];
        }
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{int, synth};

    /// Every token's row equals a decode step over the prefix the cache held at that token, for a
    /// scheme with sink, pages on both tensors at different windows, and calibration.
    #[test]
    fn each_row_is_the_step_over_its_prefix() {
        let spec = SchemeSpec::parse(
            "k = int(2, channel), v = int(4, token, local = 16), sink = 8, page = 16, \
             calibrate = calibrate(tau1 = 0.5, tau2 = 0.25)",
        )
        .unwrap();
        let s = synth::generate(&synth::SynthConfig {
            tokens: 90,
            head_dim: 64,
            ..Default::default()
        });
        let q = StepQueries::repeat(&s.q, 90);
        let every = attend(&spec, &s.k, &s.v, &q).unwrap();
        for t in [0, 7, 8, 23, 24, 39, 40, 57, 89] {
            let one = StepQueries {
                data: q.token(t).to_vec(),
                q_len: 1,
                q_heads: q.q_heads,
                head_dim: 64,
            };
            let step =
                int::attend_step(&spec, &s.k.prefix(t + 1), &s.v.prefix(t + 1), &one).unwrap();
            for h in 0..q.q_heads {
                let err = crate::attention::relative_error(every.out_row(t, h), step.out_row(0, h));
                assert!(err < 1e-6, "token {t} head {h}: {err}");
                let (a, b) = (every.lse[t * q.q_heads + h], step.lse[h]);
                assert!((a - b).abs() < 1e-5, "token {t} head {h}: lse {a} vs {b}");
            }
        }
    }

    #[test]
    fn refuses_a_query_count_other_than_the_tokens() {
        let spec = SchemeSpec::parse("k = int(2, channel), v = int(2, token)").unwrap();
        let s = synth::generate(&synth::SynthConfig {
            tokens: 40,
            head_dim: 64,
            ..Default::default()
        });
        let err = attend(&spec, &s.k, &s.v, &StepQueries::repeat(&s.q, 39)).unwrap_err();
        assert!(
            err.to_string().contains("every token needs its query"),
            "{err}"
        );
    }
}
