//! Rules that depend on the model's shape (head dimension, KV heads), checked at run time.

use crate::types::*;

/// A scheme that cannot serve a given head shape.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ShapeError {
    #[error("head_dim {0} is not supported: it must be a positive multiple of 32")]
    HeadDim(u32),
    #[error("kv_heads must be at least 1")]
    KvHeads,
    #[error("{tensor}: token-axis `group = {group}` does not divide head_dim {head_dim}")]
    Group {
        tensor: &'static str,
        group: u32,
        head_dim: u32,
    },
    #[error("{tensor}: `pairs_per_code = {pairs}` does not divide the {half} RoPE pairs of head_dim {head_dim}")]
    Pairs {
        tensor: &'static str,
        pairs: u32,
        half: u32,
        head_dim: u32,
    },
    #[error("{tensor}: boost `ratio = {ratio}` of head_dim {head_dim} selects {channels} channels; it must select at least 1 and fewer than all")]
    Boost {
        tensor: &'static str,
        ratio: f32,
        head_dim: u32,
        channels: u32,
    },
    #[error("{tensor}: an additive codebook of {rows} rows over {dim} scalars spends {bits:.2} bits per scalar: no compression over fp16")]
    NoCompression {
        tensor: &'static str,
        rows: u32,
        dim: u32,
        bits: f64,
    },
}

/// Channels a boost of `ratio` selects per page: `ratio · head_dim`, rounded to nearest.
fn boosted_channels(ratio: f32, head_dim: u32) -> u32 {
    (f64::from(ratio) * f64::from(head_dim)).round() as u32
}

impl SchemeSpec {
    /// Scalars one codebook vector covers for a tensor with this span.
    pub fn codebook_dim(span: CodebookSpan, head_dim: u32, kv_heads: u32) -> u32 {
        match span {
            CodebookSpan::Head => head_dim,
            CodebookSpan::Token => head_dim * kv_heads,
        }
    }

    /// Checks that this scheme can store heads of `head_dim` channels with `kv_heads` KV heads.
    pub fn check_shape(&self, head_dim: u32, kv_heads: u32) -> Result<(), ShapeError> {
        if head_dim == 0 || head_dim % 32 != 0 {
            return Err(ShapeError::HeadDim(head_dim));
        }
        if kv_heads == 0 {
            return Err(ShapeError::KvHeads);
        }
        for (tensor, t) in [("k", &self.k), ("v", &self.v)] {
            match t {
                TensorQuant::Fp16 => {}
                TensorQuant::Int(q) => {
                    if let Some(b) = q.boost {
                        let channels = boosted_channels(b.ratio, head_dim);
                        if channels == 0 || channels >= head_dim {
                            return Err(ShapeError::Boost {
                                tensor,
                                ratio: b.ratio,
                                head_dim,
                                channels,
                            });
                        }
                    }
                    if let (Axis::Token, Some(group)) = (q.axis, q.group) {
                        if head_dim % group != 0 {
                            return Err(ShapeError::Group {
                                tensor,
                                group,
                                head_dim,
                            });
                        }
                    }
                }
                TensorQuant::Codebook(c) => {
                    let dim = Self::codebook_dim(c.span, head_dim, kv_heads);
                    match c.codebook {
                        Codebook::RopeCommutative { pairs_per_code, .. } => {
                            let half = head_dim / 2;
                            if half % pairs_per_code != 0 {
                                return Err(ShapeError::Pairs {
                                    tensor,
                                    pairs: pairs_per_code,
                                    half,
                                    head_dim,
                                });
                            }
                        }
                        Codebook::Additive { rows } => {
                            let bits = c.codebook.bits_per_scalar(dim);
                            if bits >= 16.0 {
                                return Err(ShapeError::NoCompression {
                                    tensor,
                                    rows,
                                    dim,
                                    bits,
                                });
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
