//! The vectors a codebook sees: which scalars share a scale (keys) or a code (additive tensors).

use crate::{KvTensor, RefError};
use kvq_spec::CodebookSpan;

/// Per-vector key scales `‖k‖` rounded to f16: `[kv_head][token]` for `span = head`, `[token]` for
/// `span = token` (the norm over all KV heads of the token).
pub(crate) fn key_scales(k: &KvTensor, span: CodebookSpan) -> Result<Vec<f32>, RefError> {
    let norm = |rows: &mut dyn Iterator<Item = &[f32]>| {
        rows.flatten()
            .map(|x| (*x as f64).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let raw: Vec<(usize, usize, f64)> = match span {
        CodebookSpan::Head => (0..k.kv_heads)
            .flat_map(|h| (0..k.tokens).map(move |t| (h, t)))
            .map(|(h, t)| (h, t, norm(&mut std::iter::once(k.row(h, t)))))
            .collect(),
        CodebookSpan::Token => (0..k.tokens)
            .map(|t| (0, t, norm(&mut (0..k.kv_heads).map(|h| k.row(h, t)))))
            .collect(),
    };
    raw.into_iter()
        .map(|(head, token, n)| {
            let s = super::f16_of_f64(n);
            if s.is_finite() {
                Ok(s.to_f32())
            } else {
                Err(RefError::Mismatch(format!(
                    "key norm {n} at kv head {head}, token {token} exceeds the f16 range of the per-vector scale"
                )))
            }
        })
        .collect()
}

/// Index of the scale of (head, token) in [`key_scales`]'s output.
pub(crate) fn key_scale_index(
    span: CodebookSpan,
    _kv_heads: usize,
    tokens: usize,
    head: usize,
    token: usize,
) -> usize {
    match span {
        CodebookSpan::Head => head * tokens + token,
        CodebookSpan::Token => token,
    }
}

/// The vector of book `book` at `token`: one head's row, or all heads' rows concatenated.
pub(crate) fn additive_vector(
    x: &KvTensor,
    span: CodebookSpan,
    book: usize,
    token: usize,
) -> Vec<f32> {
    match span {
        CodebookSpan::Head => x.row(book, token).to_vec(),
        CodebookSpan::Token => (0..x.kv_heads)
            .flat_map(|h| x.row(h, token).iter().copied())
            .collect(),
    }
}
