//! The paged device layout of a CommVQ cache ([`DEVICE_LAYOUT_VERSION`]): the arrays a GPU decode
//! kernel reads, produced from a reference [`CommVqCache`], and [`device_attend`], an f64 decode
//! attention that reads *only* those arrays — the executable specification the kernel follows.
//!
//! The reference stores a page of all KV heads together (`Stored::codes()`); a paged GPU cache wants one
//! block per (physical page, KV head), as the integer schemes have (`docs/LAYOUT.md` §5), so that a
//! page table can point at blocks of a shared pool. Per tensor side (K or V), little-endian, every
//! section at a multiple of 16 bytes and every block a multiple of 16 bytes:
//!
//! - **FP16 side**: block `(p, h)` is the `P × D` f16 rows of tokens `p·P ..` (row `t % P` of page
//!   `t / P`), rows past the sequence zero; no sink or tail buffer.
//! - **RoPE-commutative keys**: block `(p, h)` holds head `h`'s `[group][round]` code streams of the
//!   reference's coded page `p` (bit-identical: `w = 2·log2 N'` bits a code, LSB first), then `P` f16
//!   scales (`span = token`: the token's one scale, repeated in every head's block).
//! - **Additive, `span = head`**: block `(p, h)` holds book `h`'s codes `[word][token]`, then its `P` f16
//!   factors `w`. A token-wide book (`span = token`) is not in this layout yet.
//! - **FP16 tokens of a coded side** (keys after RoPE): a sink `[H][S][D]` (`S = spec.sink`) and a tail
//!   ring `[H][local + P][D]`, token `t` at slot `(t − sink_end) mod (local + P)`, unused slots zero.
//!
//! Codebooks are per-layer device tensors ([`DeviceCodebooks`]): RoPE entries as packed f16 complex
//! numbers, additive rows pre-multiplied by the channel scale σ (exact in f32), and the mean μ.

use super::additive::AdditiveCodebook;
use super::cache::{coding, Coding, CommVqCache, Stored};
use super::key::KeyCodebook;
use super::layout::stream_words;
use super::train::Codebooks;
use crate::attention::{calibrate_score, Queries};
use crate::int::{align, Section};
use crate::regions::TokenRegions;
use crate::resources;
use crate::rope::Rope;
use crate::RefError;
use half::f16;
use kvq_spec::{
    CacheSource, Calibration, Codebook, CodebookQuant, CodebookSpan, SchemeSpec, TensorQuant,
};
use std::ops::Range;

/// Version of the layout this module defines; bumped on any change a kernel would notice.
pub const DEVICE_LAYOUT_VERSION: &str = "kvq-codebook-layout-1";

/// How one tensor side is held on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SideKind {
    /// Every token in FP16 pages.
    Fp16,
    /// RoPE-commutative codes of the keys before RoPE.
    Rope {
        /// `N'`: entries per pair, per round.
        levels: usize,
        residuals: usize,
        pairs_per_code: usize,
        /// Groups of `pairs_per_code` pairs per head (`D / 2g`).
        groups: usize,
        /// Bits of one code, `2·log2 N'` (`a` high, `b` low).
        code_bits: u32,
        /// Words of one `[group][round]` stream of `P` codes.
        stream_words: usize,
        /// Which vector a scale belongs to; a block holds one scale per token either way.
        span: CodebookSpan,
    },
    /// Binary additive codes of one KV head (`span = head`).
    Additive { rows: usize },
}

/// Offsets and sizes of one side's block and FP16 buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SideLayout {
    pub kind: SideKind,
    /// Tokens per page (`P`).
    pub page: usize,
    pub head_dim: usize,
    /// Bytes of one (page, KV head) block, a multiple of 16.
    pub block_bytes: usize,
    /// FP16 side: the `P × D` f16 rows (empty for a coded side).
    pub rows: Section,
    /// Coded side: the head's code words (empty for an FP16 side).
    pub codes: Section,
    /// Coded side: `P` f16 scales (RoPE keys) or factors (additive); empty for an FP16 side.
    pub scales: Section,
    /// FP16 recent window of a coded side (`spec.local_of`); 0 for an FP16 side.
    pub local: usize,
    /// Sink buffer rows per KV head (`spec.sink`); 0 for an FP16 side.
    pub sink: usize,
    /// Tail ring rows per KV head (`local + P`); 0 for an FP16 side.
    pub tail_cap: usize,
}

/// Where a token of one side lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenSlot {
    /// Row `row` of page `page` (an FP16 page, or a coded page's token `row`).
    Page { page: usize, row: usize },
    /// Row of the FP16 sink buffer.
    Sink(usize),
    /// Slot of the FP16 tail ring.
    Tail(usize),
}

/// Which tensor a side stores (for the rules that differ, and for messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    K,
    V,
}

impl Which {
    fn name(self) -> &'static str {
        match self {
            Which::K => "k",
            Which::V => "v",
        }
    }
}

fn overflow(what: &str) -> RefError {
    RefError::Mismatch(format!("{what} of the device layout overflows"))
}

/// The product of `dims`, refused on overflow (hand-built schemes may ask for anything).
fn product(dims: &[usize], what: &str) -> Result<usize, RefError> {
    resources::product(dims).ok_or_else(|| overflow(what))
}

/// Sections of a coded block: codes at 0, then `P` f16 scales at the next multiple of 16.
fn coded_sections(code_bytes: usize, page: usize) -> Result<(Section, Section, usize), RefError> {
    let codes = Section {
        offset: 0,
        bytes: code_bytes,
    };
    let scales = Section {
        offset: align(code_bytes),
        bytes: product(&[page, 2], "a page's scales")?,
    };
    let end = scales
        .offset
        .checked_add(scales.bytes)
        .ok_or_else(|| overflow("a block"))?;
    Ok((codes, scales, align(end)))
}

/// The kind of a codebook side, with its code bytes per (page, head) block.
fn coded_kind(
    c: &CodebookQuant,
    which: Which,
    head_dim: usize,
    page: usize,
) -> Result<(SideKind, usize), RefError> {
    match c.codebook {
        Codebook::RopeCommutative {
            levels,
            residuals,
            pairs_per_code,
        } => {
            let (levels, residuals, g) =
                (levels as usize, residuals as usize, pairs_per_code as usize);
            if which != Which::K {
                return Err(RefError::WrongEntryPoint(
                    "values cannot use a RoPE-commutative codebook".into(),
                ));
            }
            if levels < 2 || !levels.is_power_of_two() || g == 0 || head_dim % (2 * g) != 0 {
                return Err(RefError::Mismatch(format!(
                    "`k`: {levels} levels and {g} pairs per code have no device layout at head_dim {head_dim}"
                )));
            }
            let code_bits = 2 * levels.trailing_zeros();
            let stream = stream_words(page, code_bits);
            let groups = head_dim / (2 * g);
            let kind = SideKind::Rope {
                levels,
                residuals,
                pairs_per_code: g,
                groups,
                code_bits,
                stream_words: stream,
                span: c.span,
            };
            Ok((
                kind,
                product(&[groups, residuals, stream, 4], "a head's key codes")?,
            ))
        }
        Codebook::Additive { rows } => {
            let rows = rows as usize;
            if c.span == CodebookSpan::Token {
                return Err(RefError::WrongEntryPoint(format!(
                    "`{} = codebook(additive, span = token)`: token-wide additive codebooks are not in the \
                     device layout ({DEVICE_LAYOUT_VERSION}) yet (a block holds one KV head, a token-wide code \
                     spans them all); use `span = head`",
                    which.name()
                )));
            }
            if rows == 0 || rows % 32 != 0 {
                return Err(RefError::Mismatch(format!(
                    "`{}`: {rows} additive rows are not a positive multiple of 32",
                    which.name()
                )));
            }
            let bytes = product(&[rows / 32, page, 4], "a head's additive codes")?;
            Ok((SideKind::Additive { rows }, bytes))
        }
    }
}

impl SideLayout {
    /// The layout of `spec`'s `which` side.
    fn new(spec: &SchemeSpec, which: Which, head_dim: usize) -> Result<Self, RefError> {
        let t = match which {
            Which::K => &spec.k,
            Which::V => &spec.v,
        };
        let page = spec.page as usize;
        if page == 0 || head_dim == 0 {
            return Err(RefError::Mismatch(format!(
                "a page of {page} tokens × {head_dim} channels holds nothing"
            )));
        }
        match t {
            TensorQuant::Fp16 => Self::fp16(page, head_dim),
            TensorQuant::Int(_) => Err(RefError::WrongEntryPoint(format!(
                "`{}` is integer-quantized: its device layout is docs/LAYOUT.md's, not CommVQ's",
                which.name()
            ))),
            TensorQuant::Codebook(c) => {
                let (kind, code_bytes) = coded_kind(c, which, head_dim, page)?;
                let (codes, scales, block_bytes) = coded_sections(code_bytes, page)?;
                let local = spec.local_of(t) as usize;
                Ok(Self {
                    kind,
                    page,
                    head_dim,
                    block_bytes,
                    rows: Section::default(),
                    codes,
                    scales,
                    local,
                    sink: spec.sink as usize,
                    tail_cap: local
                        .checked_add(page)
                        .ok_or_else(|| overflow("the tail"))?,
                })
            }
        }
    }

    fn fp16(page: usize, head_dim: usize) -> Result<Self, RefError> {
        let rows = Section {
            offset: 0,
            bytes: product(&[page, head_dim, 2], "an FP16 page")?,
        };
        Ok(Self {
            kind: SideKind::Fp16,
            page,
            head_dim,
            block_bytes: align(rows.bytes),
            rows,
            codes: Section::default(),
            scales: Section::default(),
            local: 0,
            sink: 0,
            tail_cap: 0,
        })
    }

    /// Whether the side is coded (has a sink, coded pages and a tail) rather than all FP16.
    pub fn is_coded(&self) -> bool {
        self.kind != SideKind::Fp16
    }

    /// The sink / coded pages / tail split of a coded side at `len` tokens (the integer schemes' rule).
    pub fn regions(&self, len: usize) -> TokenRegions {
        TokenRegions::new(len, self.sink, self.local, self.page)
    }

    /// Pages (blocks per KV head) at `len` tokens: `ceil(len / P)` for an FP16 side, the coded pages
    /// otherwise.
    pub fn pages(&self, len: usize) -> usize {
        if self.is_coded() {
            self.regions(len).pages
        } else {
            len.div_ceil(self.page)
        }
    }

    /// Where token `t` of a sequence of `len` tokens lives.
    pub fn locate(&self, len: usize, t: usize) -> TokenSlot {
        if !self.is_coded() {
            return TokenSlot::Page {
                page: t / self.page,
                row: t % self.page,
            };
        }
        let r = self.regions(len);
        if t < r.sink_end {
            TokenSlot::Sink(t)
        } else if r.is_quantized(t) {
            let i = t - r.sink_end;
            TokenSlot::Page {
                page: i / self.page,
                row: i % self.page,
            }
        } else {
            TokenSlot::Tail((t - r.sink_end) % self.tail_cap)
        }
    }

    /// Whether token `t` is in a coded page (its score is calibrated where the scheme asks).
    fn is_coded_token(&self, len: usize, t: usize) -> bool {
        self.is_coded() && self.regions(len).is_quantized(t)
    }
}

/// The device layout of a scheme at one shape: both sides plus what attention needs of the scheme.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceLayout {
    pub k: SideLayout,
    pub v: SideLayout,
    /// Tokens per page (`spec.page`).
    pub page: usize,
    /// `spec.sink`: the sink rows of a coded side.
    pub sink: usize,
    pub head_dim: usize,
    pub kv_heads: usize,
    /// CalibQuant's calibration of the coded keys' scores, if the scheme asks for it.
    pub calibrate: Option<Calibration>,
}

impl DeviceLayout {
    /// The layout of `spec` for `kv_heads` heads of `head_dim` channels (needs no codebook: every size
    /// follows from the scheme's codebook shapes).
    pub fn new(spec: &SchemeSpec, kv_heads: usize, head_dim: usize) -> Result<Self, RefError> {
        if spec.source != CacheSource::Kv {
            return Err(RefError::WrongEntryPoint(
                "this scheme caches layer activations: its device layout is XQuant's".into(),
            ));
        }
        spec.check_shape_usize(head_dim, kv_heads)?;
        Ok(Self {
            k: SideLayout::new(spec, Which::K, head_dim)?,
            v: SideLayout::new(spec, Which::V, head_dim)?,
            page: spec.page as usize,
            sink: spec.sink as usize,
            head_dim,
            kv_heads,
            calibrate: spec.calibrate,
        })
    }

    /// Byte range of block (page, KV head) in a side's `blocks` (`[page][kv_head][block_bytes]`).
    pub fn block_range(&self, side: &SideLayout, page: usize, head: usize) -> Range<usize> {
        let start = (page * self.kv_heads + head) * side.block_bytes;
        start..start + side.block_bytes
    }

    /// Element range of (KV head, row) in a side's sink buffer.
    pub fn sink_row(&self, side: &SideLayout, head: usize, row: usize) -> Range<usize> {
        let start = (head * side.sink + row) * self.head_dim;
        start..start + self.head_dim
    }

    /// Element range of (KV head, slot) in a side's tail ring.
    pub fn tail_row(&self, side: &SideLayout, head: usize, slot: usize) -> Range<usize> {
        let start = (head * side.tail_cap + slot) * self.head_dim;
        start..start + self.head_dim
    }
}

/// One side of a sequence on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceTensor {
    /// `[page][kv_head][block_bytes]`.
    pub blocks: Vec<u8>,
    /// Pages (blocks per KV head).
    pub pages: usize,
    /// f16 bits `[kv_head][sink][head_dim]` (empty for an FP16 side).
    pub sink: Vec<u16>,
    /// f16 bits `[kv_head][tail_cap][head_dim]` ring (empty for an FP16 side).
    pub tail: Vec<u16>,
}

/// A sequence's cache in the device layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSequence {
    pub k: DeviceTensor,
    pub v: DeviceTensor,
    /// Tokens in the sequence.
    pub len: usize,
}

/// The codebooks as per-layer device tensors, shared by all sequences; empty where a side has none.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeviceCodebooks {
    /// RoPE keys `[kv_head][group][round][entry][pair]`, each `f16(re) | f16(im) << 16`.
    pub k_rope: Vec<u32>,
    /// Additive keys `[kv_head][row][D]`: `C[row][c]·σ[c]` (exact in f32).
    pub k_rows_scaled: Vec<f32>,
    /// Additive keys `[kv_head][D]`: μ.
    pub k_mean: Vec<f32>,
    /// Additive values `[kv_head][row][D]`: `C[row][c]·σ[c]`.
    pub v_rows_scaled: Vec<f32>,
    /// Additive values `[kv_head][D]`: μ.
    pub v_mean: Vec<f32>,
}

fn put_u16(out: &mut [u8], at: usize, bits: u16) {
    out[at..at + 2].copy_from_slice(&bits.to_le_bytes());
}

fn put_u32(out: &mut [u8], at: usize, word: u32) {
    out[at..at + 4].copy_from_slice(&word.to_le_bytes());
}

/// f16 bits of `token`'s FP16 row in `head` (the token must not be in a coded page).
fn stored_fp16_row(s: &Stored, head: usize, token: usize, d: usize) -> &[u16] {
    let r = s.regions();
    let tokens = r.sink().len() + r.tail().len();
    let index = if token < r.sink_end {
        token
    } else {
        token - r.quantized().len()
    };
    &s.fp16()[(head * tokens + index) * d..][..d]
}

impl CommVqCache {
    /// The device layout of this cache's scheme and shape.
    pub fn device_layout(&self) -> Result<DeviceLayout, RefError> {
        DeviceLayout::new(&self.spec, self.kv_heads, self.head_dim)
    }

    /// This sequence in the device layout (bit-identical codes, scales and FP16 rows).
    pub fn device_sequence(&self) -> Result<DeviceSequence, RefError> {
        let layout = self.device_layout()?;
        Ok(DeviceSequence {
            k: device_tensor(&layout, &layout.k, &self.k, self.tokens)?,
            v: device_tensor(&layout, &layout.v, &self.v, self.tokens)?,
            len: self.tokens,
        })
    }

    /// The codebooks this cache holds as device tensors; refuses values a device f16 cannot hold exactly.
    pub fn device_codebooks(&self) -> Result<DeviceCodebooks, RefError> {
        DeviceCodebooks::of_codings(&self.k.coding, &self.v.coding)
    }
}

impl DeviceCodebooks {
    /// A layer's `codebooks` as device tensors for `spec` at `kv_heads` heads of `head_dim` (what a
    /// cache built by the GPU, with no reference cache to ask, holds); refuses codebooks of another
    /// scheme or shape, and values a device f16 cannot hold exactly.
    pub fn new(
        spec: &SchemeSpec,
        codebooks: &Codebooks,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self, RefError> {
        let k = coding(&spec.k, codebooks.k.as_ref(), "k", kv_heads, head_dim)?;
        let v = coding(&spec.v, codebooks.v.as_ref(), "v", kv_heads, head_dim)?;
        Self::of_codings(&k, &v)
    }

    fn of_codings(k: &Coding, v: &Coding) -> Result<Self, RefError> {
        let mut books = DeviceCodebooks::default();
        match k {
            Coding::Fp16 => {}
            Coding::Rope { codebook, .. } => books.k_rope = pack_rope(codebook)?,
            Coding::Additive(cb) => (books.k_rows_scaled, books.k_mean) = scale_rows(cb, Which::K)?,
        }
        match v {
            Coding::Fp16 => {}
            Coding::Rope { .. } => {
                return Err(RefError::WrongEntryPoint(
                    "values cannot use a RoPE-commutative codebook".into(),
                ))
            }
            Coding::Additive(cb) => (books.v_rows_scaled, books.v_mean) = scale_rows(cb, Which::V)?,
        }
        Ok(books)
    }
}

fn device_tensor(
    layout: &DeviceLayout,
    side: &SideLayout,
    s: &Stored,
    len: usize,
) -> Result<DeviceTensor, RefError> {
    check_coding(side, s)?;
    if side.is_coded() {
        coded_tensor(layout, side, s, len)
    } else {
        fp16_tensor(layout, side, s, len)
    }
}

/// The layout comes from the scheme and the storage from the codebooks: they must name the same coding.
fn check_coding(side: &SideLayout, s: &Stored) -> Result<(), RefError> {
    let agree = matches!(
        (&side.kind, s.coding()),
        (SideKind::Fp16, Coding::Fp16)
            | (SideKind::Rope { .. }, Coding::Rope { .. })
            | (SideKind::Additive { .. }, Coding::Additive(_))
    );
    if agree {
        Ok(())
    } else {
        let stored = match s.coding() {
            Coding::Fp16 => "FP16",
            Coding::Rope { .. } => "RoPE-commutative codes",
            Coding::Additive(_) => "additive codes",
        };
        Err(RefError::Mismatch(format!(
            "the device layout is {:?} but the cache stores {stored}",
            side.kind
        )))
    }
}

/// An FP16 side: every token's row into its page block.
fn fp16_tensor(
    layout: &DeviceLayout,
    side: &SideLayout,
    s: &Stored,
    len: usize,
) -> Result<DeviceTensor, RefError> {
    let (h, d) = (layout.kv_heads, layout.head_dim);
    let pages = side.pages(len);
    let mut blocks =
        resources::try_vec_of(&[pages, h, side.block_bytes], 0u8, "the FP16 page pool")?;
    for head in 0..h {
        for t in 0..len {
            let block = layout.block_range(side, t / side.page, head).start;
            let at = block + side.rows.offset + (t % side.page) * d * 2;
            for (c, bits) in stored_fp16_row(s, head, t, d).iter().enumerate() {
                put_u16(&mut blocks, at + 2 * c, *bits);
            }
        }
    }
    Ok(DeviceTensor {
        blocks,
        pages,
        sink: Vec::new(),
        tail: Vec::new(),
    })
}

/// A coded side: the head's slice of every reference page into its block, FP16 tokens into the sink
/// and the tail ring.
fn coded_tensor(
    layout: &DeviceLayout,
    side: &SideLayout,
    s: &Stored,
    len: usize,
) -> Result<DeviceTensor, RefError> {
    let regions = side.regions(len);
    if *s.regions() != regions {
        return Err(RefError::Mismatch(format!(
            "the cache splits its {len} tokens as {:?}, the device layout as {regions:?}",
            s.regions()
        )));
    }
    let blocks = coded_blocks(layout, side, s, regions.pages)?;
    let (sink, tail) = fp16_buffers(layout, side, s, &regions)?;
    Ok(DeviceTensor {
        blocks,
        pages: regions.pages,
        sink,
        tail,
    })
}

/// Whether a reference page holds one scale vector for all heads (RoPE keys with `span = token`),
/// which every head's block then repeats.
fn token_wide_scale(kind: &SideKind) -> bool {
    matches!(
        kind,
        SideKind::Rope {
            span: CodebookSpan::Token,
            ..
        }
    )
}

fn coded_blocks(
    layout: &DeviceLayout,
    side: &SideLayout,
    s: &Stored,
    pages: usize,
) -> Result<Vec<u8>, RefError> {
    let (h, p_len) = (layout.kv_heads, side.page);
    let head_words = side.codes.bytes / 4;
    let token_wide = token_wide_scale(&side.kind);
    let vectors = if token_wide { 1 } else { h };
    let want = (h * head_words, vectors * p_len);
    let have = (s.layout().code_words, s.layout().scales);
    if want != have || s.codes().len() != pages * have.0 || s.scales().len() != pages * have.1 {
        return Err(RefError::Mismatch(format!(
            "a reference page holds {have:?} (code words, scales), the device layout expects {want:?}"
        )));
    }
    let mut blocks =
        resources::try_vec_of(&[pages, h, side.block_bytes], 0u8, "the coded page pool")?;
    for p in 0..pages {
        let page_codes = &s.codes()[p * have.0..(p + 1) * have.0];
        let page_scales = &s.scales()[p * have.1..(p + 1) * have.1];
        for head in 0..h {
            let block = &mut blocks[layout.block_range(side, p, head)];
            let words = &page_codes[head * head_words..(head + 1) * head_words];
            for (i, w) in words.iter().enumerate() {
                put_u32(block, side.codes.offset + 4 * i, *w);
            }
            let v = if token_wide { 0 } else { head };
            for (i, bits) in page_scales[v * p_len..(v + 1) * p_len].iter().enumerate() {
                put_u16(block, side.scales.offset + 2 * i, *bits);
            }
        }
    }
    Ok(blocks)
}

type Buffers = (Vec<u16>, Vec<u16>);

/// The sink `[H][S][D]` and the tail ring `[H][local + P][D]` of a coded side, unused rows zero.
fn fp16_buffers(
    layout: &DeviceLayout,
    side: &SideLayout,
    s: &Stored,
    regions: &TokenRegions,
) -> Result<Buffers, RefError> {
    let (h, d) = (layout.kv_heads, layout.head_dim);
    let mut sink = resources::try_vec_of(&[h, side.sink, d], 0u16, "the FP16 sink buffer")?;
    let mut tail = resources::try_vec_of(&[h, side.tail_cap, d], 0u16, "the FP16 tail ring")?;
    for head in 0..h {
        for t in regions.sink() {
            sink[layout.sink_row(side, head, t)].copy_from_slice(stored_fp16_row(s, head, t, d));
        }
        for t in regions.tail() {
            let slot = (t - regions.sink_end) % side.tail_cap;
            tail[layout.tail_row(side, head, slot)].copy_from_slice(stored_fp16_row(s, head, t, d));
        }
    }
    Ok((sink, tail))
}

/// f16 bits of `x`, refused unless f16 holds it exactly (the device copy must be the reference's).
fn exact_f16(x: f32, what: &str, index: usize) -> Result<f16, RefError> {
    let h = f16::from_f32(x);
    if h.to_f32() == x {
        Ok(h)
    } else {
        Err(RefError::Mismatch(format!(
            "{what} value {index} ({x}) is not exactly representable in f16, as the device tensor needs"
        )))
    }
}

/// `[kv_head][group][round][entry][pair]` of `f16(re) | f16(im) << 16`.
fn pack_rope(cb: &KeyCodebook) -> Result<Vec<u32>, RefError> {
    let mut out = resources::try_with_capacity(cb.entries.len() / 2, "the key codebook tensor")?;
    for (i, pair) in cb.entries.chunks_exact(2).enumerate() {
        let re = exact_f16(pair[0], "key codebook", 2 * i)?;
        let im = exact_f16(pair[1], "key codebook", 2 * i + 1)?;
        out.push(u32::from(re.to_bits()) | u32::from(im.to_bits()) << 16);
    }
    Ok(out)
}

/// `C ⊙ σ` `[book][row][D]` and μ `[book][D]`; both factors f16-exact, so the f32 product is exact.
fn scale_rows(cb: &AdditiveCodebook, which: Which) -> Result<(Vec<f32>, Vec<f32>), RefError> {
    if cb.span == CodebookSpan::Token {
        return Err(RefError::WrongEntryPoint(format!(
            "`{} = codebook(additive, span = token)`: token-wide additive codebooks are not in the \
             device layout ({DEVICE_LAYOUT_VERSION}) yet; use `span = head`",
            which.name()
        )));
    }
    let what = format!("`{}` additive codebook", which.name());
    for (i, x) in cb.table.iter().enumerate() {
        exact_f16(*x, &what, i)?;
    }
    for (i, x) in cb.channel_scale.iter().enumerate() {
        exact_f16(*x, &format!("{what} channel scale"), i)?;
    }
    let dim = cb.dim();
    let mut rows = resources::try_with_capacity(cb.table.len(), "the scaled additive rows")?;
    for b in 0..cb.books() {
        let sigma = &cb.channel_scale[b * dim..(b + 1) * dim];
        for row in cb.table[b * cb.rows * dim..(b + 1) * cb.rows * dim].chunks_exact(dim) {
            rows.extend(row.iter().zip(sigma).map(|(c, s)| c * s));
        }
    }
    Ok((rows, cb.mean.clone()))
}

// ---------------------------------------------------------------------------------------------
// Attention from the device arrays alone.

fn word_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

fn f16_at(bytes: &[u8], at: usize) -> f64 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f64()
}

/// Code `i` of the stream starting at byte `at`: bits `i·w .. i·w + w`, LSB first, maybe straddling
/// two words.
fn stream_code(block: &[u8], at: usize, w: u32, i: usize) -> u32 {
    let bit = i * w as usize;
    let (word, shift) = (at + 4 * (bit / 32), (bit % 32) as u32);
    let mut c = word_at(block, word) >> shift;
    if shift + w > 32 {
        c |= word_at(block, word + 4) << (32 - shift);
    }
    c & (u32::MAX >> (32 - w))
}

/// Code `(a, b)` of (group, round) for token `row` of a RoPE key block; `None` when the side is not
/// RoPE-coded or an index is out of range.
pub fn block_rope_code(
    side: &SideLayout,
    block: &[u8],
    group: usize,
    round: usize,
    row: usize,
) -> Option<(u32, u32)> {
    let SideKind::Rope {
        residuals,
        groups,
        code_bits,
        stream_words,
        ..
    } = side.kind
    else {
        return None;
    };
    if group >= groups || round >= residuals || row >= side.page || block.len() != side.block_bytes
    {
        return None;
    }
    let at = side.codes.offset + (group * residuals + round) * stream_words * 4;
    let c = stream_code(block, at, code_bits, row);
    let half = code_bits / 2;
    Some((c >> half, c & ((1 << half) - 1)))
}

/// Whether row `j` of the code of token `row` is set in an additive block (word `j/32` of the token at
/// `[word][token]`).
fn additive_bit(side: &SideLayout, block: &[u8], row: usize, j: usize) -> bool {
    let at = side.codes.offset + ((j / 32) * side.page + row) * 4;
    word_at(block, at) >> (j % 32) & 1 == 1
}

fn check_queries(
    layout: &DeviceLayout,
    seq: &DeviceSequence,
    q: &Queries,
) -> Result<usize, RefError> {
    super::check_queries(q, layout.kv_heads, layout.head_dim, seq.len)
}

fn check_tensor(
    layout: &DeviceLayout,
    side: &SideLayout,
    t: &DeviceTensor,
    len: usize,
    which: &str,
) -> Result<(), RefError> {
    let (h, d) = (layout.kv_heads, layout.head_dim);
    let want = [
        side.pages(len),
        product(&[side.pages(len), h, side.block_bytes], "the blocks")?,
        product(&[h, side.sink, d], "the sink")?,
        product(&[h, side.tail_cap, d], "the tail")?,
    ];
    let have = [t.pages, t.blocks.len(), t.sink.len(), t.tail.len()];
    if want != have {
        return Err(RefError::Mismatch(format!(
            "`{which}` holds (pages, block bytes, sink, tail) = {have:?}; {len} tokens need {want:?}"
        )));
    }
    Ok(())
}

/// Elements a side's codebook tensors need: (RoPE entries, scaled rows, mean).
fn codebook_sizes(layout: &DeviceLayout, side: &SideLayout) -> Result<[usize; 3], RefError> {
    let (h, d) = (layout.kv_heads, layout.head_dim);
    Ok(match side.kind {
        SideKind::Fp16 => [0, 0, 0],
        SideKind::Rope {
            levels,
            residuals,
            pairs_per_code,
            groups,
            ..
        } => [
            product(
                &[h, groups, residuals, levels, pairs_per_code],
                "the key codebook",
            )?,
            0,
            0,
        ],
        SideKind::Additive { rows } => [0, product(&[h, rows, d], "the rows")?, h * d],
    })
}

fn check_codebooks(layout: &DeviceLayout, books: &DeviceCodebooks) -> Result<(), RefError> {
    let have_k = [
        books.k_rope.len(),
        books.k_rows_scaled.len(),
        books.k_mean.len(),
    ];
    let have_v = [0, books.v_rows_scaled.len(), books.v_mean.len()];
    let (want_k, want_v) = (
        codebook_sizes(layout, &layout.k)?,
        codebook_sizes(layout, &layout.v)?,
    );
    if have_k != want_k || have_v != want_v {
        return Err(RefError::Mismatch(format!(
            "codebook tensors hold K {have_k:?}, V {have_v:?} (rope, rows, mean); the layout needs \
             K {want_k:?}, V {want_v:?}"
        )));
    }
    Ok(())
}

/// What a query head precomputes against the key codebook.
enum KeyTable {
    Fp16,
    /// `P[group][round][entry][pair] = conj(q_pair)·c`, as (re, im).
    Rope(Vec<(f64, f64)>),
    /// `q·μ` and `(C_j ⊙ σ)·q` per row.
    Additive {
        q_mean: f64,
        qc: Vec<f64>,
    },
}

fn key_table(layout: &DeviceLayout, books: &DeviceCodebooks, q: &[f32], head: usize) -> KeyTable {
    let (d, half) = (layout.head_dim, layout.head_dim / 2);
    match layout.k.kind {
        SideKind::Fp16 => KeyTable::Fp16,
        SideKind::Rope {
            levels,
            residuals,
            pairs_per_code: g,
            groups,
            ..
        } => {
            let base = head * groups * residuals * levels * g;
            let entries = &books.k_rope[base..base + groups * residuals * levels * g];
            let table = entries
                .iter()
                .enumerate()
                .map(|(n, e)| {
                    // n = ((group·R + round)·N' + entry)·g + j: pair group·g + j.
                    let pair = (n / (residuals * levels * g)) * g + n % g;
                    let (qr, qi) = (q[pair] as f64, q[pair + half] as f64);
                    let x = f16::from_bits(*e as u16).to_f64();
                    let y = f16::from_bits((*e >> 16) as u16).to_f64();
                    (qr * x + qi * y, qr * y - qi * x)
                })
                .collect();
            KeyTable::Rope(table)
        }
        SideKind::Additive { rows } => {
            let mean = &books.k_mean[head * d..(head + 1) * d];
            let scaled = &books.k_rows_scaled[head * rows * d..(head + 1) * rows * d];
            KeyTable::Additive {
                q_mean: dot(q, mean),
                qc: scaled.chunks_exact(d).map(|r| dot(q, r)).collect(),
            }
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// An FP16 row of a side as f32: from a page block, the sink or the tail ring.
fn fp16_row(
    layout: &DeviceLayout,
    side: &SideLayout,
    t: &DeviceTensor,
    head: usize,
    slot: TokenSlot,
) -> Vec<f32> {
    let bits: Vec<u16> = match slot {
        TokenSlot::Page { page, row } => {
            let block = &t.blocks[layout.block_range(side, page, head)];
            let at = side.rows.offset + row * layout.head_dim * 2;
            block[at..at + layout.head_dim * 2]
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect()
        }
        TokenSlot::Sink(row) => t.sink[layout.sink_row(side, head, row)].to_vec(),
        TokenSlot::Tail(slot) => t.tail[layout.tail_row(side, head, slot)].to_vec(),
    };
    bits.into_iter()
        .map(|b| f16::from_bits(b).to_f32())
        .collect()
}

/// `s · Σ_pairs Re(e^{iθ_p t} · Σ_rounds (P_a + i·P_b))` for token `t` at `row` of a RoPE key block.
fn rope_score(
    side: &SideLayout,
    block: &[u8],
    table: &[(f64, f64)],
    rope: Rope,
    t: usize,
    row: usize,
) -> f64 {
    let SideKind::Rope {
        levels,
        residuals,
        pairs_per_code: g,
        groups,
        ..
    } = side.kind
    else {
        return 0.0;
    };
    let mut score = 0.0;
    let mut acc = vec![(0.0f64, 0.0f64); g];
    for group in 0..groups {
        acc.iter_mut().for_each(|a| *a = (0.0, 0.0));
        for r in 0..residuals {
            // In range: the block's size and the code width were checked against the layout.
            let (a, b) = block_rope_code(side, block, group, r, row).unwrap_or_default();
            let base = (group * residuals + r) * levels;
            let pa = &table[(base + a as usize) * g..][..g];
            let pb = &table[(base + b as usize) * g..][..g];
            for j in 0..g {
                acc[j].0 += pa[j].0 - pb[j].1;
                acc[j].1 += pa[j].1 + pb[j].0;
            }
        }
        for (j, (re, im)) in acc.iter().enumerate() {
            let (c, s) = rope.angle(side.head_dim, group * g + j, t);
            score += c * re - s * im;
        }
    }
    score * f16_at(block, side.scales.offset + 2 * row)
}

/// `q·μ + w · Σ_{j∈s} (C_j ⊙ σ)·q` for the token at `row` of an additive block.
fn additive_score(side: &SideLayout, block: &[u8], q_mean: f64, qc: &[f64], row: usize) -> f64 {
    let sum: f64 = (0..qc.len())
        .filter(|j| additive_bit(side, block, row, *j))
        .map(|j| qc[j])
        .sum();
    q_mean + sum * f16_at(block, side.scales.offset + 2 * row)
}

/// Scores `q·k/√D` of one query head against every token.
fn key_scores(
    layout: &DeviceLayout,
    seq: &DeviceSequence,
    books: &DeviceCodebooks,
    rope: Rope,
    q: &[f32],
    head: usize,
) -> Vec<f64> {
    let side = &layout.k;
    let table = key_table(layout, books, q, head);
    let inv_sqrt_d = 1.0 / (layout.head_dim as f64).sqrt();
    (0..seq.len)
        .map(|t| {
            let slot = side.locate(seq.len, t);
            let raw = match (slot, &table) {
                (TokenSlot::Page { page, row }, KeyTable::Rope(p)) => {
                    let block = &seq.k.blocks[layout.block_range(side, page, head)];
                    rope_score(side, block, p, rope, t, row)
                }
                (TokenSlot::Page { page, row }, KeyTable::Additive { q_mean, qc }) => {
                    let block = &seq.k.blocks[layout.block_range(side, page, head)];
                    additive_score(side, block, *q_mean, qc, row)
                }
                _ => dot(q, &fp16_row(layout, side, &seq.k, head, slot)),
            };
            raw * inv_sqrt_d
        })
        .collect()
}

/// CalibQuant over the coded keys' scores (range of those scores), then the softmax, in place.
fn probabilities(layout: &DeviceLayout, len: usize, row: &mut [f64]) {
    if let Some(c) = &layout.calibrate {
        let coded = |t: &usize| layout.k.is_coded_token(len, *t);
        let lo = (0..len)
            .filter(coded)
            .map(|t| row[t])
            .fold(f64::INFINITY, f64::min);
        let hi = (0..len)
            .filter(coded)
            .map(|t| row[t])
            .fold(f64::NEG_INFINITY, f64::max);
        if lo.is_finite() {
            for t in (0..len).filter(coded) {
                row[t] = calibrate_score(c, row[t], lo, hi);
            }
        }
    }
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0.0;
    for x in row.iter_mut() {
        *x = (*x - m).exp();
        sum += *x;
    }
    row.iter_mut().for_each(|x| *x /= sum);
}

/// `Σ_t p_t v̂_t` of one query head: FP16 rows directly; additive tokens through
/// `(Σp)·μ + (Σ_t p_t w_t s_t)·(C ⊙ σ)`.
fn weighted_values(
    layout: &DeviceLayout,
    seq: &DeviceSequence,
    books: &DeviceCodebooks,
    p: &[f64],
    head: usize,
) -> Vec<f64> {
    let (side, d) = (&layout.v, layout.head_dim);
    let rows = match side.kind {
        SideKind::Additive { rows } => rows,
        _ => 0,
    };
    let mut acc = vec![0.0f64; d];
    let (mut a, mut mass) = (vec![0.0f64; rows], 0.0);
    for (t, pt) in p.iter().enumerate() {
        match side.locate(seq.len, t) {
            TokenSlot::Page { page, row } if rows > 0 => {
                let block = &seq.v.blocks[layout.block_range(side, page, head)];
                mass += pt;
                let pw = pt * f16_at(block, side.scales.offset + 2 * row);
                for (j, aj) in a.iter_mut().enumerate() {
                    if additive_bit(side, block, row, j) {
                        *aj += pw;
                    }
                }
            }
            slot => {
                for (o, x) in acc
                    .iter_mut()
                    .zip(fp16_row(layout, side, &seq.v, head, slot))
                {
                    *o += pt * x as f64;
                }
            }
        }
    }
    if rows > 0 {
        let mean = &books.v_mean[head * d..(head + 1) * d];
        let scaled = &books.v_rows_scaled[head * rows * d..(head + 1) * rows * d];
        for (o, m) in acc.iter_mut().zip(mean) {
            *o += mass * *m as f64;
        }
        for (aj, r) in a.iter().zip(scaled.chunks_exact(d)) {
            if *aj != 0.0 {
                for (o, c) in acc.iter_mut().zip(r) {
                    *o += aj * *c as f64;
                }
            }
        }
    }
    acc
}

/// Decode attention `[q_heads][D]` of one sequence computed in f64 from the device arrays alone (never
/// the reference cache): the executable specification of what a kernel reading this layout computes.
/// Equals [`CommVqCache::attend`] on the cache the arrays came from.
pub fn device_attend(
    layout: &DeviceLayout,
    seq: &DeviceSequence,
    books: &DeviceCodebooks,
    rope: Rope,
    q: &Queries,
) -> Result<Vec<f32>, RefError> {
    let group = check_queries(layout, seq, q)?;
    if matches!(layout.v.kind, SideKind::Rope { .. }) {
        return Err(RefError::WrongEntryPoint(
            "values cannot use a RoPE-commutative codebook".into(),
        ));
    }
    check_tensor(layout, &layout.k, &seq.k, seq.len, "k")?;
    check_tensor(layout, &layout.v, &seq.v, seq.len, "v")?;
    check_codebooks(layout, books)?;
    let d = layout.head_dim;
    let mut out = vec![0.0f32; q.q_heads * d];
    for qh in 0..q.q_heads {
        let head = qh / group;
        let mut p = key_scores(layout, seq, books, rope, q.head(qh), head);
        probabilities(layout, seq.len, &mut p);
        let values = weighted_values(layout, seq, books, &p, head);
        for (o, x) in out[qh * d..(qh + 1) * d].iter_mut().zip(values) {
            *o = x as f32;
        }
    }
    Ok(out)
}
