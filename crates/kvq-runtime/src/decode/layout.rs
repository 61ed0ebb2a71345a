//! The device layout of a batch's paged cache: what the generated decode kernels index, what
//! [`GpuCache`](super::GpuCache) uploads into and what the paged cache manager
//! ([`PagedKvCache`](crate::PagedKvCache)) keeps.
//!
//! - `k_pool`, `v_pool`: page blocks `[physical page][kv_head][block_bytes]`;
//! - `page_table`: `[slot][max_pages]` physical page of each logical page (K and V share it);
//! - `k_sink`, `v_sink`: `[slot][kv_heads][sink][head_dim]` f16;
//! - `k_tail`, `v_tail`: `[slot][kv_heads][tail_capacity][head_dim]` f16 rings, token `t` at
//!   position `(t − sink_end) % tail_capacity`;
//! - `seq_lens`: `[slot]`.
//!
//! A *slot* is a sequence's place in the per-sequence buffers. Without a slot list a launch's batch
//! row `b` is slot `b`; an engine's launches name each row's slot (`seq_slots`), so its sequences
//! keep their slots while batches change.

use cudarc::driver::CudaSlice;
use kvq_jit::launch::{Input, Output};
use kvq_spec::SchemeSpec;

/// Borrowed device buffers of a paged cache, each laid out as its field says (docs/LAYOUT.md has the
/// blocks' bytes): what the decode kernels read. Any cache manager that keeps this layout can be
/// attended by [`DecodeKernel`](super::DecodeKernel).
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

/// The layout's device buffers, owned: one set per cache, lent to the kernels as a [`CacheView`].
pub(crate) struct CacheBuffers {
    pub(crate) k_pool: CudaSlice<u8>,
    pub(crate) v_pool: CudaSlice<u8>,
    pub(crate) page_table: CudaSlice<i32>,
    pub(crate) k_sink: CudaSlice<u16>,
    pub(crate) v_sink: CudaSlice<u16>,
    pub(crate) k_tail: CudaSlice<u16>,
    pub(crate) v_tail: CudaSlice<u16>,
    pub(crate) seq_lens: CudaSlice<i32>,
}

impl CacheBuffers {
    /// The buffers as the kernels see them: `batch` rows of `kv_heads` heads of `head_dim`
    /// channels, stored with `spec`, `max_pages` columns in the page table.
    pub(crate) fn view<'a>(
        &'a self,
        spec: &'a SchemeSpec,
        batch: usize,
        kv_heads: usize,
        head_dim: usize,
        max_pages: usize,
    ) -> CacheView<'a> {
        CacheView {
            spec,
            batch,
            kv_heads,
            head_dim,
            max_pages,
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
}

/// A cache in memory the caller owns (an engine's): device pointers to buffers laid out as
/// [`CacheView`]'s fields say, per sequence slot (module docs). Launches on it are `unsafe`: the
/// caller vouches that each pointer holds what its field says for these sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachePtrs {
    /// KV heads per sequence.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Columns of `page_table`.
    pub max_pages: usize,
    /// `[physical page][kv_head][block]` bytes.
    pub k_pool: u64,
    /// `[physical page][kv_head][block]` bytes.
    pub v_pool: u64,
    /// `[slot][max_pages]` i32.
    pub page_table: u64,
    /// `[slot][kv_heads][sink][head_dim]` f16 (any pointer where the scheme keeps no sink).
    pub k_sink: u64,
    /// As `k_sink`, for V.
    pub v_sink: u64,
    /// `[slot][kv_heads][local+page][head_dim]` f16 ring (any pointer for an FP16 tensor).
    pub k_tail: u64,
    /// As `k_tail`, for V.
    pub v_tail: u64,
    /// `[slot]` i32 tokens per sequence.
    pub seq_lens: u64,
}

/// Either kind of cache, as a launch passes it.
#[derive(Clone, Copy)]
pub(crate) struct CacheArgs<'a> {
    pub kv_heads: usize,
    pub max_pages: usize,
    pub k_pool: Input<'a, u8>,
    pub v_pool: Input<'a, u8>,
    pub page_table: Input<'a, i32>,
    pub k_sink: Input<'a, u16>,
    pub v_sink: Input<'a, u16>,
    pub k_tail: Input<'a, u16>,
    pub v_tail: Input<'a, u16>,
    pub seq_lens: Input<'a, i32>,
}

impl<'a> From<CacheView<'a>> for CacheArgs<'a> {
    fn from(c: CacheView<'a>) -> Self {
        CacheArgs {
            kv_heads: c.kv_heads,
            max_pages: c.max_pages,
            k_pool: Input::Slice(c.k_pool),
            v_pool: Input::Slice(c.v_pool),
            page_table: Input::Slice(c.page_table),
            k_sink: Input::Slice(c.k_sink),
            v_sink: Input::Slice(c.v_sink),
            k_tail: Input::Slice(c.k_tail),
            v_tail: Input::Slice(c.v_tail),
            seq_lens: Input::Slice(c.seq_lens),
        }
    }
}

impl From<&CachePtrs> for CacheArgs<'static> {
    fn from(c: &CachePtrs) -> Self {
        CacheArgs {
            kv_heads: c.kv_heads,
            max_pages: c.max_pages,
            k_pool: Input::Raw(c.k_pool),
            v_pool: Input::Raw(c.v_pool),
            page_table: Input::Raw(c.page_table),
            k_sink: Input::Raw(c.k_sink),
            v_sink: Input::Raw(c.v_sink),
            k_tail: Input::Raw(c.k_tail),
            v_tail: Input::Raw(c.v_tail),
            seq_lens: Input::Raw(c.seq_lens),
        }
    }
}

/// Either kind of cache, as the cache kernels (prefill, append) write it.
pub(crate) struct CacheMut<'a> {
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_pages: usize,
    pub k_pool: Output<'a, u8>,
    pub v_pool: Output<'a, u8>,
    pub page_table: Input<'a, i32>,
    pub k_sink: Output<'a, u16>,
    pub v_sink: Output<'a, u16>,
    pub k_tail: Output<'a, u16>,
    pub v_tail: Output<'a, u16>,
    pub seq_lens: Output<'a, i32>,
}

impl From<&CachePtrs> for CacheMut<'static> {
    fn from(c: &CachePtrs) -> Self {
        CacheMut {
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            max_pages: c.max_pages,
            k_pool: Output::Raw(c.k_pool),
            v_pool: Output::Raw(c.v_pool),
            page_table: Input::Raw(c.page_table),
            k_sink: Output::Raw(c.k_sink),
            v_sink: Output::Raw(c.v_sink),
            k_tail: Output::Raw(c.k_tail),
            v_tail: Output::Raw(c.v_tail),
            seq_lens: Output::Raw(c.seq_lens),
        }
    }
}

impl CacheBuffers {
    /// The buffers as the cache kernels write them, for `kv_heads` heads of `head_dim` channels
    /// and `max_pages` page-table columns.
    pub(crate) fn writable(
        &mut self,
        kv_heads: usize,
        head_dim: usize,
        max_pages: usize,
    ) -> CacheMut<'_> {
        CacheMut {
            kv_heads,
            head_dim,
            max_pages,
            k_pool: Output::Slice(&mut self.k_pool),
            v_pool: Output::Slice(&mut self.v_pool),
            page_table: Input::Slice(&self.page_table),
            k_sink: Output::Slice(&mut self.k_sink),
            v_sink: Output::Slice(&mut self.v_sink),
            k_tail: Output::Slice(&mut self.k_tail),
            v_tail: Output::Slice(&mut self.v_tail),
            seq_lens: Output::Slice(&mut self.seq_lens),
        }
    }
}
