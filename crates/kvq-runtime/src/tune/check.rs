//! The correctness gate: a configuration's output for a few batch rows against the CPU reference
//! on the same quantized cache. Speed must never be bought with a wrong answer.

use kvq_codegen::Dtype;
use kvq_reference::attention::{self, Queries};
use kvq_reference::int::IntCache;
use kvq_reference::Dequantized;

use super::synth::word_to_f32;
use crate::error::{Result, RuntimeError};

/// Largest accepted ‖out − ref‖ / ‖ref‖ for `dtype` outputs (f16 keeps 11 significant bits,
/// bf16 8).
pub fn tolerance(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F16 => 2e-3,
        Dtype::Bf16 => 1e-2,
    }
}

/// Reference outputs of selected batch rows (or of a part of each, see
/// [`ReferenceCheck::from_row_parts`]), computed once and compared with any number of kernel
/// outputs.
pub struct ReferenceCheck {
    rows: Vec<(usize, Vec<f32>)>,
    row_len: usize,
    /// Where in its row each reference starts (0: whole rows).
    offset: usize,
    dtype: Dtype,
}

/// The largest difference of `got` from `want` (device words of `dtype`, equally long) over the
/// largest |want|; `None` when `got` holds a NaN or an infinity. How the tuners compare a
/// candidate's output with the default launch's, where no CPU reference is at hand.
pub fn relative_difference(got: &[u16], want: &[u16], dtype: Dtype) -> Option<f64> {
    let value = |b: u16| f64::from(word_to_f32(b, dtype));
    let scale = want
        .iter()
        .map(|&b| value(b).abs())
        .fold(0.0, f64::max)
        .max(1e-30);
    let mut worst = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        let g = value(g);
        if !g.is_finite() {
            return None;
        }
        worst = worst.max((g - value(w)).abs() / scale);
    }
    Some(worst)
}

/// Gates a candidate's output (`got`, or why it has none) against the default launch's (`want`):
/// sets `result.error` to their relative difference where it is within `dtype`'s tolerance (always
/// for the default itself, `is_default`), else `result.rejected` to why.
pub(crate) fn gate_output(
    result: &mut super::CandidateResult,
    got: crate::error::Result<Vec<u16>>,
    want: &[u16],
    dtype: Dtype,
    is_default: bool,
) {
    let tol = tolerance(dtype);
    match got {
        Ok(got) => match relative_difference(&got, want, dtype) {
            Some(err) if err <= tol || is_default => result.error = Some(err),
            Some(err) => {
                result.rejected = Some(format!(
                    "differs from the default by {err:.2e} (over {tol:.0e})"
                ))
            }
            None => result.rejected = Some("NaN or infinite outputs".into()),
        },
        Err(e) => result.rejected = Some(e.to_string()),
    }
}

/// The rows worth checking in a batch of `batch`: the first and the last (where indexing mistakes
/// show).
pub fn default_rows(batch: usize) -> Vec<usize> {
    let mut rows = vec![0, batch.saturating_sub(1)];
    rows.dedup();
    rows
}

impl ReferenceCheck {
    /// Computes the reference for `rows` of a batch: `q` holds the query values of every row
    /// (`[batch][q_heads][head_dim]`, as the kernel's dtype rounds them). A sequence shared by
    /// several rows (the same `&IntCache`) is dequantized once.
    pub fn new(
        sequences: &[&IntCache],
        q: &[f32],
        q_heads: usize,
        dtype: Dtype,
        rows: &[usize],
    ) -> Result<ReferenceCheck> {
        let first = sequences
            .first()
            .ok_or_else(|| RuntimeError::InvalidInput("no sequences to check".into()))?;
        let head_dim = first.k().head_dim();
        let row_len = q_heads * head_dim;
        if q.len() != sequences.len() * row_len {
            return Err(RuntimeError::InvalidInput(format!(
                "{} query values for {} rows of {row_len}",
                q.len(),
                sequences.len()
            )));
        }
        let mut dequantized: Vec<(*const IntCache, Dequantized)> = Vec::new();
        let mut out = Vec::with_capacity(rows.len());
        for &row in rows {
            let seq = *sequences.get(row).ok_or_else(|| {
                RuntimeError::InvalidInput(format!(
                    "row {row} outside a batch of {}",
                    sequences.len()
                ))
            })?;
            let ptr: *const IntCache = seq;
            let at = match dequantized.iter().position(|(p, _)| *p == ptr) {
                Some(i) => i,
                None => {
                    dequantized.push((ptr, seq.dequantize()));
                    dequantized.len() - 1
                }
            };
            let queries = Queries {
                data: q[row * row_len..(row + 1) * row_len].to_vec(),
                q_heads,
                head_dim,
            };
            let want =
                attention::decode(&queries, &dequantized[at].1, seq.spec().calibrate.as_ref())
                    .map_err(|e| RuntimeError::InvalidInput(format!("reference decode: {e}")))?;
            out.push((row, want));
        }
        Ok(ReferenceCheck {
            rows: out,
            row_len,
            offset: 0,
            dtype,
        })
    }

    /// A check against reference outputs computed by the caller: `(row, [q_heads][head_dim])`
    /// pairs for rows of `row_len` values.
    pub fn from_rows(rows: Vec<(usize, Vec<f32>)>, row_len: usize, dtype: Dtype) -> ReferenceCheck {
        Self::from_row_parts(rows, row_len, 0, dtype)
    }

    /// A check of one part of each row: `(row, values)` pairs whose values stand for the row's
    /// values from `offset` on (e.g. the query heads of one KV head, where the reference of a
    /// whole row costs too much). The rest of every row is still checked finite.
    pub fn from_row_parts(
        rows: Vec<(usize, Vec<f32>)>,
        row_len: usize,
        offset: usize,
        dtype: Dtype,
    ) -> ReferenceCheck {
        ReferenceCheck {
            rows,
            row_len,
            offset,
            dtype,
        }
    }

    /// The largest relative error over the checked rows of `output` (all rows, device words), or
    /// why it fails: a non-finite value anywhere, or an error above [`tolerance`].
    pub fn verify(&self, output: &[u16]) -> std::result::Result<f64, String> {
        if let Some(i) = output
            .iter()
            .position(|&w| !word_to_f32(w, self.dtype).is_finite())
        {
            return Err(format!(
                "non-finite output at row {} (value index {i}): unwritten or overflowed",
                i / self.row_len.max(1)
            ));
        }
        let tol = tolerance(self.dtype);
        let mut worst = 0.0f64;
        for (row, want) in &self.rows {
            let start = row * self.row_len + self.offset;
            if self.offset + want.len() > self.row_len {
                return Err(format!(
                    "the reference of row {row} runs past its {} values",
                    self.row_len
                ));
            }
            let have: Vec<f32> = output
                .get(start..start + want.len())
                .ok_or_else(|| format!("output has no row {row}"))?
                .iter()
                .map(|&w| word_to_f32(w, self.dtype))
                .collect();
            let err = attention::relative_error(&have, want);
            if err.is_nan() || err > tol {
                return Err(format!(
                    "row {row}: relative error {err:.3e} above {tol:.0e}"
                ));
            }
            worst = worst.max(err);
        }
        Ok(worst)
    }
}

#[cfg(test)]
mod tests {
    use super::super::synth::{random_kv, random_queries};
    use super::*;
    use half::f16;

    #[test]
    fn accepts_the_reference_and_rejects_wrong_or_unwritten_outputs() {
        let spec = "k = int(4, channel), v = int(4, token)".parse().unwrap();
        let (k, v) = random_kv(2, 300, 64, 11).unwrap();
        let cache = IntCache::build(&spec, &k, &v).unwrap();
        let batch = [&cache, &cache, &cache];
        let q_heads = 4;
        let (_, q) = random_queries(3 * q_heads * 64, Dtype::F16, 5).unwrap();
        let rows = default_rows(3);
        assert_eq!(rows, vec![0, 2]);
        let check = ReferenceCheck::new(&batch, &q, q_heads, Dtype::F16, &rows).unwrap();
        // The reference itself, rounded to f16, passes (row 1 unchecked but finite).
        let mut out = vec![f16::from_f32(0.25).to_bits(); 3 * q_heads * 64];
        for (row, want) in &check.rows {
            for (i, x) in want.iter().enumerate() {
                out[row * q_heads * 64 + i] = f16::from_f32(*x).to_bits();
            }
        }
        let err = check.verify(&out).unwrap();
        assert!(err < 1e-3, "{err}");
        // A wrong value in a checked row fails.
        let mut wrong = out.clone();
        for w in &mut wrong[2 * q_heads * 64..2 * q_heads * 64 + 64] {
            *w = f16::from_f32(f16::from_bits(*w).to_f32() + 0.5).to_bits();
        }
        assert!(check.verify(&wrong).unwrap_err().contains("row 2"));
        // NaN in an unchecked row fails too.
        let mut nan = out.clone();
        nan[q_heads * 64 + 3] = 0xFFFF;
        assert!(check.verify(&nan).unwrap_err().contains("non-finite"));
        assert_eq!(default_rows(1), vec![0]);
    }

    #[test]
    fn a_part_of_a_row_is_checked_where_it_stands() {
        let w = |x: f32| f16::from_f32(x).to_bits();
        // Two rows of 4: the reference covers values 2..4 of row 1.
        let check = ReferenceCheck::from_row_parts(vec![(1, vec![0.5, -1.0])], 4, 2, Dtype::F16);
        let good = [9.0, 9.0, 9.0, 9.0, 7.0, 7.0, 0.5, -1.0].map(w);
        assert_eq!(check.verify(&good).unwrap(), 0.0);
        let shifted = [9.0, 9.0, 9.0, 9.0, 0.5, -1.0, 7.0, 7.0].map(w);
        assert!(check.verify(&shifted).unwrap_err().contains("row 1"));
        let past = ReferenceCheck::from_row_parts(vec![(0, vec![0.0; 3])], 4, 2, Dtype::F16);
        assert!(past.verify(&good).unwrap_err().contains("runs past"));
    }

    #[test]
    fn differences_are_relative_to_the_largest_wanted_value() {
        let w = |x: f32| f16::from_f32(x).to_bits();
        let want = [w(2.0), w(-4.0)];
        assert_eq!(relative_difference(&want, &want, Dtype::F16), Some(0.0));
        let got = [w(2.5), w(-4.0)];
        assert_eq!(relative_difference(&got, &want, Dtype::F16), Some(0.125));
        assert_eq!(
            relative_difference(&[0x7e00, w(1.0)], &want, Dtype::F16),
            None
        );
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let spec = "k = int(4, channel), v = int(4, token)".parse().unwrap();
        let (k, v) = random_kv(1, 40, 32, 1).unwrap();
        let cache = IntCache::build(&spec, &k, &v).unwrap();
        assert!(ReferenceCheck::new(&[], &[], 1, Dtype::F16, &[0]).is_err());
        assert!(ReferenceCheck::new(&[&cache], &[0.0; 31], 1, Dtype::F16, &[0]).is_err());
        assert!(ReferenceCheck::new(&[&cache], &[0.5; 32], 1, Dtype::F16, &[1]).is_err());
    }
}
