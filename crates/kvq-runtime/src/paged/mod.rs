//! The paged quantized KV cache an engine drives every step (one per layer): a page pool shared by
//! sequences, per-sequence page tables, FP16 sink buffers and tail rings, and the kernels that fill
//! them — bulk prefill, lazy append (a page is quantized only when an append fills it, at most once
//! every `page` steps per sequence), and attend through the fused decode kernel.
//!
//! Layout and steps: docs/LAYOUT.md and docs/CACHE.md.

mod append;
mod cache;
mod forms;
mod kernels;
mod pages;
mod prefill;
mod sizes;
mod snapshot;
mod writer;

pub(crate) use cache::Rows;
pub use cache::{CacheConfig, MemoryReport, PagedKvCache, QuantizeTiming};
pub use forms::{
    choose_forms, choose_forms_in, forms_candidates, forms_or_tiled, stored_forms, stored_forms_in,
    tune_forms, FormTiming, FormsEntry, FormsKey,
};
pub use pages::{PageBook, SeqId};
pub use sizes::CacheSizes;
pub use snapshot::SequenceSnapshot;
pub use writer::CacheWriter;
