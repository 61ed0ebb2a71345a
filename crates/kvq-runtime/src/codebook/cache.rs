//! A batch's codebook-coded cache in device memory ([`CodebookCache`]), in the layout of
//! `kvq_reference::commvq::device`: uploaded from the CPU reference's coded sequences, or empty and
//! filled on the GPU by a [`super::CodebookEncoder`].

use crate::error::{Result, RuntimeError};
use cudarc::driver::{CudaSlice, CudaStream};
use kvq_reference::commvq::device::{DeviceCodebooks, DeviceLayout, DeviceSequence, SideLayout};
use kvq_reference::commvq::CommVqCache;
use kvq_spec::SchemeSpec;
use std::sync::Arc;

pub(super) fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
) -> Result<CudaSlice<T>> {
    stream
        .alloc_zeros::<T>(n.max(1))
        .map_err(|e| RuntimeError::driver("allocate a codebook cache buffer", e))
}

pub(super) fn upload<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Clone>(
    stream: &Arc<CudaStream>,
    data: &[T],
) -> Result<CudaSlice<T>> {
    if data.is_empty() {
        return alloc(stream, 1);
    }
    stream
        .clone_htod(data)
        .map_err(|e| RuntimeError::driver("upload a codebook cache buffer", e))
}

/// A batch of CommVQ-coded sequences in device memory, in the layout [`CodebookKernel`](super::CodebookKernel) reads:
/// page pools of (page, KV head) blocks with a page table, FP16 sink and tail buffers, and the
/// layer's codebooks.
pub struct CodebookCache {
    pub(super) spec: SchemeSpec,
    pub(super) layout: DeviceLayout,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) batch: usize,
    pub(super) max_pages: usize,
    pub(super) rope_theta: f64,
    /// Tokens of each sequence, as the device's `seq_lens` holds them.
    pub(super) lens: Vec<usize>,
    /// Most tokens a sequence may hold (its pages were reserved for it).
    pub(super) max_len: usize,
    pub(super) k_pool: CudaSlice<u8>,
    pub(super) v_pool: CudaSlice<u8>,
    pub(super) page_table: CudaSlice<i32>,
    pub(super) seq_lens: CudaSlice<i32>,
    pub(super) k_sink: CudaSlice<u16>,
    pub(super) v_sink: CudaSlice<u16>,
    pub(super) k_tail: CudaSlice<u16>,
    pub(super) v_tail: CudaSlice<u16>,
    /// What a GPU-filled cache still has to code, in its input format: `[slot][kv_head][tail_cap][D]`
    /// per coded side (RoPE keys before RoPE), beside the FP16 tail; `None` for an uploaded cache,
    /// which cannot grow.
    pub(super) pending: Option<Pending>,
    pub(super) k_book: CudaSlice<u32>,
    pub(super) k_rows: CudaSlice<f32>,
    pub(super) k_mean: CudaSlice<f32>,
    pub(super) v_rows: CudaSlice<f32>,
    pub(super) v_mean: CudaSlice<f32>,
}

/// A GPU-filled cache's pending rings and its encoders' status words.
pub(super) struct Pending {
    pub dtype: kvq_codegen::Dtype,
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
    pub status: CudaSlice<u32>,
}

impl CodebookCache {
    /// Uploads `caches` (one per sequence, all of one scheme, shape and codebooks) in `layout`.
    pub fn upload(
        stream: &Arc<CudaStream>,
        layout: &DeviceLayout,
        caches: &[CommVqCache],
        rope_theta: f64,
    ) -> Result<Self> {
        let first = caches
            .first()
            .ok_or_else(|| RuntimeError::InvalidInput("a batch of no sequences".into()))?;
        let (spec, kv_heads, d) = (*first.spec(), first.kv_heads(), first.head_dim());
        if (layout.kv_heads, layout.head_dim) != (kv_heads, d) {
            return Err(RuntimeError::InvalidInput(format!(
                "the layout is for {} KV heads of {}, the caches hold {kv_heads} of {d}",
                layout.kv_heads, layout.head_dim
            )));
        }
        let mut seqs: Vec<DeviceSequence> = Vec::with_capacity(caches.len());
        for c in caches {
            if *c.spec() != spec || c.kv_heads() != kv_heads || c.head_dim() != d {
                return Err(RuntimeError::InvalidInput(
                    "every sequence of a batch must share the scheme and shape".into(),
                ));
            }
            seqs.push(c.device_sequence()?);
        }
        let books: DeviceCodebooks = first.device_codebooks()?;
        // K and V share the page table: a sequence takes as many physical pages as the side that
        // needs more, the other side's blocks there stay zero.
        let pages: Vec<usize> = seqs.iter().map(|s| s.k.pages.max(s.v.pages)).collect();
        let max_pages = pages.iter().copied().max().unwrap_or(0).max(1);
        let total: usize = pages.iter().sum::<usize>().max(1);
        let mut k_pool = vec![0u8; total * kv_heads * layout.k.block_bytes];
        let mut v_pool = vec![0u8; total * kv_heads * layout.v.block_bytes];
        let mut table = vec![0i32; seqs.len() * max_pages];
        let mut base = 0usize;
        for (i, s) in seqs.iter().enumerate() {
            k_pool[base * kv_heads * layout.k.block_bytes..][..s.k.blocks.len()]
                .copy_from_slice(&s.k.blocks);
            v_pool[base * kv_heads * layout.v.block_bytes..][..s.v.blocks.len()]
                .copy_from_slice(&s.v.blocks);
            for p in 0..pages[i] {
                table[i * max_pages + p] = i32::try_from(base + p)
                    .map_err(|_| RuntimeError::InvalidInput("page index past i32".into()))?;
            }
            base += pages[i];
        }
        let concat = |f: fn(&DeviceSequence) -> &[u16]| -> Vec<u16> {
            seqs.iter().flat_map(|s| f(s).iter().copied()).collect()
        };
        let lens: Vec<i32> = seqs
            .iter()
            .map(|s| i32::try_from(s.len).unwrap_or(i32::MAX))
            .collect();
        Ok(Self {
            spec,
            layout: *layout,
            kv_heads,
            head_dim: d,
            batch: seqs.len(),
            max_pages,
            rope_theta,
            lens: seqs.iter().map(|s| s.len).collect(),
            max_len: seqs.iter().map(|s| s.len).max().unwrap_or(0),
            pending: None,
            k_pool: upload(stream, &k_pool)?,
            v_pool: upload(stream, &v_pool)?,
            page_table: upload(stream, &table)?,
            seq_lens: upload(stream, &lens)?,
            k_sink: upload(stream, &concat(|s| &s.k.sink))?,
            v_sink: upload(stream, &concat(|s| &s.v.sink))?,
            k_tail: upload(stream, &concat(|s| &s.k.tail))?,
            v_tail: upload(stream, &concat(|s| &s.v.tail))?,
            k_book: upload(stream, &books.k_rope)?,
            k_rows: upload(stream, &books.k_rows_scaled)?,
            k_mean: upload(stream, &books.k_mean)?,
            v_rows: upload(stream, &books.v_rows_scaled)?,
            v_mean: upload(stream, &books.v_mean)?,
        })
    }

    /// An empty cache of `batch` sequences of at most `max_len` tokens each, every sequence's pages
    /// reserved (sequence `i`'s page `p` is physical page `i·max_pages + p`), to be filled on the
    /// GPU from new K/V in `dtype`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn empty(
        stream: &Arc<CudaStream>,
        spec: &SchemeSpec,
        layout: &DeviceLayout,
        books: &DeviceCodebooks,
        batch: usize,
        max_len: usize,
        rope_theta: f64,
        dtype: kvq_codegen::Dtype,
    ) -> Result<Self> {
        if batch == 0 || max_len == 0 || i32::try_from(max_len).is_err() {
            return Err(RuntimeError::InvalidInput(format!(
                "a cache of {batch} sequences of at most {max_len} tokens (both at least 1, the length \
                 within i32)"
            )));
        }
        let (h, d) = (layout.kv_heads, layout.head_dim);
        let max_pages = layout.k.pages(max_len).max(layout.v.pages(max_len)).max(1);
        let too_big = || {
            RuntimeError::InvalidInput(format!(
                "a cache of {batch} sequences of {max_len} tokens overflows the address space"
            ))
        };
        let n = |dims: &[usize]| -> Result<usize> {
            dims.iter()
                .try_fold(1usize, |a, &x| a.checked_mul(x))
                .ok_or_else(too_big)
        };
        let total_pages = n(&[batch, max_pages])?;
        if i32::try_from(total_pages).is_err() {
            return Err(too_big());
        }
        let table: Vec<i32> = (0..total_pages as i32).collect();
        let ring =
            |side: &SideLayout| n(&[batch, h, if side.is_coded() { side.tail_cap } else { 0 }, d]);
        let sink =
            |side: &SideLayout| n(&[batch, h, if side.is_coded() { side.sink } else { 0 }, d]);
        // Zeroed status words are clean (kvq/codebook/encode.cuh).
        let status = alloc::<u32>(stream, kvq_codegen::CODEBOOK_STATUS_WORDS)?;
        Ok(Self {
            spec: *spec,
            layout: *layout,
            kv_heads: h,
            head_dim: d,
            batch,
            max_pages,
            rope_theta,
            lens: vec![0; batch],
            max_len,
            k_pool: alloc(stream, n(&[total_pages, h, layout.k.block_bytes])?)?,
            v_pool: alloc(stream, n(&[total_pages, h, layout.v.block_bytes])?)?,
            page_table: upload(stream, &table)?,
            seq_lens: alloc(stream, batch)?,
            k_sink: alloc(stream, sink(&layout.k)?)?,
            v_sink: alloc(stream, sink(&layout.v)?)?,
            k_tail: alloc(stream, ring(&layout.k)?)?,
            v_tail: alloc(stream, ring(&layout.v)?)?,
            pending: Some(Pending {
                dtype,
                k: alloc(stream, ring(&layout.k)?)?,
                v: alloc(stream, ring(&layout.v)?)?,
                status,
            }),
            k_book: upload(stream, &books.k_rope)?,
            k_rows: upload(stream, &books.k_rows_scaled)?,
            k_mean: upload(stream, &books.k_mean)?,
            v_rows: upload(stream, &books.v_rows_scaled)?,
            v_mean: upload(stream, &books.v_mean)?,
        })
    }

    /// The device layout the cache holds.
    pub fn layout(&self) -> &DeviceLayout {
        &self.layout
    }

    /// Copies the cache's device arrays back (for checks): K pool, V pool, K sink, V sink, K tail,
    /// V tail, as the device holds them.
    pub fn download(&self, stream: &Arc<CudaStream>) -> Result<CacheArrays> {
        let err = |e| RuntimeError::driver("download the codebook cache", e);
        Ok(CacheArrays {
            k_pool: stream.clone_dtoh(&self.k_pool).map_err(err)?,
            v_pool: stream.clone_dtoh(&self.v_pool).map_err(err)?,
            k_sink: stream.clone_dtoh(&self.k_sink).map_err(err)?,
            v_sink: stream.clone_dtoh(&self.v_sink).map_err(err)?,
            k_tail: stream.clone_dtoh(&self.k_tail).map_err(err)?,
            v_tail: stream.clone_dtoh(&self.v_tail).map_err(err)?,
            max_pages: self.max_pages,
        })
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens sequence `slot` holds.
    pub fn len(&self, slot: usize) -> Option<usize> {
        self.lens.get(slot).copied()
    }

    /// Tokens of the longest sequence.
    pub fn max_tokens(&self) -> usize {
        self.lens.iter().copied().max().unwrap_or(0)
    }

    /// Whether no sequence holds a token.
    pub fn is_empty(&self) -> bool {
        self.lens.iter().all(|l| *l == 0)
    }

    /// Bytes of the cache a decode step reads: the sides' page blocks and the FP16 rows of their
    /// sinks and tails (queries and outputs not counted).
    pub fn read_bytes(&self) -> u64 {
        let (layout, h, d) = (&self.layout, self.kv_heads, self.head_dim);
        let side_bytes = |side: &SideLayout, len: usize| -> u64 {
            let blocks = side.pages(len) * h * side.block_bytes;
            let rows = if side.is_coded() {
                let r = side.regions(len);
                (r.sink().len() + r.tail().len()) * h * d * 2
            } else {
                0
            };
            (blocks + rows) as u64
        };
        self.lens
            .iter()
            .map(|&len| side_bytes(&layout.k, len) + side_bytes(&layout.v, len))
            .sum()
    }

    /// Device bytes of the coded pages, the page table and the FP16 buffers (the codebooks not
    /// counted: they belong to the layer, not the sequences).
    pub fn cache_bytes(&self) -> usize {
        self.k_pool.len()
            + self.v_pool.len()
            + 4 * self.page_table.len()
            + 2 * (self.k_sink.len() + self.v_sink.len() + self.k_tail.len() + self.v_tail.len())
    }
}

/// A [`CodebookCache`]'s arrays copied to the host ([`CodebookCache::download`]), in the device
/// layout: pools `[physical page][kv_head][block]`, sinks `[slot][kv_head][sink][D]`, tails
/// `[slot][kv_head][tail_cap][D]`; sequence `i`'s page `p` is physical page `i·max_pages + p` in a
/// cache the GPU fills.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheArrays {
    /// Key blocks.
    pub k_pool: Vec<u8>,
    /// Value blocks.
    pub v_pool: Vec<u8>,
    /// FP16 key sink rows (keys after RoPE).
    pub k_sink: Vec<u16>,
    /// FP16 value sink rows.
    pub v_sink: Vec<u16>,
    /// FP16 key tail rings.
    pub k_tail: Vec<u16>,
    /// FP16 value tail rings.
    pub v_tail: Vec<u16>,
    /// Pages a sequence holds at most.
    pub max_pages: usize,
}
