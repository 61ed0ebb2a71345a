//! Rules that depend on the model's shape (head dimension, KV heads), checked at run time.

use crate::types::*;

/// The largest head dimension a boosted tensor can have.
///
/// A boosted page stores, per channel, the slot of its high-bit plane (or a sentinel for "not
/// boosted"), and per slot the channel it belongs to, each in one byte. One byte names channels
/// `0..=255`, so a head has at most 256 channels; slots stay below the boosted channel count, which
/// is below `head_dim`, so they never reach the sentinel `u8::MAX`. The reference layout, the
/// kernels and `check_shape` all use this one number.
pub const MAX_BOOSTED_HEAD_DIM: u32 = u8::MAX as u32 + 1;

/// Head dimensions are multiples of this many channels.
///
/// Sixteen keeps every section of a page block a whole number of 16-byte vectors without padding
/// (a page is a multiple of 16 tokens; per-channel f16 scales and the boost map are `2·head_dim` and
/// `head_dim` bytes), keeps `head_dim / 2` RoPE pairs whole, and admits the models whose heads are
/// 80 or 112 channels wide (Phi-2, StableLM). Code rows of `head_dim` codes need not fill whole
/// 32-bit words: the last word of a row is zero-padded (docs/LAYOUT.md §2).
pub const HEAD_DIM_MULTIPLE: u32 = 16;

/// A scheme that cannot serve a given head shape.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ShapeError {
    #[error("head_dim {0} is not supported: it must be a positive multiple of {m}", m = HEAD_DIM_MULTIPLE)]
    HeadDim(u32),
    #[error("kv_heads must be at least 1")]
    KvHeads,
    #[error("{what} {value} is too large: shapes are counted in 32 bits (at most {max})", max = u32::MAX)]
    TooLarge { what: &'static str, value: u64 },
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
    #[error("{tensor}: boosted tensors support head_dim at most {max}, got {head_dim}: a boosted page stores each channel index in one byte (byte value {sentinel} marks an unboosted channel)", max = MAX_BOOSTED_HEAD_DIM, sentinel = u8::MAX)]
    BoostHeadDim { tensor: &'static str, head_dim: u32 },
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
        dim: u64,
        bits: f64,
    },
}

/// Channels a boost of `ratio` selects per page: `ratio · head_dim`, rounded to nearest.
fn boosted_channels(ratio: f32, head_dim: u32) -> u32 {
    // `as` saturates, so even a hand-built ratio outside (0, 1) or NaN gives a count, not a panic.
    (f64::from(ratio) * f64::from(head_dim)).round() as u32
}

impl SchemeSpec {
    /// Scalars one codebook vector covers for a tensor with this span. The product of two `u32`s
    /// always fits a `u64`, so no shape can overflow it.
    pub fn codebook_dim(span: CodebookSpan, head_dim: u32, kv_heads: u32) -> u64 {
        match span {
            CodebookSpan::Head => u64::from(head_dim),
            CodebookSpan::Token => u64::from(head_dim) * u64::from(kv_heads),
        }
    }

    /// [`check_shape`](Self::check_shape) for sizes held as `usize` (tensor shapes): a size past
    /// `u32` is [`ShapeError::TooLarge`], never truncated into a smaller shape that would pass.
    pub fn check_shape_usize(&self, head_dim: usize, kv_heads: usize) -> Result<(), ShapeError> {
        let narrow = |what, value: usize| {
            u32::try_from(value).map_err(|_| ShapeError::TooLarge {
                what,
                value: value as u64,
            })
        };
        self.check_shape(narrow("head_dim", head_dim)?, narrow("kv_heads", kv_heads)?)
    }

    /// Checks that this scheme can store heads of `head_dim` channels with `kv_heads` KV heads.
    ///
    /// Total over every input, including a `SchemeSpec` built by hand rather than parsed: a zero
    /// `group` or `pairs_per_code` is reported as not dividing, never divided by.
    pub fn check_shape(&self, head_dim: u32, kv_heads: u32) -> Result<(), ShapeError> {
        for (tensor, t) in [("k", &self.k), ("v", &self.v)] {
            Self::check_tensor_shape(tensor, t, head_dim, kv_heads)?;
        }
        Ok(())
    }

    /// The rules for one tensor stored with `t` in heads of `head_dim` channels and `kv_heads` KV
    /// heads (the shape itself, boost width, token groups, RoPE pairs, codebook compression):
    /// [`check_shape`](Self::check_shape) applies it to K and V, and stores of other tensors
    /// (XQuant's latents) to theirs, so every store follows the same rules.
    pub fn check_tensor_shape(
        tensor: &'static str,
        t: &TensorQuant,
        head_dim: u32,
        kv_heads: u32,
    ) -> Result<(), ShapeError> {
        if head_dim == 0 || head_dim % HEAD_DIM_MULTIPLE != 0 {
            return Err(ShapeError::HeadDim(head_dim));
        }
        if kv_heads == 0 {
            return Err(ShapeError::KvHeads);
        }
        match t {
            TensorQuant::Fp16 => {}
            TensorQuant::Int(q) => {
                if let Some(b) = q.boost {
                    if head_dim > MAX_BOOSTED_HEAD_DIM {
                        return Err(ShapeError::BoostHeadDim { tensor, head_dim });
                    }
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
                    if head_dim.checked_rem(group) != Some(0) {
                        return Err(ShapeError::Group {
                            tensor,
                            group,
                            head_dim,
                        });
                    }
                }
            }
            TensorQuant::Codebook(c) => match c.codebook {
                Codebook::RopeCommutative { pairs_per_code, .. } => {
                    let half = head_dim / 2;
                    if half.checked_rem(pairs_per_code) != Some(0) {
                        return Err(ShapeError::Pairs {
                            tensor,
                            pairs: pairs_per_code,
                            half,
                            head_dim,
                        });
                    }
                }
                Codebook::Additive { rows } => {
                    let dim = Self::codebook_dim(c.span, head_dim, kv_heads);
                    // Both operands convert to f64 without overflow (dim < 2^64); the
                    // quotient only decides "compresses or not".
                    let bits = f64::from(rows) / dim as f64;
                    if bits >= 16.0 {
                        return Err(ShapeError::NoCompression {
                            tensor,
                            rows,
                            dim,
                            bits,
                        });
                    }
                }
            },
        }
        Ok(())
    }
}
