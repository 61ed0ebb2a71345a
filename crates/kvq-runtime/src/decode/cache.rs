//! A batch of sequences' paged caches in device memory, uploaded from the CPU reference, in the
//! layout of [`layout`](super::layout).
//!
//! Physical pages are handed out in reverse order, so a kernel that ignored the page table would
//! read the wrong pages, and blocks no sequence uses are filled with a poison byte.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use kvq_reference::int::{IntCache, TensorStore};
use kvq_spec::SchemeSpec;

use super::layout::{CacheBuffers, CacheView};
use crate::error::{Result, RuntimeError};

/// Byte written into allocated but unused page blocks.
const POISON_BYTE: u8 = 0xA5;

/// One batch's cache on the device, uploaded from the CPU reference.
pub struct GpuCache {
    spec: SchemeSpec,
    batch: usize,
    kv_heads: usize,
    head_dim: usize,
    max_pages: usize,
    max_len: usize,
    buffers: CacheBuffers,
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
pub(crate) fn upload<T: cudarc::driver::DeviceRepr + Copy>(
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
            buffers: CacheBuffers {
                k_pool: upload(stream, &k.pool, POISON_BYTE, "K page pool")?,
                v_pool: upload(stream, &v.pool, POISON_BYTE, "V page pool")?,
                page_table: upload(stream, &page_table, -1, "page table")?,
                k_sink: upload(stream, &k.sink, 0xFFFF, "K sink")?,
                v_sink: upload(stream, &v.sink, 0xFFFF, "V sink")?,
                k_tail: upload(stream, &k.tail, 0xFFFF, "K tail")?,
                v_tail: upload(stream, &v.tail, 0xFFFF, "V tail")?,
                seq_lens: upload(stream, &seq_lens, 0, "sequence lengths")?,
            },
        })
    }

    /// The device buffers, for [`DecodeKernel::attend`](super::DecodeKernel::attend).
    pub fn view(&self) -> CacheView<'_> {
        self.buffers.view(
            &self.spec,
            self.batch,
            self.kv_heads,
            self.head_dim,
            self.max_pages,
        )
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
        let b = &self.buffers;
        b.k_pool.len()
            + b.v_pool.len()
            + 2 * (b.k_sink.len() + b.v_sink.len() + b.k_tail.len() + b.v_tail.len())
    }
}
