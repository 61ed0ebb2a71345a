//! Fused decode attention on the GPU: load the generated kernels for a scheme and shape
//! ([`DecodeKernel`]), hold a batch's paged cache in device memory ([`GpuCache`]), and run the
//! split-K decode + combine on a stream ([`DecodeKernel::attend`]).
//!
//! The cache here is uploaded from the CPU reference's packed bytes (`kvq_reference::int`), so the
//! GPU reads exactly the layout the reference defines (`docs/LAYOUT.md`). The untuned launch
//! rules (block, splits, pieces) are data in [`kvq_codegen::rules`]; the functions here name them
//! for the runtime's callers.

mod block;
mod cache;
mod fast_memory;
mod kernel;
mod layout;
mod merge;
mod scratch;
mod splits;

pub use block::{
    few_pairs_blocks, one_tile_blocks, whole_pair_waves, whole_pairs_blocks, BlockSplits, RuleBlock,
};
pub(crate) use cache::upload;
pub use cache::GpuCache;
pub use fast_memory::{fast_memory_applies, is_fast_memory, FAST_MEMORY_GBPS_PER_SM};
pub use kernel::{DecodeKernel, LoadOptions, RANGE_SCALE_MAX_SPLITS};
pub(crate) use layout::{CacheArgs, CacheBuffers, CacheMut};
pub use layout::{CachePtrs, CacheView};
pub use merge::MergeKernel;
pub use scratch::{DecodeScratch, WorkspaceLayout, WORKSPACE_ALIGNMENT};
pub use splits::{
    default_pieces, default_splits, min_warp_tokens, DecodeOptions, Pieces, PiecesOverride,
};
