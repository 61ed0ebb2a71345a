//! A codebook scheme's buffers in an engine's memory: the cache's sizes for an engine's limits
//! ([`CodebookSizes`]) and the one device buffer that holds a layer's codebooks and encoder tables
//! ([`CodebookBufferLayout`]), whose sizes follow from the scheme and shape alone, so an engine can
//! allocate it before any codebook is read.

use crate::error::{Result, RuntimeError};
use crate::paged::CacheSizes;
use kvq_codegen::CODEBOOK_STATUS_WORDS;
use kvq_reference::commvq::device::{DeviceCodebooks, DeviceLayout, SideKind, SideLayout};
use kvq_reference::commvq::{Codebooks, EncoderTables, SideTables};
use kvq_spec::SchemeSpec;

/// Alignment of each section of the codebook buffer (what `cudaMalloc` gives the buffer itself).
const SECTION_ALIGN: usize = 256;

/// Sections of the codebook buffer, in order: the decode's tensors (`DeviceCodebooks`), then each
/// side's five encoder tables (`kvq_reference::commvq::encoder`; an FP16 side's are empty).
pub const CODEBOOK_SECTIONS: [&str; 15] = [
    "k_book", "k_rows", "k_mean", "v_rows", "v_mean", "k_t0", "k_t1", "k_t2", "k_t3", "k_t4",
    "v_t0", "v_t1", "v_t2", "v_t3", "v_t4",
];

/// Where each section of a layer's codebook buffer lies: byte offsets from the buffer's start and
/// element counts (u32 for `k_book`, f32 for the other decode tensors, f64 for encoder tables).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodebookBufferLayout {
    /// Byte offset of each of [`CODEBOOK_SECTIONS`].
    pub offsets: [usize; 15],
    /// Elements of each section.
    pub elements: [usize; 15],
    /// Bytes of the whole buffer.
    pub bytes: usize,
}

/// Element sizes of the sections.
const ELEMENT_BYTES: [usize; 15] = [4, 4, 4, 4, 4, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8];

/// Elements of a side's five encoder tables: RoPE keys (c, ic, norm, cross), additive (rows,
/// norm, pair_cross, mean, scale), as `kvq_reference::commvq::encoder` builds them.
fn table_elements(side: &SideLayout, kv_heads: usize) -> [usize; 5] {
    let d = side.head_dim;
    match side.kind {
        SideKind::Fp16 => [0; 5],
        SideKind::Rope {
            levels,
            residuals,
            pairs_per_code,
            groups,
            ..
        } => {
            let rounds = kv_heads * groups * residuals;
            [
                rounds * levels * 2 * pairs_per_code,
                rounds * levels * 2 * pairs_per_code,
                rounds * levels,
                rounds * levels * levels,
                0,
            ]
        }
        SideKind::Additive { rows } => [
            kv_heads * rows * d,
            kv_heads * rows,
            kv_heads * rows / 2,
            kv_heads * d,
            kv_heads * d,
        ],
    }
}

impl CodebookBufferLayout {
    /// The sections for `layout` (a scheme at one shape).
    pub fn new(layout: &DeviceLayout) -> Self {
        let (h, d) = (layout.kv_heads, layout.head_dim);
        let rows = |side: &SideLayout| match side.kind {
            SideKind::Additive { rows } => (h * rows * d, h * d),
            _ => (0, 0),
        };
        let k_book = match layout.k.kind {
            SideKind::Rope {
                levels,
                residuals,
                pairs_per_code,
                groups,
                ..
            } => h * groups * residuals * levels * pairs_per_code,
            _ => 0,
        };
        let (k_rows, k_mean) = rows(&layout.k);
        let (v_rows, v_mean) = rows(&layout.v);
        let mut elements = [0usize; 15];
        elements[..5].copy_from_slice(&[k_book, k_rows, k_mean, v_rows, v_mean]);
        elements[5..10].copy_from_slice(&table_elements(&layout.k, h));
        elements[10..].copy_from_slice(&table_elements(&layout.v, h));
        let mut offsets = [0usize; 15];
        let mut at = 0usize;
        for i in 0..15 {
            offsets[i] = at;
            at += (elements[i] * ELEMENT_BYTES[i]).next_multiple_of(SECTION_ALIGN);
        }
        Self {
            offsets,
            elements,
            bytes: at.max(SECTION_ALIGN),
        }
    }

    /// The buffer's bytes for `codebooks` (trained for `spec` at this shape; others are refused),
    /// little-endian, ready to copy to the device.
    pub fn pack(
        &self,
        spec: &SchemeSpec,
        codebooks: &Codebooks,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Vec<u8>> {
        let books = DeviceCodebooks::new(spec, codebooks, kv_heads, head_dim)?;
        let tables = EncoderTables::new(spec, codebooks, kv_heads, head_dim)?;
        let mut out = vec![0u8; self.bytes];
        let mut put = |i: usize, bytes: Vec<u8>| -> Result<()> {
            if bytes.len() != self.elements[i] * ELEMENT_BYTES[i] {
                return Err(RuntimeError::InvalidInput(format!(
                    "codebook section {} holds {} bytes, the layout has {}",
                    CODEBOOK_SECTIONS[i],
                    bytes.len(),
                    self.elements[i] * ELEMENT_BYTES[i]
                )));
            }
            out[self.offsets[i]..][..bytes.len()].copy_from_slice(&bytes);
            Ok(())
        };
        put(
            0,
            books.k_rope.iter().flat_map(|w| w.to_le_bytes()).collect(),
        )?;
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        put(1, f32s(&books.k_rows_scaled))?;
        put(2, f32s(&books.k_mean))?;
        put(3, f32s(&books.v_rows_scaled))?;
        put(4, f32s(&books.v_mean))?;
        for (first, side) in [(5, &tables.k), (10, &tables.v)] {
            let t: [&[f64]; 5] = match side {
                SideTables::Fp16 => [&[]; 5],
                SideTables::Rope(r) => [&r.c, &r.ic, &r.norm, &r.cross, &[]],
                SideTables::Additive(a) => [&a.rows, &a.norm, &a.pair_cross, &a.mean, &a.scale],
            };
            for (j, values) in t.iter().enumerate() {
                put(
                    first + j,
                    values.iter().flat_map(|x| x.to_le_bytes()).collect(),
                )?;
            }
        }
        Ok(out)
    }
}

/// The sizes of a codebook scheme's engine cache: the buffers it shares in kind with the integer
/// schemes ([`CacheSizes`]: pools, sinks, tail rings, page table) and its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CodebookSizes {
    /// The buffers shared in kind with the integer schemes.
    pub cache: CacheSizes,
    /// The device layout (blocks, rings) the kernels read.
    pub layout: DeviceLayout,
    /// `[sequence slot][kv_head][tail ring][head_dim]` 16-bit inputs of K's tokens not yet coded.
    pub k_pending_halves: usize,
    /// As `k_pending_halves`, for V.
    pub v_pending_halves: usize,
    /// `[sequence slot][CODEBOOK_STATUS_WORDS]` u32: what the encoders found wrong, per slot.
    pub status_words: usize,
    /// The layer's codebook buffer.
    pub codebooks: CodebookBufferLayout,
}

impl CodebookSizes {
    /// Sizes for `max_seqs` sequence slots of at most `max_tokens` tokens, `pool_pages` pool pages
    /// of `kv_heads` heads of `head_dim`; a scheme the device layout refuses or sizes past the
    /// address space are errors.
    pub fn new(
        spec: &SchemeSpec,
        kv_heads: usize,
        head_dim: usize,
        max_seqs: usize,
        pool_pages: usize,
        max_tokens: usize,
    ) -> Result<Self> {
        let layout = DeviceLayout::new(spec, kv_heads, head_dim)?;
        let too_big = || {
            RuntimeError::InvalidInput(format!(
                "a codebook cache of {max_seqs} slots, {pool_pages} pages and {max_tokens} tokens \
                 overflows the address space"
            ))
        };
        let n = |dims: &[usize]| -> Result<usize> {
            dims.iter()
                .try_fold(1usize, |a, &x| a.checked_mul(x))
                .ok_or_else(too_big)
        };
        let coded = |side: &SideLayout, rows: usize| if side.is_coded() { rows } else { 0 };
        let (k, v) = (&layout.k, &layout.v);
        let max_pages = k.pages(max_tokens).max(v.pages(max_tokens)).max(1);
        let cache = CacheSizes {
            k_block_bytes: k.block_bytes,
            v_block_bytes: v.block_bytes,
            page_tokens: layout.page,
            max_pages,
            k_pool_bytes: n(&[pool_pages, kv_heads, k.block_bytes])?,
            v_pool_bytes: n(&[pool_pages, kv_heads, v.block_bytes])?,
            k_sink_tokens: coded(k, k.sink),
            v_sink_tokens: coded(v, v.sink),
            k_ring_tokens: coded(k, k.tail_cap),
            v_ring_tokens: coded(v, v.tail_cap),
            k_sink_halves: n(&[max_seqs, kv_heads, coded(k, k.sink), head_dim])?,
            v_sink_halves: n(&[max_seqs, kv_heads, coded(v, v.sink), head_dim])?,
            k_tail_halves: n(&[max_seqs, kv_heads, coded(k, k.tail_cap), head_dim])?,
            v_tail_halves: n(&[max_seqs, kv_heads, coded(v, v.tail_cap), head_dim])?,
            page_table_entries: n(&[max_seqs, max_pages])?,
        };
        if i32::try_from(max_pages).is_err() || i32::try_from(pool_pages).is_err() {
            return Err(too_big());
        }
        Ok(Self {
            cache,
            layout,
            k_pending_halves: cache.k_tail_halves,
            v_pending_halves: cache.v_tail_halves,
            status_words: n(&[max_seqs, CODEBOOK_STATUS_WORDS])?,
            codebooks: CodebookBufferLayout::new(&layout),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq_reference::commvq::{self, CalibrationData, TrainOptions};
    use kvq_reference::synth::{generate, SynthConfig};

    /// The sections' sizes, known from the scheme alone, are exactly what packing trained
    /// codebooks fills, for every kind of side (RoPE keys per head and per token, additive keys
    /// and values, FP16); a wrong count in `table_elements` fails `pack`.
    #[test]
    fn sections_fit_packed_codebooks() {
        let kv_heads = 2;
        for (text, d) in [
            ("k = codebook(rope_commutative, levels = 64, residuals = 2, pairs_per_code = 32), v = codebook(additive, rows = 64)", 64usize),
            (
                "k = codebook(rope_commutative, levels = 16, residuals = 3, pairs_per_code = 32, span = token), \
                 v = codebook(additive, rows = 64), sink = 16, local = 32, page = 64",
                64,
            ),
            ("k = codebook(additive, rows = 32), v = fp16, page = 32", 64),
            ("k = fp16, v = codebook(additive, rows = 128), sink = 8", 128),
        ] {
            let spec: SchemeSpec = text.parse().unwrap();
            let cal = generate(&SynthConfig {
                tokens: 256,
                kv_heads,
                gqa: 1,
                head_dim: d,
                d_model: 128,
                seed: 7,
                ..Default::default()
            });
            let data = CalibrationData {
                k_pre_rope: &cal.k_pre_rope,
                v: &cal.v,
                rope: cal.rope,
            };
            let books = commvq::train_with(&spec, &data, &TrainOptions::quick(7)).unwrap();
            let layout = DeviceLayout::new(&spec, kv_heads, d).unwrap();
            let buffer = CodebookBufferLayout::new(&layout);
            let bytes = buffer.pack(&spec, &books, kv_heads, d).unwrap();
            assert_eq!(bytes.len(), buffer.bytes, "{text}");
            assert!(buffer.elements.iter().any(|&e| e > 0), "{text}");
            for i in 1..15 {
                assert_eq!(buffer.offsets[i] % SECTION_ALIGN, 0);
                assert!(buffer.offsets[i] >= buffer.offsets[i - 1] + buffer.elements[i - 1] * ELEMENT_BYTES[i - 1]);
            }
            // Codebooks of another shape are refused, not packed into the wrong sections.
            assert!(buffer.pack(&spec, &books, kv_heads + 1, d).is_err(), "{text}");
        }
    }
}
