//! Exact memory accounting of one sequence's cache (`docs/LAYOUT.md` §7): bytes per component as
//! allocated, and effective bits per K/V element including metadata and FP16 buffers.
//!
//! The numbers come from the same [`IntLayout`] the packer writes, so they equal the bytes of a built
//! [`IntCache`](crate::int::IntCache). Other schemes (codebooks, XQuant) build their own
//! [`TensorFootprint`]s — reusing [`tensor`] for integer-quantized tensors — and combine them in a
//! [`Footprint`].

use crate::int::{fp16_block_bytes, IntLayout};
use crate::regions::TokenRegions;
use crate::RefError;
use kvq_spec::{SchemeSpec, TensorQuant};
use std::ops::Add;

/// Bytes one cached tensor of a sequence occupies, by component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TensorFootprint {
    /// Dense code planes of quantized pages.
    pub codes: u64,
    /// Boost high planes.
    pub high_bits: u64,
    /// Boost index maps and their inverses (slot tables).
    pub index_maps: u64,
    /// f16 scales.
    pub scales: u64,
    /// f16 zeros.
    pub zeros: u64,
    /// Alignment padding inside page blocks.
    pub padding: u64,
    /// Whole FP16 pages (tensors stored as `fp16`).
    pub fp16_pages: u64,
    /// FP16 sink buffer at full capacity (`sink` tokens), even while fewer tokens are cached.
    pub sink_buffer: u64,
    /// FP16 tail ring at full capacity (`local + page` tokens).
    pub tail_buffer: u64,
    /// Anything else the scheme stores for this tensor (codes of codebook schemes, accumulators).
    pub other: u64,
    /// K or V elements this tensor stands for (`len · kv_heads · head_dim`), the denominator of
    /// bits per element.
    pub elements: u64,
}

impl TensorFootprint {
    /// All bytes of this tensor.
    pub fn bytes(&self) -> u64 {
        self.codes
            + self.high_bits
            + self.index_maps
            + self.scales
            + self.zeros
            + self.padding
            + self.fp16_pages
            + self.sink_buffer
            + self.tail_buffer
            + self.other
    }

    /// [`bytes`](Self::bytes), or `None` when the sum does not fit 64 bits.
    pub fn checked_bytes(&self) -> Option<u64> {
        [
            self.codes,
            self.high_bits,
            self.index_maps,
            self.scales,
            self.zeros,
            self.padding,
            self.fp16_pages,
            self.sink_buffer,
            self.tail_buffer,
            self.other,
        ]
        .iter()
        .try_fold(0u64, |a, &x| a.checked_add(x))
    }

    /// Quantization metadata: scales, zeros, index maps.
    pub fn metadata_bytes(&self) -> u64 {
        self.scales + self.zeros + self.index_maps
    }

    /// FP16 storage: pages, sink and tail.
    pub fn fp16_bytes(&self) -> u64 {
        self.fp16_pages + self.sink_buffer + self.tail_buffer
    }

    /// Bits per element (infinite when the tensor stands for no elements).
    pub fn bits_per_element(&self) -> f64 {
        bits(self.bytes(), self.elements)
    }
}

impl Add for TensorFootprint {
    type Output = TensorFootprint;
    fn add(self, o: Self) -> Self {
        TensorFootprint {
            codes: self.codes + o.codes,
            high_bits: self.high_bits + o.high_bits,
            index_maps: self.index_maps + o.index_maps,
            scales: self.scales + o.scales,
            zeros: self.zeros + o.zeros,
            padding: self.padding + o.padding,
            fp16_pages: self.fp16_pages + o.fp16_pages,
            sink_buffer: self.sink_buffer + o.sink_buffer,
            tail_buffer: self.tail_buffer + o.tail_buffer,
            other: self.other + o.other,
            elements: self.elements + o.elements,
        }
    }
}

fn bits(bytes: u64, elements: u64) -> f64 {
    if elements == 0 {
        return if bytes == 0 { 0.0 } else { f64::INFINITY };
    }
    8.0 * bytes as f64 / elements as f64
}

/// A whole sequence's cache: K, V and anything they share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Footprint {
    pub k: TensorFootprint,
    pub v: TensorFootprint,
    /// Bytes owned by neither tensor alone (e.g. codebooks shared by all sequences, if counted).
    pub shared: u64,
}

impl Footprint {
    pub fn total_bytes(&self) -> u64 {
        self.k.bytes() + self.v.bytes() + self.shared
    }

    /// K and V elements: `2 · len · kv_heads · head_dim` for a plain cache.
    pub fn elements(&self) -> u64 {
        self.k.elements + self.v.elements
    }

    /// Effective bits per element: total bits / (2 · len · kv_heads · head_dim).
    pub fn bits_per_element(&self) -> f64 {
        bits(self.total_bytes(), self.elements())
    }
}

/// Footprint of one `fp16` or `int(...)` tensor of `len` tokens stored as `spec` stores `quant`.
pub fn tensor(
    spec: &SchemeSpec,
    quant: &TensorQuant,
    head_dim: u32,
    kv_heads: u32,
    len: u64,
) -> Result<TensorFootprint, RefError> {
    let (d, h, page) = (head_dim as u64, kv_heads as u64, spec.page as u64);
    if page == 0 {
        return Err(RefError::Mismatch("a page of 0 tokens".into()));
    }
    // Every size is a product of user-given numbers: checked, so an absurd shape is an error
    // naming it rather than a wrapped (release) or panicking (debug) count.
    let mul = |xs: &[u64]| checked_product(xs, head_dim, kv_heads, len);
    let elements = mul(&[len, h, d])?;
    let f = match quant {
        TensorQuant::Fp16 => TensorFootprint {
            fp16_pages: mul(&[
                len.div_ceil(page),
                h,
                fp16_block_bytes(head_dim as usize, page as usize) as u64,
            ])?,
            elements,
            ..Default::default()
        },
        TensorQuant::Int(q) => {
            let l = IntLayout::new(q, head_dim as usize, spec.page as usize)?;
            let local = spec.local_of(quant) as u64;
            let r = TokenRegions::new(
                len as usize,
                spec.sink as usize,
                local as usize,
                page as usize,
            );
            let blocks = mul(&[r.pages as u64, h])?;
            TensorFootprint {
                codes: mul(&[blocks, l.codes.bytes as u64])?,
                high_bits: mul(&[blocks, l.high.bytes as u64])?,
                index_maps: mul(&[blocks, (l.map.bytes + l.slots.bytes) as u64])?,
                scales: mul(&[blocks, l.scales.bytes as u64])?,
                zeros: mul(&[blocks, l.zeros.bytes as u64])?,
                padding: mul(&[blocks, l.padding() as u64])?,
                sink_buffer: mul(&[h, spec.sink as u64, d, 2])?,
                tail_buffer: mul(&[h, local + page, d, 2])?,
                elements,
                ..Default::default()
            }
        }
        TensorQuant::Codebook(_) => {
            return Err(RefError::WrongEntryPoint(
                "codebook tensors are accounted by kvq_reference::commvq".into(),
            ))
        }
    };
    // bytes() adds the fields unchecked: a footprint is only made once their sum is known to fit.
    f.checked_bytes()
        .ok_or_else(|| overflow(head_dim, kv_heads, len))?;
    Ok(f)
}

/// The product of `xs`, or the error of a cache too large to count in 64 bits.
pub fn checked_product(
    xs: &[u64],
    head_dim: u32,
    kv_heads: u32,
    len: u64,
) -> Result<u64, RefError> {
    xs.iter()
        .try_fold(1u64, |a, &x| a.checked_mul(x))
        .ok_or_else(|| overflow(head_dim, kv_heads, len))
}

/// A cache whose size overflows 64 bits.
pub fn overflow(head_dim: u32, kv_heads: u32, len: u64) -> RefError {
    RefError::Alloc(crate::resources::AllocError::overflow(format!(
        "a cache of {len} tokens × {kv_heads} KV heads × head_dim {head_dim}"
    )))
}

/// Footprint of a K/V cache of `len` tokens for an integer or FP16 scheme.
pub fn scheme(
    spec: &SchemeSpec,
    head_dim: u32,
    kv_heads: u32,
    len: u64,
) -> Result<Footprint, RefError> {
    spec.check_shape(head_dim, kv_heads)?;
    let f = Footprint {
        k: tensor(spec, &spec.k, head_dim, kv_heads, len)?,
        v: tensor(spec, &spec.v, head_dim, kv_heads, len)?,
        shared: 0,
    };
    // total_bytes() and elements() add unchecked: both sums are checked here.
    f.k.bytes()
        .checked_add(f.v.bytes())
        .and(f.k.elements.checked_add(f.v.elements))
        .ok_or_else(|| overflow(head_dim, kv_heads, len))?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp16_is_sixteen_bits_on_whole_pages() {
        let spec = SchemeSpec::parse("k = fp16, v = fp16").unwrap();
        let f = scheme(&spec, 128, 8, 1024).unwrap();
        assert_eq!(f.bits_per_element(), 16.0);
        assert_eq!(f.total_bytes(), 2 * 1024 * 8 * 128 * 2);
    }

    #[test]
    fn kitty_long_sequences_approach_the_page_rate() {
        let spec = SchemeSpec::parse(
            "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 128), sink = 32",
        )
        .unwrap();
        let f = scheme(&spec, 128, 1, 1 << 20).unwrap();
        // K pages 2.5703 bits, V pages 2.25 bits.
        assert!(
            (f.bits_per_element() - 2.40625).abs() < 0.01,
            "{}",
            f.bits_per_element()
        );
        // The worked example of docs/LAYOUT.md §6.
        let f = scheme(&spec, 128, 8, 1024).unwrap();
        assert_eq!(
            f.k.codes + f.k.high_bits + f.k.scales + f.k.zeros + f.k.index_maps,
            294_784
        );
        assert_eq!((f.k.sink_buffer, f.k.tail_buffer), (65_536, 262_144));
        assert_eq!(f.v.bytes(), 221_184 + 65_536 + 524_288);
        assert_eq!(f.total_bytes(), 1_433_472);
    }
}
