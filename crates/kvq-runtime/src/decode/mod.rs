//! Fused decode attention on the GPU: load the generated kernels for a scheme and shape
//! ([`DecodeKernel`]), hold a batch's paged cache in device memory ([`GpuCache`]), and run the
//! split-K decode + combine on a stream ([`DecodeKernel::attend`]).
//!
//! The cache here is uploaded from the CPU reference's packed bytes (`kvq_reference::int`), so the
//! GPU reads exactly the layout the reference defines (`docs/LAYOUT.md`).

mod block;
mod cache;
mod fast_memory;
mod kernel;
mod layout;
mod splits;

pub use block::{
    few_pairs_blocks, one_tile_blocks, rule_block, whole_pair_waves, whole_pairs_blocks,
    BlockSplits, FewPairsBlock, OneTileBlock, RuleBlock, WholePairsBlock, BOOSTED_ONE_TILE_BLOCK,
    BOOSTED_ONE_TILE_MAX_PAIRS, FP16_FEW_PAIRS_BLOCK, FP16_FEW_PAIRS_MAX, FP16_MIDDLE_PAIRS,
    FP16_MIDDLE_PAIRS_BUCKETS, FP16_ONE_TILE_BLOCKS, FP16_ONE_TILE_MAX_PAIRS, LOW_BIT_FEW_PAIRS,
    LOW_BIT_FEW_PAIRS_BLOCK, LOW_BIT_FEW_PAIRS_BUCKETS, SHORT_STAGING_FEW_PAIRS_BLOCK,
    SHORT_STAGING_FEW_PAIRS_MAX, SHORT_STAGING_FEW_PAIRS_MIN_BUCKET, SHORT_STAGING_MIDDLE_BUCKETS,
    SHORT_STAGING_MIDDLE_PAIRS,
};
pub use cache::GpuCache;
pub use fast_memory::{
    fast_memory_applies, fast_memory_block, is_fast_memory, FAST_MEMORY_GBPS_PER_SM,
    FAST_MEMORY_MIN_WARP_TOKENS, FAST_MEMORY_TILE64_MIN_WARP_TOKENS,
};
pub use kernel::{DecodeKernel, DecodeScratch, LoadOptions, RANGE_SCALE_MAX_SPLITS};
pub(crate) use layout::CacheBuffers;
pub use layout::CacheView;
pub(crate) use splits::context_bucket;
pub use splits::{
    default_pieces, default_splits, min_warp_tokens, pieces_rule, scores_stored_at_any_gqa,
    short_staging_by_default, store_scores_by_default, Pieces, PIECES_FEW_SPLITS_MIN_WARP_TOKENS,
    PIECES_MAX_FEW_SPLIT_WARPS, PIECES_MIN_WARP_TOKENS, SHORT_CONTEXT_BUCKET,
    SHORT_STAGING_MIN_WARP_TOKENS, SHORT_WARP_TOKENS, STORED_SCORES_MAX_GQA, WARP_TOKENS,
};
