//! Exact packed storage of CommVQ pages (see `docs/CODEBOOKS.md`).
//!
//! Per quantized page of `P` tokens, page-major, little-endian `u32` words:
//! - key codes `[kv_head][group][round]`, each a bit stream of the page's `P` codes,
//!   `w = 2·log2(N')` bits each (`a` in the high `log2 N'` bits, `b` in the low), code `t` at bits
//!   `t·w .. t·w + w` of the stream, LSB first (a code may straddle two words); `P·w/32` words per stream;
//! - key scales `[vector][token]` f16 (vector = KV head for `span = head`, one per token for `token`);
//! - value codes `[book][word][token]`: bit `j % 32` of word `j / 32` is row `j` of the token's code;
//! - value factors `[book][token]` f16.
//!
//! FP16 tokens (sink, Q-buffer, local window) are stored as in every other scheme.

use crate::RefError;

/// Writes `codes` of `width` bits (1..=32) as a little-endian bit stream into `out` (zeroed first).
pub fn pack_stream(codes: &[u32], width: u32, out: &mut [u32]) -> Result<(), RefError> {
    let need = stream_words(codes.len(), width);
    if !(1..=32).contains(&width) || out.len() != need {
        return Err(RefError::Mismatch(format!(
            "a stream of {} {width}-bit codes needs {need} words, got {}",
            codes.len(),
            out.len()
        )));
    }
    out.iter_mut().for_each(|w| *w = 0);
    let mask = mask(width);
    for (i, &c) in codes.iter().enumerate() {
        if c & !mask != 0 {
            return Err(RefError::Mismatch(format!(
                "code {c} does not fit in {width} bits"
            )));
        }
        let bit = i * width as usize;
        let (word, shift) = (bit / 32, (bit % 32) as u32);
        out[word] |= c << shift;
        if shift + width > 32 {
            out[word + 1] |= c >> (32 - shift);
        }
    }
    Ok(())
}

/// Code `i` of a stream of `width`-bit codes (`None` past the end of `words`).
pub fn unpack_stream(words: &[u32], width: u32, i: usize) -> Option<u32> {
    let bit = i * width as usize;
    let (word, shift) = (bit / 32, (bit % 32) as u32);
    let mut c = words.get(word)? >> shift;
    if shift + width > 32 {
        c |= words.get(word + 1)? << (32 - shift);
    }
    Some(c & mask(width))
}

/// Words of a stream of `n` codes of `width` bits.
pub fn stream_words(n: usize, width: u32) -> usize {
    (n * width as usize).div_ceil(32)
}

fn mask(width: u32) -> u32 {
    if width >= 32 {
        u32::MAX
    } else {
        (1u32 << width) - 1
    }
}

/// Sizes of one tensor's part of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorLayout {
    pub code_words: usize,
    pub scales: usize,
}

impl TensorLayout {
    /// A RoPE-commutative key tensor: `kv_heads · groups · residuals` streams plus one scale per vector.
    pub fn rope(
        page: usize,
        kv_heads: usize,
        groups: usize,
        residuals: usize,
        code_bits: u32,
        vectors: usize,
    ) -> Option<Self> {
        // Checked: memory accounting asks for shapes no cache could hold.
        let words = page.checked_mul(code_bits as usize)?.div_ceil(32);
        Some(Self {
            code_words: kv_heads
                .checked_mul(groups)?
                .checked_mul(residuals)?
                .checked_mul(words)?,
            scales: vectors.checked_mul(page)?,
        })
    }

    /// A binary additive tensor: `books · rows/32` words per token plus one factor per vector.
    pub fn additive(page: usize, books: usize, rows: usize) -> Option<Self> {
        Some(Self {
            code_words: books.checked_mul(rows / 32)?.checked_mul(page)?,
            scales: books.checked_mul(page)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_round_trip_at_every_width() {
        for width in 1..=32u32 {
            let codes: Vec<u32> = (0..48u64)
                .map(|i| ((i * 2_654_435_761 + 12345) as u32) & mask(width))
                .collect();
            let mut words = vec![0; stream_words(codes.len(), width)];
            pack_stream(&codes, width, &mut words).unwrap();
            for (i, c) in codes.iter().enumerate() {
                assert_eq!(
                    unpack_stream(&words, width, i),
                    Some(*c),
                    "width {width} code {i}"
                );
            }
        }
    }

    #[test]
    fn twelve_bit_codes_straddle_words_little_endian() {
        let mut words = vec![0; 3];
        pack_stream(&[0xabc, 0x123, 0xfff, 0x001, 0, 0, 0, 0], 12, &mut words).unwrap();
        assert_eq!(words[0], 0xabc | 0x123 << 12 | 0xff << 24);
        assert_eq!(words[1] & 0xf, 0xf);
        assert!(pack_stream(&[0x1000], 12, &mut [0]).is_err());
        assert_eq!(unpack_stream(&words, 12, 8), None);
    }
}
