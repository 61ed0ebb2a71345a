//! A batch of sequences' paged caches in device memory, uploaded from the CPU reference.
//!
//! Device layout (what the generated kernels index):
//! - `k_pool`, `v_pool`: page blocks `[physical page][kv_head][block_bytes]`;
//! - `page_table`: `[batch][max_pages]` physical page of each logical page (K and V share a slot);
//! - `k_sink`, `v_sink`: `[batch][kv_heads][sink][head_dim]` f16;
//! - `k_tail`, `v_tail`: `[batch][kv_heads][tail_capacity][head_dim]` f16 rings, token `t` at slot
//!   `(t − sink_end) % tail_capacity`;
//! - `seq_lens`: `[batch]`.
//!
//! Physical pages are handed out in reverse order, so a kernel that ignored the page table would
//! read the wrong pages, and blocks no sequence uses are filled with a poison byte.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use kvq_reference::int::{IntCache, TensorStore};
use kvq_spec::SchemeSpec;

use crate::error::{Result, RuntimeError};

/// Byte written into allocated but unused page blocks.
const POISON_BYTE: u8 = 0xA5;

/// Borrowed device buffers of a paged cache in the layout above: what the decode kernels read.
/// Any cache manager that keeps this layout can be attended by [`DecodeKernel`](super::DecodeKernel).
#[derive(Clone, Copy)]
pub struct CacheView<'a> {
    /// Scheme of every sequence.
    pub spec: &'a SchemeSpec,
    /// Sequences (grid z); `q`/`out` rows are `[batch][kv_heads·gqa]`.
    pub batch: usize,
    /// KV heads per sequence.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Columns of `page_table`.
    pub max_pages: usize,
    /// `[physical page][kv_head][block]` bytes.
    pub k_pool: &'a CudaSlice<u8>,
    /// `[physical page][kv_head][block]` bytes.
    pub v_pool: &'a CudaSlice<u8>,
    /// `[batch][max_pages]`.
    pub page_table: &'a CudaSlice<i32>,
    /// `[batch][kv_heads][sink][head_dim]` f16.
    pub k_sink: &'a CudaSlice<u16>,
    /// `[batch][kv_heads][sink][head_dim]` f16.
    pub v_sink: &'a CudaSlice<u16>,
    /// `[batch][kv_heads][local+page][head_dim]` f16 ring.
    pub k_tail: &'a CudaSlice<u16>,
    /// `[batch][kv_heads][local+page][head_dim]` f16 ring.
    pub v_tail: &'a CudaSlice<u16>,
    /// `[batch]` tokens per sequence.
    pub seq_lens: &'a CudaSlice<i32>,
}

/// One batch's cache on the device, uploaded from the CPU reference.
pub struct GpuCache {
    spec: SchemeSpec,
    batch: usize,
    kv_heads: usize,
    head_dim: usize,
    max_pages: usize,
    max_len: usize,
    k_pool: CudaSlice<u8>,
    v_pool: CudaSlice<u8>,
    page_table: CudaSlice<i32>,
    k_sink: CudaSlice<u16>,
    v_sink: CudaSlice<u16>,
    k_tail: CudaSlice<u16>,
    v_tail: CudaSlice<u16>,
    seq_lens: CudaSlice<i32>,
}

fn invalid(msg: String) -> RuntimeError {
    RuntimeError::InvalidInput(msg)
}

/// Host copy of one tensor's pools and buffers, gathered across the batch.
struct HostTensor {
    pool: Vec<u8>,
    sink: Vec<u16>,
    tail: Vec<u16>,
}

fn gather(
    stores: &[&TensorStore],
    slots: &[Vec<usize>],
    physical_pages: usize,
    block_bytes: usize,
) -> HostTensor {
    let kv_heads = stores[0].kv_heads();
    let mut pool = vec![POISON_BYTE; physical_pages * kv_heads * block_bytes];
    let mut sink = Vec::new();
    let mut tail = Vec::new();
    for (store, slots) in stores.iter().zip(slots) {
        for (page, &slot) in slots.iter().enumerate().take(store.pages()) {
            for head in 0..kv_heads {
                if let Some(block) = store.block(page, head) {
                    let at = (slot * kv_heads + head) * block_bytes;
                    pool[at..at + block_bytes].copy_from_slice(block);
                }
            }
        }
        sink.extend(store.sink().iter().map(|h| h.to_bits()));
        tail.extend(store.tail().iter().map(|h| h.to_bits()));
    }
    HostTensor { pool, sink, tail }
}

/// Uploads a vector, or one poison element when it is empty (kernels never read it then, and the
/// argument must still be a valid pointer).
fn upload<T: cudarc::driver::DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    data: &[T],
    filler: T,
    what: &str,
) -> Result<CudaSlice<T>> {
    let one = [filler];
    let src = if data.is_empty() { &one[..] } else { data };
    stream
        .clone_htod(src)
        .map_err(|e| RuntimeError::driver(format!("upload {what}"), e))
}

impl GpuCache {
    /// Uploads the caches of a batch of sequences built by the CPU reference (all with the same
    /// scheme, KV heads and head_dim).
    pub fn upload(stream: &Arc<CudaStream>, sequences: &[&IntCache]) -> Result<GpuCache> {
        let first = sequences
            .first()
            .ok_or_else(|| invalid("an empty batch has no cache to upload".into()))?;
        let spec = *first.spec();
        let (kv_heads, head_dim) = (first.k().kv_heads(), first.k().head_dim());
        for (i, s) in sequences.iter().enumerate() {
            if *s.spec() != spec || s.k().kv_heads() != kv_heads || s.k().head_dim() != head_dim {
                return Err(invalid(format!(
                    "sequence {i} differs from sequence 0 in scheme, kv_heads or head_dim"
                )));
            }
            if s.tokens() == 0 || s.tokens() > i32::MAX as usize {
                return Err(invalid(format!("sequence {i} has {} tokens", s.tokens())));
            }
        }
        // Logical page slots per sequence; physical pages handed out in reverse.
        let slot_counts: Vec<usize> = sequences
            .iter()
            .map(|s| s.k().pages().max(s.v().pages()))
            .collect();
        let physical: usize = slot_counts.iter().sum();
        let max_pages = slot_counts.iter().copied().max().unwrap_or(0).max(1);
        let mut next = physical;
        let mut slots = Vec::with_capacity(sequences.len());
        let mut page_table = vec![-1i32; sequences.len() * max_pages];
        for (b, &n) in slot_counts.iter().enumerate() {
            let mut seq_slots = Vec::with_capacity(n);
            for j in 0..n {
                next -= 1;
                seq_slots.push(next);
                page_table[b * max_pages + j] = next as i32;
            }
            slots.push(seq_slots);
        }
        let ks: Vec<&TensorStore> = sequences.iter().map(|s| s.k()).collect();
        let vs: Vec<&TensorStore> = sequences.iter().map(|s| s.v()).collect();
        let k = gather(&ks, &slots, physical, first.k().block_bytes());
        let v = gather(&vs, &slots, physical, first.v().block_bytes());
        let seq_lens: Vec<i32> = sequences.iter().map(|s| s.tokens() as i32).collect();
        let max_len = sequences.iter().map(|s| s.tokens()).max().unwrap_or(1);
        Ok(GpuCache {
            spec,
            batch: sequences.len(),
            kv_heads,
            head_dim,
            max_pages,
            max_len,
            k_pool: upload(stream, &k.pool, POISON_BYTE, "K page pool")?,
            v_pool: upload(stream, &v.pool, POISON_BYTE, "V page pool")?,
            page_table: upload(stream, &page_table, -1, "page table")?,
            k_sink: upload(stream, &k.sink, 0xFFFF, "K sink")?,
            v_sink: upload(stream, &v.sink, 0xFFFF, "V sink")?,
            k_tail: upload(stream, &k.tail, 0xFFFF, "K tail")?,
            v_tail: upload(stream, &v.tail, 0xFFFF, "V tail")?,
            seq_lens: upload(stream, &seq_lens, 0, "sequence lengths")?,
        })
    }

    /// The device buffers, for [`DecodeKernel::attend`](super::DecodeKernel::attend).
    pub fn view(&self) -> CacheView<'_> {
        CacheView {
            spec: &self.spec,
            batch: self.batch,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            max_pages: self.max_pages,
            k_pool: &self.k_pool,
            v_pool: &self.v_pool,
            page_table: &self.page_table,
            k_sink: &self.k_sink,
            v_sink: &self.v_sink,
            k_tail: &self.k_tail,
            v_tail: &self.v_tail,
            seq_lens: &self.seq_lens,
        }
    }

    /// The scheme of every sequence in the batch.
    pub fn spec(&self) -> &SchemeSpec {
        &self.spec
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// KV heads per sequence.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Longest sequence of the batch.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Device bytes the kernels read for a full decode step (codes, metadata, FP16 regions).
    pub fn device_bytes(&self) -> usize {
        self.k_pool.len()
            + self.v_pool.len()
            + 2 * (self.k_sink.len() + self.v_sink.len() + self.k_tail.len() + self.v_tail.len())
    }
}
