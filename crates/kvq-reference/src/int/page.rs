//! Quantizing one page of one KV head into its block bytes, and back (`docs/LAYOUT.md` §4).
//!
//! The reference's only path from values to dequantized values runs through these bytes, so what the
//! GPU kernels read is exactly what was tested here.

use super::boost;
use super::layout::{IntLayout, Section, NOT_BOOSTED};
use super::quantize::{GroupParams, Quantizer};
use crate::pack;
use crate::RefError;
use half::f16;
use kvq_spec::Axis;

/// Codes and parameters of a page before packing.
struct Quantized {
    /// `[page][head_dim]` codes at each group's own bits.
    codes: Vec<u8>,
    /// In scale order (see [`IntLayout::scales`]).
    params: Vec<GroupParams>,
    /// Channel → slot, or [`NOT_BOOSTED`] (empty without boost).
    map: Vec<u8>,
}

fn check_len(what: &str, got: usize, want: usize) -> Result<(), RefError> {
    if got == want {
        Ok(())
    } else {
        Err(RefError::Mismatch(format!(
            "{what}: {got} but the layout needs {want}"
        )))
    }
}

fn quantize_channels(l: &IntLayout, values: &[f32]) -> Result<Quantized, RefError> {
    let (p, d) = (l.page, l.head_dim);
    let map = match l.boost {
        None => Vec::new(),
        Some(b) => {
            let chosen = boost::select(values, p, d, b.channels, b.by);
            let mut slot = 0u8;
            chosen
                .iter()
                .map(|&on| {
                    if on {
                        slot += 1;
                        slot - 1
                    } else {
                        NOT_BOOSTED
                    }
                })
                .collect()
        }
    };
    let mut codes = vec![0u8; p * d];
    let mut params = Vec::with_capacity(d);
    let mut column = vec![0.0f32; p];
    for c in 0..d {
        let q = channel_quantizer(l, &map, c)?;
        for (t, x) in column.iter_mut().enumerate() {
            *x = values[t * d + c];
        }
        let gp = q.params(&column)?;
        for (t, &x) in column.iter().enumerate() {
            codes[t * d + c] = q.encode(x, gp);
        }
        params.push(gp);
    }
    Ok(Quantized { codes, params, map })
}

fn quantize_tokens(l: &IntLayout, values: &[f32]) -> Result<Quantized, RefError> {
    let mut codes = vec![0u8; values.len()];
    let mut params = Vec::with_capacity(l.scale_count());
    for (group, out) in values
        .chunks_exact(l.group)
        .zip(codes.chunks_exact_mut(l.group))
    {
        let gp = l.quant.params(group)?;
        for (c, &x) in out.iter_mut().zip(group) {
            *c = l.quant.encode(x, gp);
        }
        params.push(gp);
    }
    Ok(Quantized {
        codes,
        params,
        map: Vec::new(),
    })
}

/// The quantizer of channel `c`: boosted channels use the boost bits.
fn channel_quantizer(l: &IntLayout, map: &[u8], c: usize) -> Result<Quantizer, RefError> {
    match (l.boost, map.get(c)) {
        (Some(b), Some(&s)) if s != NOT_BOOSTED => Quantizer::new(b.bits, l.quant.symmetric),
        _ => Ok(l.quant),
    }
}

fn write_f16s(values: impl Iterator<Item = f16>, out: &mut [u8]) {
    for (chunk, h) in out.chunks_exact_mut(2).zip(values) {
        chunk.copy_from_slice(&h.to_bits().to_le_bytes());
    }
}

fn read_f16s(bytes: &[u8]) -> Vec<f16> {
    bytes
        .chunks_exact(2)
        .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

fn section<'a>(block: &'a [u8], s: &Section) -> &'a [u8] {
    &block[s.range()]
}

/// Quantizes `values` (`[page][head_dim]` of one head) into `block` (`block_bytes` bytes).
pub fn encode_page(l: &IntLayout, values: &[f32], block: &mut [u8]) -> Result<(), RefError> {
    check_len("page values", values.len(), l.page * l.head_dim)?;
    check_len("page block bytes", block.len(), l.block_bytes)?;
    let q = match l.axis {
        Axis::Channel => quantize_channels(l, values)?,
        Axis::Token => quantize_tokens(l, values)?,
    };
    block.fill(0);
    let base_mask = ((1u16 << l.quant.bits) - 1) as u8;
    let row_bytes = l.row_words * 4;
    let mut low = vec![0u8; l.head_dim];
    for (t, row) in q.codes.chunks_exact(l.head_dim).enumerate() {
        for (lo, &c) in low.iter_mut().zip(row) {
            *lo = c & base_mask;
        }
        let words = pack::pack_row(&low, l.quant.bits)?;
        let at = l.codes.offset + t * row_bytes;
        pack::write_words(&words, &mut block[at..at + row_bytes])?;
    }
    if let Some(b) = l.boost {
        let hb = b.high_row_words * 4;
        let mut high = vec![0u8; b.channels];
        let mut words = vec![0u32; b.high_row_words];
        for (t, row) in q.codes.chunks_exact(l.head_dim).enumerate() {
            for (c, &slot) in q.map.iter().enumerate() {
                if slot != NOT_BOOSTED {
                    high[usize::from(slot)] = row[c];
                }
            }
            pack::pack_plane(&high, b.high_bits, l.quant.bits, &mut words)?;
            let at = l.high.offset + t * hb;
            pack::write_words(&words, &mut block[at..at + hb])?;
        }
        block[l.map.range()].copy_from_slice(&q.map);
        let slots = &mut block[l.slots.range()];
        for (c, &slot) in q.map.iter().enumerate() {
            if slot != NOT_BOOSTED {
                slots[usize::from(slot)] = c as u8;
            }
        }
    }
    write_f16s(
        q.params.iter().map(|p| p.scale),
        &mut block[l.scales.range()],
    );
    if !l.quant.symmetric {
        write_f16s(q.params.iter().map(|p| p.zero), &mut block[l.zeros.range()]);
    }
    Ok(())
}

/// The boost index map of a block, checked: every slot below k, each used once, and the slot
/// table its inverse.
fn read_map(l: &IntLayout, block: &[u8]) -> Result<Vec<u8>, RefError> {
    let Some(b) = l.boost else {
        return Ok(Vec::new());
    };
    let map = section(block, &l.map).to_vec();
    let slots = section(block, &l.slots);
    let mut seen = vec![false; b.channels];
    for (c, &s) in map.iter().enumerate() {
        if s == NOT_BOOSTED {
            continue;
        }
        match seen.get_mut(usize::from(s)) {
            Some(used) if !*used => *used = true,
            _ => {
                return Err(RefError::Mismatch(format!(
                    "boost index map names slot {s} twice or beyond {} slots",
                    b.channels
                )))
            }
        }
        if usize::from(slots[usize::from(s)]) != c {
            return Err(RefError::Mismatch(format!(
                "boost slot table sends slot {s} to channel {}, the map to channel {c}",
                slots[usize::from(s)]
            )));
        }
    }
    Ok(map)
}

/// Dequantizes a block back to `[page][head_dim]` values.
pub fn decode_page(l: &IntLayout, block: &[u8]) -> Result<Vec<f32>, RefError> {
    check_len("page block bytes", block.len(), l.block_bytes)?;
    let (p, d) = (l.page, l.head_dim);
    let scales = read_f16s(section(block, &l.scales));
    let zeros = if l.quant.symmetric {
        vec![f16::ZERO; scales.len()]
    } else {
        read_f16s(section(block, &l.zeros))
    };
    let map = read_map(l, block)?;
    let codes_words = pack::read_words(section(block, &l.codes))?;
    let high_words = pack::read_words(section(block, &l.high))?;
    let mut out = vec![0.0f32; p * d];
    for t in 0..p {
        let row = &codes_words[t * l.row_words..(t + 1) * l.row_words];
        let mut codes = pack::unpack_row(row, l.quant.bits, d)?;
        if let Some(b) = l.boost {
            let hw = &high_words[t * b.high_row_words..(t + 1) * b.high_row_words];
            let high = pack::unpack_plane(hw, b.high_bits, b.channels)?;
            for (c, &slot) in map.iter().enumerate() {
                if slot != NOT_BOOSTED {
                    codes[c] |= high[usize::from(slot)] << l.quant.bits;
                }
            }
        }
        for (c, (&code, x)) in codes.iter().zip(&mut out[t * d..(t + 1) * d]).enumerate() {
            let i = match l.axis {
                Axis::Channel => c,
                Axis::Token => t * (d / l.group) + c / l.group,
            };
            let gp = GroupParams {
                scale: scales[i],
                zero: zeros[i],
            };
            *x = channel_quantizer(l, &map, c)?.decode(code, gp);
        }
    }
    Ok(out)
}

/// Writes `[rows][head_dim]` values as little-endian f16 (round to nearest even).
pub fn encode_fp16(values: &[f32], out: &mut [u8]) -> Result<(), RefError> {
    if out.len() < values.len() * 2 {
        return Err(RefError::Mismatch(format!(
            "{} f16 values into {} bytes",
            values.len(),
            out.len()
        )));
    }
    write_f16s(values.iter().map(|&x| f16::from_f32(x)), out);
    Ok(())
}

/// Reads `n` little-endian f16 values as f32.
pub fn decode_fp16(bytes: &[u8], n: usize) -> Result<Vec<f32>, RefError> {
    if bytes.len() < n * 2 {
        return Err(RefError::Mismatch(format!(
            "{n} f16 values from {} bytes",
            bytes.len()
        )));
    }
    Ok(read_f16s(&bytes[..n * 2])
        .into_iter()
        .map(f16::to_f32)
        .collect())
}
