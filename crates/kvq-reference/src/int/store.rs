//! One tensor's (K's or V's) paged store (`docs/LAYOUT.md` §5–6): FP16 sink buffer, a pool of page
//! blocks, FP16 tail ring — or, for `fp16` tensors, plain FP16 pages.

use super::layout::{fp16_block_bytes, IntLayout};
use super::page;
use super::quantize::F16_MAX;
use crate::regions::TokenRegions;
use crate::resources;
use crate::{KvTensor, RefError};
use half::f16;
use kvq_spec::{SchemeSpec, ShapeError, TensorQuant};

/// A quantized tensor's storage besides its page pool.
#[derive(Debug, Clone, PartialEq)]
struct IntBody {
    layout: IntLayout,
    regions: TokenRegions,
    /// `[kv_heads][sink_capacity][head_dim]`.
    sink: Vec<f16>,
    sink_capacity: usize,
    /// `[kv_heads][tail_capacity][head_dim]` ring: token `t` at slot `(t − sink_end) % capacity`.
    tail: Vec<f16>,
    tail_capacity: usize,
}

/// One tensor of a sequence, stored in the cache layout.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorStore {
    quant: TensorQuant,
    kv_heads: usize,
    tokens: usize,
    head_dim: usize,
    page: usize,
    /// Pages per head in the pool (quantized pages, or FP16 pages for `fp16` tensors).
    pages: usize,
    /// Blocks in order `page · kv_heads + head`, each `block_bytes` long.
    pool: Vec<u8>,
    block_bytes: usize,
    /// `None` for `fp16` tensors.
    int: Option<IntBody>,
}

/// Rejects NaN/±Inf, and values beyond ±[`F16_MAX`]: stored as f16 they would be ±Inf, so they are
/// reported as [`RefError::NonFinite`] too (with the offending value).
pub fn check_cacheable(x: &KvTensor, name: &'static str) -> Result<(), RefError> {
    x.check_finite(name)?;
    match x.data.iter().position(|v| v.abs() > F16_MAX) {
        None => Ok(()),
        Some(i) => {
            let per_head = x.tokens * x.head_dim;
            Err(RefError::NonFinite {
                tensor: name,
                head: i / per_head,
                token: (i % per_head) / x.head_dim,
                channel: i % x.head_dim,
                value: x.data[i],
            })
        }
    }
}

/// Shape rules of one tensor: kvq-spec's, the same [`SchemeSpec::check_tensor_shape`] that
/// `check_shape` applies to K and V, here for any tensor (XQuant's latents of other widths too).
pub fn check_tensor_shape(
    quant: &TensorQuant,
    x: &KvTensor,
    name: &'static str,
) -> Result<(), RefError> {
    let narrow = |what, value: usize| {
        u32::try_from(value).map_err(|_| ShapeError::TooLarge {
            what,
            value: value as u64,
        })
    };
    SchemeSpec::check_tensor_shape(
        name,
        quant,
        narrow("head_dim", x.head_dim)?,
        narrow("kv_heads", x.kv_heads)?,
    )?;
    Ok(())
}

impl TensorStore {
    /// Stores `x` as the scheme stores `quant`: sink, pages and tail from `spec` (page, sink, local).
    /// `name` ("k", "v", or a latent's name) labels errors.
    pub fn build(
        spec: &SchemeSpec,
        quant: &TensorQuant,
        x: &KvTensor,
        name: &'static str,
    ) -> Result<Self, RefError> {
        check_tensor_shape(quant, x, name)?;
        check_cacheable(x, name)?;
        let page = spec.page as usize;
        if page == 0 {
            return Err(RefError::Mismatch("a page of 0 tokens".into()));
        }
        match quant {
            TensorQuant::Fp16 => Self::build_fp16(quant, x, page),
            TensorQuant::Int(q) => {
                let layout = IntLayout::new(q, x.head_dim, page)?;
                Self::build_int(spec, quant, layout, x)
            }
            TensorQuant::Codebook(_) => Err(RefError::WrongEntryPoint(format!(
                "{name} uses a codebook: build it with kvq_reference::commvq"
            ))),
        }
    }

    fn build_fp16(quant: &TensorQuant, x: &KvTensor, page: usize) -> Result<Self, RefError> {
        let (h, d) = (x.kv_heads, x.head_dim);
        let pages = x.tokens.div_ceil(page);
        let block_bytes = fp16_block_bytes(d, page);
        let mut pool = resources::try_vec_of(&[pages, h, block_bytes], 0u8, "the FP16 page pool")?;
        for head in 0..h {
            for t in 0..x.tokens {
                let at = ((t / page) * h + head) * block_bytes + (t % page) * d * 2;
                page::encode_fp16(x.row(head, t), &mut pool[at..at + d * 2])
                    .expect("an f16 row fits its slot in the page");
            }
        }
        Ok(Self {
            quant: *quant,
            kv_heads: h,
            tokens: x.tokens,
            head_dim: d,
            page,
            pages,
            pool,
            block_bytes,
            int: None,
        })
    }

    fn build_int(
        spec: &SchemeSpec,
        quant: &TensorQuant,
        layout: IntLayout,
        x: &KvTensor,
    ) -> Result<Self, RefError> {
        let (h, d, page) = (x.kv_heads, x.head_dim, layout.page);
        let regions = TokenRegions::new(
            x.tokens,
            spec.sink as usize,
            spec.local_of(quant) as usize,
            page,
        );
        let sink_capacity = spec.sink as usize;
        let tail_capacity = spec.local_of(quant) as usize + page;
        // The FP16 buffers are allocated whole, as a device cache holds them: a scheme's sink,
        // window and page sizes (up to 2^20 tokens each) decide these, not the sequence.
        let mut sink =
            resources::try_vec_of(&[h, sink_capacity, d], f16::ZERO, "the FP16 sink buffer")?;
        let mut tail =
            resources::try_vec_of(&[h, tail_capacity, d], f16::ZERO, "the FP16 tail ring")?;
        let mut pool = resources::try_vec_of(
            &[regions.pages, h, layout.block_bytes],
            0u8,
            "the page pool",
        )?;
        let mut values = resources::try_vec_of(&[page, d], 0.0f32, "one page of values")?;
        for head in 0..h {
            for t in regions.sink() {
                let at = (head * sink_capacity + t) * d;
                for (s, &v) in sink[at..at + d].iter_mut().zip(x.row(head, t)) {
                    *s = f16::from_f32(v);
                }
            }
            for t in regions.tail() {
                let slot = (t - regions.sink_end) % tail_capacity;
                let at = (head * tail_capacity + slot) * d;
                for (s, &v) in tail[at..at + d].iter_mut().zip(x.row(head, t)) {
                    *s = f16::from_f32(v);
                }
            }
            for p in 0..regions.pages {
                let tokens = regions.page_tokens(p);
                values.copy_from_slice(&x.head(head)[tokens.start * d..tokens.end * d]);
                let at = (p * h + head) * layout.block_bytes;
                page::encode_page(&layout, &values, &mut pool[at..at + layout.block_bytes])?;
            }
        }
        Ok(Self {
            quant: *quant,
            kv_heads: h,
            tokens: x.tokens,
            head_dim: d,
            page,
            pages: regions.pages,
            pool,
            block_bytes: layout.block_bytes,
            int: Some(IntBody {
                layout,
                regions,
                sink,
                sink_capacity,
                tail,
                tail_capacity,
            }),
        })
    }

    pub fn quant(&self) -> &TensorQuant {
        &self.quant
    }

    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Tokens per page.
    pub fn page(&self) -> usize {
        self.page
    }

    /// The quantized page layout (`None` for `fp16` tensors).
    pub fn layout(&self) -> Option<&IntLayout> {
        self.int.as_ref().map(|b| &b.layout)
    }

    /// The token split (`None` for `fp16` tensors, which are all FP16 pages).
    pub fn regions(&self) -> Option<&TokenRegions> {
        self.int.as_ref().map(|b| &b.regions)
    }

    /// Pages per head in the pool.
    pub fn pages(&self) -> usize {
        self.pages
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// All page blocks, block `page · kv_heads + head` at byte `block · block_bytes`.
    pub fn pool(&self) -> &[u8] {
        &self.pool
    }

    /// One page block of one head.
    pub fn block(&self, page: usize, head: usize) -> Option<&[u8]> {
        if page >= self.pages || head >= self.kv_heads {
            return None;
        }
        let at = (page * self.kv_heads + head) * self.block_bytes;
        Some(&self.pool[at..at + self.block_bytes])
    }

    /// The FP16 sink buffer `[kv_heads][sink_capacity][head_dim]` (empty for `fp16` tensors).
    pub fn sink(&self) -> &[f16] {
        self.int.as_ref().map_or(&[], |b| &b.sink)
    }

    pub fn sink_capacity(&self) -> usize {
        self.int.as_ref().map_or(0, |b| b.sink_capacity)
    }

    /// The FP16 tail ring `[kv_heads][tail_capacity][head_dim]` (empty for `fp16` tensors).
    pub fn tail(&self) -> &[f16] {
        self.int.as_ref().map_or(&[], |b| &b.tail)
    }

    /// `local + page` slots per head.
    pub fn tail_capacity(&self) -> usize {
        self.int.as_ref().map_or(0, |b| b.tail_capacity)
    }

    /// The ring slot of a tail token (`None` if the token is not in the tail).
    pub fn tail_slot(&self, token: usize) -> Option<usize> {
        let b = self.int.as_ref()?;
        b.regions
            .tail()
            .contains(&token)
            .then(|| (token - b.regions.sink_end) % b.tail_capacity)
    }

    /// Whether `token` comes from a quantized page.
    pub fn is_quantized(&self, token: usize) -> bool {
        self.int
            .as_ref()
            .is_some_and(|b| b.regions.is_quantized(token))
    }

    /// Bytes allocated: the pool plus both FP16 buffers at full capacity.
    pub fn allocated_bytes(&self) -> usize {
        self.pool.len() + 2 * (self.sink().len() + self.tail().len())
    }

    /// The values as the kernels see them, decoded from the stored bytes.
    pub fn dequantize(&self) -> KvTensor {
        self.try_dequantize()
            .expect("blocks written by TensorStore::build always decode")
    }

    fn try_dequantize(&self) -> Result<KvTensor, RefError> {
        let (h, d) = (self.kv_heads, self.head_dim);
        let mut out = KvTensor::zeros(h, self.tokens, d);
        let Some(b) = &self.int else {
            for head in 0..h {
                for t in 0..self.tokens {
                    let at =
                        ((t / self.page) * h + head) * self.block_bytes + (t % self.page) * d * 2;
                    let row = page::decode_fp16(&self.pool[at..at + d * 2], d)?;
                    out.row_mut(head, t).copy_from_slice(&row);
                }
            }
            return Ok(out);
        };
        let as_f32 = |src: &[f16], dst: &mut [f32]| {
            for (o, s) in dst.iter_mut().zip(src) {
                *o = s.to_f32();
            }
        };
        for head in 0..h {
            for t in b.regions.sink() {
                let at = (head * b.sink_capacity + t) * d;
                as_f32(&b.sink[at..at + d], out.row_mut(head, t));
            }
            for t in b.regions.tail() {
                let slot = (t - b.regions.sink_end) % b.tail_capacity;
                let at = (head * b.tail_capacity + slot) * d;
                as_f32(&b.tail[at..at + d], out.row_mut(head, t));
            }
            for p in 0..self.pages {
                let values = page::decode_page(&b.layout, self.block(p, head).unwrap_or(&[]))?;
                let tokens = b.regions.page_tokens(p);
                out.head_mut(head)[tokens.start * d..tokens.end * d].copy_from_slice(&values);
            }
        }
        Ok(out)
    }
}
