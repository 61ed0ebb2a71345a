//! The device layout of a batch's paged cache: what the generated decode kernels index, what
//! [`GpuCache`](super::GpuCache) uploads into and what the paged cache manager
//! ([`PagedKvCache`](crate::PagedKvCache)) keeps.
//!
//! - `k_pool`, `v_pool`: page blocks `[physical page][kv_head][block_bytes]`;
//! - `page_table`: `[batch][max_pages]` physical page of each logical page (K and V share a slot);
//! - `k_sink`, `v_sink`: `[batch][kv_heads][sink][head_dim]` f16;
//! - `k_tail`, `v_tail`: `[batch][kv_heads][tail_capacity][head_dim]` f16 rings, token `t` at slot
//!   `(t − sink_end) % tail_capacity`;
//! - `seq_lens`: `[batch]`.

use cudarc::driver::CudaSlice;
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
