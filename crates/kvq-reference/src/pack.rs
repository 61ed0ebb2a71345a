//! Bit packing of integer codes into little-endian `u32` words (the layout of `docs/LAYOUT.md` §2).
//!
//! A *plane* of width `w ∈ {1, 2, 4, 8}` holds code `i` of a row in word `i / (32 / w)` at bit offset
//! `(i % (32 / w)) · w`; the last word of a row is zero-padded. Every code width is stored as one or two
//! planes, low bits first: 1, 2, 4 and 8 bits are one plane; 3 bits are a 2-bit plane then a 1-bit plane
//! (so 32 codes fill a packing unit of 2 + 1 words and no code straddles a word). Kitty's boosted codes
//! use the same split: a base plane for every channel and a high plane for the boosted ones.
//!
//! Words are stored little-endian, so byte `j` of a plane holds codes `j·8/w ..` — a GPU may read the
//! plane as bytes, words or 16-byte vectors alike.

use crate::RefError;

/// Bits in one packing word.
pub const WORD_BITS: usize = 32;

/// The plane widths a code width is stored as, low bits first.
pub fn planes(bits: u8) -> Result<&'static [u8], RefError> {
    match bits {
        1 => Ok(&[1]),
        2 => Ok(&[2]),
        3 => Ok(&[2, 1]),
        4 => Ok(&[4]),
        8 => Ok(&[8]),
        _ => Err(RefError::Mismatch(format!(
            "{bits}-bit codes have no packing (1, 2, 3, 4 or 8 bits)"
        ))),
    }
}

/// Words of one plane of `n` codes of width `width`.
pub fn plane_words(width: u8, n: usize) -> usize {
    (n * width as usize).div_ceil(WORD_BITS)
}

/// Words of one row of `n` codes of `bits` bits (all its planes).
pub fn row_words(bits: u8, n: usize) -> Result<usize, RefError> {
    Ok(planes(bits)?.iter().map(|&w| plane_words(w, n)).sum())
}

fn check_plane_width(width: u8) -> Result<(), RefError> {
    if matches!(width, 1 | 2 | 4 | 8) {
        Ok(())
    } else {
        Err(RefError::Mismatch(format!(
            "a plane is 1, 2, 4 or 8 bits wide, not {width}"
        )))
    }
}

/// Packs bits `shift .. shift + width` of every code into one plane (`out` must hold
/// [`plane_words`] words; it is overwritten, padding included).
pub fn pack_plane(codes: &[u8], width: u8, shift: u8, out: &mut [u32]) -> Result<(), RefError> {
    check_plane_width(width)?;
    let need = plane_words(width, codes.len());
    if out.len() != need {
        return Err(RefError::Mismatch(format!(
            "a {width}-bit plane of {} codes needs {need} words, got {}",
            codes.len(),
            out.len()
        )));
    }
    out.fill(0);
    let per_word = WORD_BITS / width as usize;
    let mask = (1u32 << width) - 1;
    for (i, &c) in codes.iter().enumerate() {
        let value = (u32::from(c) >> shift) & mask;
        out[i / per_word] |= value << ((i % per_word) * width as usize);
    }
    Ok(())
}

/// The `n` values of one plane of width `width`.
pub fn unpack_plane(words: &[u32], width: u8, n: usize) -> Result<Vec<u8>, RefError> {
    check_plane_width(width)?;
    let need = plane_words(width, n);
    if words.len() != need {
        return Err(RefError::Mismatch(format!(
            "a {width}-bit plane of {n} codes has {need} words, got {}",
            words.len()
        )));
    }
    let per_word = WORD_BITS / width as usize;
    let mask = (1u32 << width) - 1;
    Ok((0..n)
        .map(|i| ((words[i / per_word] >> ((i % per_word) * width as usize)) & mask) as u8)
        .collect())
}

/// Packs one row of `bits`-bit codes into its planes, low plane first.
pub fn pack_row(codes: &[u8], bits: u8) -> Result<Vec<u32>, RefError> {
    let widths = planes(bits)?;
    if let Some(&c) = codes.iter().find(|&&c| u32::from(c) >> bits != 0) {
        return Err(RefError::Mismatch(format!(
            "code {c} does not fit in {bits} bits"
        )));
    }
    let mut out = vec![0u32; row_words(bits, codes.len())?];
    let (mut at, mut shift) = (0, 0u8);
    for &w in widths {
        let n = plane_words(w, codes.len());
        pack_plane(codes, w, shift, &mut out[at..at + n])?;
        at += n;
        shift += w;
    }
    Ok(out)
}

/// Unpacks one row of `n` codes of `bits` bits.
pub fn unpack_row(words: &[u32], bits: u8, n: usize) -> Result<Vec<u8>, RefError> {
    let widths = planes(bits)?;
    let need = row_words(bits, n)?;
    if words.len() != need {
        return Err(RefError::Mismatch(format!(
            "a row of {n} {bits}-bit codes has {need} words, got {}",
            words.len()
        )));
    }
    let mut codes = vec![0u8; n];
    let (mut at, mut shift) = (0, 0u8);
    for &w in widths {
        let len = plane_words(w, n);
        for (c, v) in codes
            .iter_mut()
            .zip(unpack_plane(&words[at..at + len], w, n)?)
        {
            *c |= v << shift;
        }
        at += len;
        shift += w;
    }
    Ok(codes)
}

/// Writes words little-endian into `out` (which must be exactly `4 · words.len()` bytes).
pub fn write_words(words: &[u32], out: &mut [u8]) -> Result<(), RefError> {
    if out.len() != 4 * words.len() {
        return Err(RefError::Mismatch(format!(
            "{} words into {} bytes",
            words.len(),
            out.len()
        )));
    }
    for (chunk, w) in out.chunks_exact_mut(4).zip(words) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    Ok(())
}

/// Reads little-endian words from bytes (a whole number of words).
pub fn read_words(bytes: &[u8]) -> Result<Vec<u32>, RefError> {
    if bytes.len() % 4 != 0 {
        return Err(RefError::Mismatch(format!(
            "{} bytes are not a whole number of words",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_bit_codes_sit_at_documented_offsets() {
        let codes: Vec<u8> = (0..20).map(|i| (i % 4) as u8).collect();
        let words = pack_row(&codes, 2).unwrap();
        assert_eq!(words.len(), 2);
        // Codes 0..16 in word 0, code i at bits 2i.
        assert_eq!(words[0], 0b11100100_11100100_11100100_11100100);
        assert_eq!(words[1], 0b11100100);
    }

    #[test]
    fn three_bit_codes_are_a_two_bit_then_a_one_bit_plane() {
        let codes: Vec<u8> = (0..32).map(|i| (i % 8) as u8).collect();
        let words = pack_row(&codes, 3).unwrap();
        assert_eq!(words.len(), 3);
        let low: Vec<u8> = codes.iter().map(|c| c & 3).collect();
        let high: Vec<u8> = codes.iter().map(|c| c >> 2).collect();
        assert_eq!(words[..2], pack_row(&low, 2).unwrap()[..]);
        assert_eq!(words[2..], pack_row(&high, 1).unwrap()[..]);
    }

    #[test]
    fn bytes_are_little_endian() {
        let mut b = [0u8; 4];
        write_words(&[0x0403_0201], &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
        assert_eq!(read_words(&b).unwrap(), vec![0x0403_0201]);
    }

    #[test]
    fn bad_widths_and_oversized_codes_are_errors() {
        assert!(pack_row(&[1], 5).is_err());
        assert!(pack_row(&[4], 2).is_err());
        assert!(unpack_row(&[0, 0], 2, 3).is_err());
    }
}
