//! The sizes of a paged cache's device buffers, from the scheme and the cache's limits alone (no
//! GPU): what [`PagedKvCache`](super::PagedKvCache) allocates, and what an engine that owns the
//! memory must hand the kernels. One function computes both, so they cannot drift apart.
//!
//! Every product is checked: limits too large for the address space are an error, never a
//! wrapped size.

use kvq_spec::{SchemeSpec, TensorQuant};

use super::cache::CacheConfig;
use super::pages::PageBook;
use crate::error::{Result, RuntimeError};

/// Sizes of one paged cache's buffers (docs/LAYOUT.md has their layout). Pools are in bytes, FP16
/// buffers in halves; a buffer a scheme does not use (an FP16 tensor's sink or ring) has 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSizes {
    /// Bytes of one K page block of one KV head.
    pub k_block_bytes: usize,
    /// Bytes of one V page block of one KV head.
    pub v_block_bytes: usize,
    /// Tokens of one page (the scheme's quantization group along tokens).
    pub page_tokens: usize,
    /// Logical pages of the longest sequence: the page table's columns.
    pub max_pages: usize,
    /// `[pool page][kv_head][k_block_bytes]`.
    pub k_pool_bytes: usize,
    /// `[pool page][kv_head][v_block_bytes]`.
    pub v_pool_bytes: usize,
    /// FP16 sink tokens a sequence keeps of K (0 when K is FP16 throughout).
    pub k_sink_tokens: usize,
    /// As `k_sink_tokens`, for V.
    pub v_sink_tokens: usize,
    /// Slots of a sequence's FP16 K tail ring (local window + one page being filled).
    pub k_ring_tokens: usize,
    /// As `k_ring_tokens`, for V.
    pub v_ring_tokens: usize,
    /// `[sequence slot][kv_head][k_sink_tokens][head_dim]` halves.
    pub k_sink_halves: usize,
    /// `[sequence slot][kv_head][v_sink_tokens][head_dim]` halves.
    pub v_sink_halves: usize,
    /// `[sequence slot][kv_head][k_ring_tokens][head_dim]` halves.
    pub k_tail_halves: usize,
    /// `[sequence slot][kv_head][v_ring_tokens][head_dim]` halves.
    pub v_tail_halves: usize,
    /// `[sequence slot][max_pages]` page-table entries (i32).
    pub page_table_entries: usize,
}

impl CacheSizes {
    /// The sizes of a cache of `cfg`'s limits storing `spec`; an empty cache (no KV heads,
    /// sequence slots or tokens), a shape the scheme cannot store or sizes past the address space
    /// are errors.
    pub fn new(spec: &SchemeSpec, cfg: &CacheConfig) -> Result<CacheSizes> {
        if cfg.kv_heads == 0 || cfg.max_seqs == 0 || cfg.max_tokens == 0 {
            return Err(RuntimeError::InvalidInput(format!(
                "an empty cache: {cfg:?} (kv_heads, max_seqs and max_tokens must be at least 1)"
            )));
        }
        spec.check_shape_usize(cfg.head_dim, cfg.kv_heads)
            .map_err(|e| RuntimeError::InvalidInput(e.to_string()))?;
        let (h, d) = (cfg.kv_heads, cfg.head_dim);
        let k_block_bytes = block_bytes(spec, &spec.k, d)?;
        let v_block_bytes = block_bytes(spec, &spec.v, d)?;
        let max_pages = PageBook::new(*spec, 0, 0, cfg.max_tokens).max_pages_per_seq();
        let sink = |t: &TensorQuant| {
            if t.is_quantized() {
                spec.sink as usize
            } else {
                0
            }
        };
        let ring = |t: &TensorQuant| match t {
            TensorQuant::Fp16 => 0,
            _ => (spec.local_of(t) + spec.page) as usize,
        };
        let per_slot = |tokens: usize, what: &str| product(&[cfg.max_seqs, h, tokens, d], what);
        Ok(CacheSizes {
            k_block_bytes,
            v_block_bytes,
            page_tokens: spec.page as usize,
            max_pages,
            k_pool_bytes: product(&[cfg.pool_pages, h, k_block_bytes], "the K page pool")?,
            v_pool_bytes: product(&[cfg.pool_pages, h, v_block_bytes], "the V page pool")?,
            k_sink_tokens: sink(&spec.k),
            v_sink_tokens: sink(&spec.v),
            k_ring_tokens: ring(&spec.k),
            v_ring_tokens: ring(&spec.v),
            k_sink_halves: per_slot(sink(&spec.k), "the K sinks")?,
            v_sink_halves: per_slot(sink(&spec.v), "the V sinks")?,
            k_tail_halves: per_slot(ring(&spec.k), "the K tail rings")?,
            v_tail_halves: per_slot(ring(&spec.v), "the V tail rings")?,
            page_table_entries: product(&[cfg.max_seqs, max_pages], "the page table")?,
        })
    }

    /// Bytes of one pool page: K and V blocks of every KV head.
    pub fn page_bytes(&self, kv_heads: usize) -> usize {
        (self.k_block_bytes + self.v_block_bytes) * kv_heads
    }

    /// Bytes of the FP16 sinks and tail rings (K and V) of all sequence slots.
    pub fn fp16_state_bytes(&self) -> usize {
        2 * (self.k_sink_halves + self.v_sink_halves + self.k_tail_halves + self.v_tail_halves)
    }
}

/// `factors` multiplied, or an error naming `what` when the product overflows.
fn product(factors: &[usize], what: &str) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| {
            RuntimeError::InvalidInput(format!(
                "{what} would take more than {} bytes ({factors:?} multiplied)",
                usize::MAX
            ))
        })
}

/// Bytes of one page block of one KV head of tensor `t`.
pub(crate) fn block_bytes(spec: &SchemeSpec, t: &TensorQuant, head_dim: usize) -> Result<usize> {
    match t {
        TensorQuant::Int(q) => kvq_reference::int::IntLayout::new(q, head_dim, spec.page as usize)
            .map(|l| l.block_bytes)
            .map_err(|e| RuntimeError::InvalidInput(e.to_string())),
        _ => Ok(kvq_reference::int::fp16_block_bytes(
            head_dim,
            spec.page as usize,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq_codegen::Dtype;

    fn cfg(head_dim: usize, max_seqs: usize, pool_pages: usize, max_tokens: usize) -> CacheConfig {
        CacheConfig {
            kv_heads: 8,
            head_dim,
            max_seqs,
            pool_pages,
            max_tokens,
            input_dtype: Dtype::F16,
        }
    }

    #[test]
    fn kivi2_sizes_follow_the_layout() {
        // KIVI-2 at d128, page 128: 2-bit codes (32 bytes a token... of K by channel) plus an f16
        // scale and zero per channel (K) or per token (V) group.
        let spec: SchemeSpec = "k = int(2, channel), v = int(2, token), sink = 4, local = 32"
            .parse()
            .unwrap();
        let s = CacheSizes::new(&spec, &cfg(128, 3, 10, 1000)).unwrap();
        assert_eq!(s.page_tokens, 128);
        let codes = 128 * 128 * 2 / 8;
        assert!(s.k_block_bytes > codes && s.k_block_bytes <= codes + 128 * 8);
        assert!(s.v_block_bytes > codes && s.v_block_bytes <= codes + 128 * 8);
        assert_eq!(s.k_pool_bytes, 10 * 8 * s.k_block_bytes);
        assert_eq!(s.k_sink_halves, 3 * 8 * 4 * 128);
        assert_eq!(s.k_tail_halves, 3 * 8 * (32 + 128) * 128);
        // 1000 tokens: 4 sink, at least 32 local, the rest in pages of 128.
        assert_eq!(s.max_pages, (1000 - 4 - 32) / 128);
        assert_eq!(s.page_table_entries, 3 * s.max_pages);
        assert_eq!(s.page_bytes(8), 8 * (s.k_block_bytes + s.v_block_bytes));
    }

    #[test]
    fn an_fp16_tensor_keeps_no_sink_or_ring() {
        let spec: SchemeSpec = "k = fp16, v = int(4, token), sink = 4, local = 32"
            .parse()
            .unwrap();
        let s = CacheSizes::new(&spec, &cfg(64, 2, 4, 512)).unwrap();
        assert_eq!((s.k_sink_halves, s.k_tail_halves), (0, 0));
        assert!(s.v_sink_halves > 0 && s.v_tail_halves > 0);
        assert_eq!(s.k_block_bytes, 128 * 64 * 2);
    }

    #[test]
    fn empty_unstorable_and_overflowing_limits_are_errors() {
        let spec: SchemeSpec = "k = int(2, channel), v = int(2, token)".parse().unwrap();
        for (bad, says) in [
            (cfg(128, 0, 4, 512), "empty cache"),
            (cfg(128, 2, 4, 0), "empty cache"),
            (cfg(100, 2, 4, 512), "head_dim"),
            (cfg(128, usize::MAX / 4, 4, 512), "would take more than"),
            (cfg(128, 2, usize::MAX / 2, 512), "K page pool"),
        ] {
            let e = CacheSizes::new(&spec, &bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
