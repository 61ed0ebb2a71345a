//! The paged quantized KV cache an engine drives every step (one per layer): a page pool shared by
//! sequences, per-sequence page tables, FP16 sink buffers and tail rings, and the kernels that fill
//! them — bulk prefill, lazy append (a page is quantized only when an append fills it, at most once
//! every `page` steps per sequence), and attend through the fused decode kernel.
//!
//! Layout and steps: docs/LAYOUT.md and docs/CACHE.md.

mod cache;
mod kernels;
mod pages;

pub use cache::{CacheConfig, MemoryReport, PagedKvCache, QuantizeTiming, SequenceSnapshot};
pub use pages::{PageBook, SeqId};
