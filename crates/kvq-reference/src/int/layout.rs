//! The byte layout of one quantized page of one KV head (`docs/LAYOUT.md` §4–5), as offsets and
//! sizes computed from the quantizer and the shape. The packer, the unpacker and the memory accounting
//! all read these numbers, so they cannot drift apart.

use super::quantize::Quantizer;
use crate::pack;
use crate::RefError;
use kvq_spec::{Axis, BoostCriterion, IntQuant};
use std::ops::Range;

/// Version of the cache layout this module defines (page blocks, FP16 sink and tail ring); bumped on
/// any change a kernel or an embedding engine would notice. Emitted in `kvq gen` manifests.
pub const LAYOUT_VERSION: &str = "kvq-layout-2";

/// Alignment of every section and of every page block.
pub const ALIGN: usize = 16;

/// Sentinel of the boost index map: the channel is not boosted.
pub const NOT_BOOSTED: u8 = 0xFF;

// A boosted page stores each boosted channel's number in one byte (the slot table) and each slot
// number below the sentinel (the map); kvq-spec refuses boosted heads wider than both can address.
const _: () = assert!(kvq_spec::MAX_BOOSTED_HEAD_DIM <= NOT_BOOSTED as u32 + 1);

/// Rounds up to a multiple of [`ALIGN`].
pub fn align(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// A byte range inside a page block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Section {
    pub offset: usize,
    pub bytes: usize,
}

impl Section {
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.bytes
    }
}

/// How Kitty's boosted channels are stored in a page.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoostLayout {
    /// Bits of a boosted code (base + high).
    pub bits: u8,
    /// Bits of the high plane (`bits − base`).
    pub high_bits: u8,
    /// Boosted channels per page (k).
    pub channels: usize,
    pub by: BoostCriterion,
    /// Words of one token's high-plane row: `ceil(k · high_bits / 32)`.
    pub high_row_words: usize,
}

/// Boosted channels per page: `round(ratio · head_dim)` clamped to `1 ..= head_dim − 1`.
pub fn boosted_channels(ratio: f32, head_dim: usize) -> usize {
    let k = (f64::from(ratio) * head_dim as f64).round() as usize;
    k.min(head_dim.saturating_sub(1)).max(1)
}

/// Offsets and sizes of one quantized page block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IntLayout {
    /// The base quantizer (every non-boosted group).
    pub quant: Quantizer,
    pub axis: Axis,
    pub head_dim: usize,
    /// Tokens per page (P).
    pub page: usize,
    /// Channels sharing one scale of a token (token axis); `head_dim` on the channel axis.
    pub group: usize,
    pub boost: Option<BoostLayout>,
    /// Words of one token's dense code row (all channels, base bits).
    pub row_words: usize,
    /// Dense codes: `page` rows of `row_words` words.
    pub codes: Section,
    /// Boost high plane: `page` rows of `high_row_words` words (empty without boost).
    pub high: Section,
    /// f16 scales: `head_dim` (channel axis) or `page · head_dim / group` (token axis, token-major).
    pub scales: Section,
    /// f16 zeros, same count and order as the scales (empty when symmetric).
    pub zeros: Section,
    /// Boost index map: one byte per channel, slot or [`NOT_BOOSTED`] (empty without boost).
    pub map: Section,
    /// The map inverted: one byte per slot, its channel (empty without boost). Decode kernels
    /// gather the boosted channels' query through it once per page.
    pub slots: Section,
    /// Bytes of a whole block (a multiple of [`ALIGN`]).
    pub block_bytes: usize,
}

fn plane_ok(bits: u8) -> bool {
    matches!(bits, 1 | 2 | 4)
}

impl IntLayout {
    pub fn new(q: &IntQuant, head_dim: usize, page: usize) -> Result<Self, RefError> {
        if head_dim == 0 || page == 0 {
            return Err(RefError::Mismatch(format!(
                "a page of {page} tokens × {head_dim} channels holds nothing"
            )));
        }
        let quant = Quantizer::new(q.bits, q.symmetric)?;
        let row_words = pack::row_words(q.bits, head_dim)?;
        let group = match q.axis {
            Axis::Channel => head_dim,
            Axis::Token => q.group.map_or(head_dim, |g| g as usize),
        };
        if group == 0 || head_dim % group != 0 {
            return Err(RefError::Mismatch(format!(
                "token group {group} does not divide head_dim {head_dim}"
            )));
        }
        let boost = match q.boost {
            None => None,
            Some(b) => {
                let high_bits = b.bits.saturating_sub(q.bits);
                if q.axis != Axis::Channel
                    || !plane_ok(q.bits)
                    || !plane_ok(high_bits)
                    || head_dim < 2
                {
                    return Err(RefError::Mismatch(format!(
                        "a {}-bit boost of {}-bit {:?}-axis codes over {head_dim} channels has no layout",
                        b.bits, q.bits, q.axis
                    )));
                }
                let channels = boosted_channels(b.ratio, head_dim);
                if channels >= usize::from(NOT_BOOSTED) {
                    return Err(RefError::Mismatch(format!(
                        "{channels} boosted channels do not fit the u8 index map (at most 254)"
                    )));
                }
                Quantizer::new(b.bits, q.symmetric)?;
                Some(BoostLayout {
                    bits: b.bits,
                    high_bits,
                    channels,
                    by: b.by,
                    high_row_words: pack::plane_words(high_bits, channels),
                })
            }
        };
        let scale_count = match q.axis {
            Axis::Channel => head_dim,
            Axis::Token => page * (head_dim / group),
        };
        let mut at = 0;
        let mut section = |bytes: usize| {
            let s = Section { offset: at, bytes };
            at = align(at + bytes);
            s
        };
        let codes = section(page * row_words * 4);
        let high = section(boost.map_or(0, |b| page * b.high_row_words * 4));
        let scales = section(scale_count * 2);
        let zeros = section(if q.symmetric { 0 } else { scale_count * 2 });
        let map = section(if boost.is_some() { head_dim } else { 0 });
        let slots = section(boost.map_or(0, |b| b.channels));
        Ok(Self {
            quant,
            axis: q.axis,
            head_dim,
            page,
            group,
            boost,
            row_words,
            codes,
            high,
            scales,
            zeros,
            map,
            slots,
            block_bytes: at,
        })
    }

    /// Scale (and zero) entries per page.
    pub fn scale_count(&self) -> usize {
        self.scales.bytes / 2
    }

    /// Every section in block order (empty ones included).
    pub fn sections(&self) -> [Section; 6] {
        [
            self.codes,
            self.high,
            self.scales,
            self.zeros,
            self.map,
            self.slots,
        ]
    }

    /// Alignment padding inside a block.
    pub fn padding(&self) -> usize {
        let used: usize = self.sections().iter().map(|s| s.bytes).sum();
        self.block_bytes - used
    }
}

/// Bytes of one FP16 page of one head: `page` rows of `head_dim` little-endian f16.
pub fn fp16_block_bytes(head_dim: usize, page: usize) -> usize {
    align(page * head_dim * 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq_spec::Boost;

    #[test]
    fn kitty_page_at_head_dim_128() {
        let q = IntQuant {
            bits: 2,
            axis: Axis::Channel,
            group: None,
            symmetric: false,
            boost: Some(Boost {
                bits: 4,
                ratio: 0.125,
                by: BoostCriterion::Magnitude,
            }),
            local: None,
        };
        let l = IntLayout::new(&q, 128, 128).unwrap();
        assert_eq!(
            l.codes,
            Section {
                offset: 0,
                bytes: 4096
            }
        );
        assert_eq!(
            l.high,
            Section {
                offset: 4096,
                bytes: 512
            }
        );
        assert_eq!(
            l.scales,
            Section {
                offset: 4608,
                bytes: 256
            }
        );
        assert_eq!(
            l.zeros,
            Section {
                offset: 4864,
                bytes: 256
            }
        );
        assert_eq!(
            l.map,
            Section {
                offset: 5120,
                bytes: 128
            }
        );
        assert_eq!(
            l.slots,
            Section {
                offset: 5248,
                bytes: 16
            }
        );
        assert_eq!(l.block_bytes, 5264);
        assert_eq!(l.padding(), 0);
    }

    #[test]
    fn boosted_channel_count_rounds_and_clamps() {
        assert_eq!(boosted_channels(0.125, 128), 16);
        assert_eq!(boosted_channels(0.25, 128), 32);
        assert_eq!(boosted_channels(0.001, 32), 1);
        assert_eq!(boosted_channels(0.999, 32), 31);
    }
}
