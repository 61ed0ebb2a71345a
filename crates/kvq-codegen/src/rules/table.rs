//! The launch rules as data: every number and block the untuned launches take, in one place.
//!
//! The evaluator ([`super::LaunchRules`]) reads these tables; nothing else states them. Each row
//! was measured on an H100 (132 SMs) at GQA 4 in f16 unless it says otherwise, against the choice
//! it replaced in the same run; docs/TUNING.md explains them and docs/BENCHMARKS.md has the
//! current tables.

use super::{BlockEdit, BlockRule, CodegenFamily, Constants, DefaultBlock, Family, Span, When};

/// The codegen default's threads and tile away from head_dim 128, where another block measured
/// faster over B ∈ {1, 4, 16} × L ∈ {1K, 4K, 32K} (GQA 4, f16, against head_dim 128's block),
/// as rows of head_dims, families and block. A tile's bytes grow with head_dim,
/// so the tuner's tiles shrank as head_dim grew:
/// - head_dim 256: INT8 and KIVI-4 four-warp CTAs of 16-token tiles (geomeans ×1.32 and ×1.20),
///   FP16 two-warp CTAs of 16-token tiles (×1.06), Kitty and Kitty-Pro four-warp CTAs of 32-token
///   tiles (×1.15 and ×1.17). kivi2 and CalibQuant keep theirs: each smaller tile lost
///   ×0.70–×0.96.
/// - head_dim 160 and 192 (H200, B=16 L=32K): INT8 four-warp CTAs of 16-token tiles, ×1.57 and
///   ×1.88 over the generic default; KIVI-4, Kitty and Kitty-Pro lost ×0.70–×0.97 with 256's
///   blocks and FP16 ran ×1.00–×1.01, so they keep the generic default.
/// - head_dim 64: FP16 and INT8 four-warp CTAs of 32-token tiles (×1.05 and ×1.03); the 1-, 2-
///   and 4-bit kernels lost ×0.82–×0.91 with them.
///
/// Head dims 80–112 take head_dim 128's rules (`rule_head_dim`), so they need no row here.
pub const DEFAULT_BLOCKS: &[DefaultBlock] = &[
    DefaultBlock::new(&[160, 192, 256], &[CodegenFamily::EightBit], 128, 16),
    DefaultBlock::new(&[256], &[CodegenFamily::FourBit], 128, 16),
    DefaultBlock::new(&[256], &[CodegenFamily::Fp16], 64, 16),
    DefaultBlock::new(&[256], &[CodegenFamily::BoostedKeys], 128, 32),
    DefaultBlock::new(
        &[64],
        &[CodegenFamily::Fp16, CodegenFamily::EightBit],
        128,
        32,
    ),
];

const fn block(threads: u32, tile_tokens: u32) -> BlockEdit {
    BlockEdit {
        threads,
        tile_tokens,
        min_warps_per_sm: None,
        pack_heads: None,
        short_staging: None,
        store_scores: None,
    }
}

const fn floor(mut b: BlockEdit, warps: u32) -> BlockEdit {
    b.min_warps_per_sm = Some(warps);
    b
}

const fn scores(mut b: BlockEdit, stored: bool) -> BlockEdit {
    b.store_scores = Some(stored);
    b
}

const fn short(mut b: BlockEdit) -> BlockEdit {
    b.short_staging = Some(true);
    b
}

const fn unpacked(mut b: BlockEdit) -> BlockEdit {
    b.pack_heads = Some(false);
    b
}

const fn whole(waves: Span, buckets: Span) -> When {
    When::WholePairs { waves, buckets }
}

const FP16S: &[Family] = &[Family::Fp16, Family::Fp16TwoTiles];
const LOW_BITS: &[Family] = &[Family::LowBit, Family::BoostedLowBit];

/// The block rules at head_dim 128, in the order they are tried (the first that applies wins):
/// every whole-pairs row, then every one-tile row, then every few-pairs row. A launch no row
/// applies to takes the codegen default.
///
/// **Whole pairs** (one split a (sequence, KV head), no pieces, no combine): where the pairs fill
/// `waves` waves of SMs at least 90% and the context bucket is short, the combine's launch and
/// the partials it reads weigh more than the warps more splits would add. A block of `W` waves
/// holds `W` CTAs an SM (eight warps one, four warps under the twelve-warp floor three, two warps
/// six). Measured at B ∈ {16, 24, 32, 48, 64} × L ∈ {1K … 8K}:
/// - uncalibrated 1- and 2-bit: one wave eight-warp CTAs of 32-token tiles up to 4K
///   (×1.10–×1.38); two or three waves four-warp CTAs of 32-token tiles up to 2K and of 64 over
///   4K–8K (×1.06–×1.49); four waves two-warp CTAs of 64-token tiles up to 8K (×1.04–×1.42);
/// - calibrated (CalibQuant): one wave eight-warp CTAs, keys scored twice up to 1K (×1.21–×1.30)
///   and stored scores over 2K–8K (×1.02–×1.19); two waves four-warp CTAs without the floor,
///   likewise up to 2K (×1.22–×1.36) and over 4K–8K (×1.09–×1.15); four waves two-warp CTAs with
///   stored scores up to 4K (×1.01–×1.16); at three waves every block tried lost;
/// - 8-bit: one wave eight-warp CTAs of 16-token tiles up to 8K (×1.02–×1.14);
/// - 4-bit on the short staging path (KIVI-4): one wave eight-warp CTAs of 16-token tiles up to
///   1K (×1.10–×1.21);
/// - FP16: one wave eight-warp CTAs of 32-token tiles up to 4K (×1.05–×1.17); two or three waves
///   four-warp CTAs of 64-token tiles up to 4K (×1.00–×1.19); four waves the codegen's two-warp
///   CTAs up to 2K (×1.05–×1.21). The floor is the default's: FP16's two-tile kernels (past 8
///   query heads a KV head) have none, as it would spill their registers.
///
/// **One tile a warp** (splits = bucket / (tile · warps)), where that grid fits one wave of the
/// CTAs the block's floor holds on an SM: every warp reads its one tile from the start.
/// - FP16 up to 64 pairs: four-warp CTAs of 16-token tiles (×1.24–×1.43 where they fit), then of
///   32 (×1.14–×1.15);
/// - Kitty's boosted keys up to 32 pairs: four-warp CTAs of 16-token tiles (×1.00–×1.18).
///
/// **Few pairs**, where the grid is all splits and another block divides the work better:
/// - FP16 up to 16 pairs at any bucket and 17–64 pairs up to 16K: four-warp CTAs of 32-token
///   tiles (×1.01–×1.09 at B ≤ 2 over 8K–64K; ×0.997–×1.083 at B ≤ 8 up to 16K); its two-tile
///   kernels eight-warp CTAs of 32-token tiles (×1.03–×1.14 at GQA 11 and 16);
/// - 4-bit on the short staging path: 32-token tiles on the short path up to 64 pairs from 4K
///   (×0.997–×1.135) and at 64–256 pairs over 1K–8K (×1.03–×1.10), the split count filling the
///   codegen default block's waves;
/// - uncalibrated 1- and 2-bit at 32–64 pairs over 2K–8K: 32-token tiles unpacked (×0.99–×1.13).
pub const BLOCK_RULES: &[BlockRule] = &[
    // Whole pairs.
    BlockRule {
        families: LOW_BITS,
        when: whole(Span::new(1, 1), Span::new(0, 4096)),
        block: floor(block(256, 32), 0),
    },
    BlockRule {
        families: LOW_BITS,
        when: whole(Span::new(2, 3), Span::new(0, 2048)),
        block: floor(block(128, 32), 12),
    },
    BlockRule {
        families: LOW_BITS,
        when: whole(Span::new(2, 3), Span::new(4096, 8192)),
        block: floor(block(128, 64), 12),
    },
    BlockRule {
        families: LOW_BITS,
        when: whole(Span::new(4, 4), Span::new(0, 8192)),
        block: floor(block(64, 64), 12),
    },
    BlockRule {
        families: &[Family::CalibratedLowBit],
        when: whole(Span::new(1, 1), Span::new(0, 1024)),
        block: scores(floor(block(256, 32), 0), false),
    },
    BlockRule {
        families: &[Family::CalibratedLowBit],
        when: whole(Span::new(1, 1), Span::new(2048, 8192)),
        block: scores(floor(block(256, 32), 0), true),
    },
    BlockRule {
        families: &[Family::CalibratedLowBit],
        when: whole(Span::new(2, 2), Span::new(0, 2048)),
        block: scores(floor(block(128, 64), 0), false),
    },
    BlockRule {
        families: &[Family::CalibratedLowBit],
        when: whole(Span::new(2, 2), Span::new(4096, 8192)),
        block: scores(floor(block(128, 64), 0), true),
    },
    BlockRule {
        families: &[Family::CalibratedLowBit],
        when: whole(Span::new(4, 4), Span::new(0, 4096)),
        block: scores(floor(block(64, 64), 12), true),
    },
    BlockRule {
        families: &[Family::EightBit],
        when: whole(Span::new(1, 1), Span::new(0, 8192)),
        block: floor(block(256, 16), 0),
    },
    BlockRule {
        families: &[Family::ShortStaging],
        when: whole(Span::new(1, 1), Span::new(0, 1024)),
        block: short(floor(block(256, 16), 0)),
    },
    BlockRule {
        families: FP16S,
        when: whole(Span::new(1, 1), Span::new(0, 4096)),
        block: floor(block(256, 32), 0),
    },
    BlockRule {
        families: FP16S,
        when: whole(Span::new(2, 3), Span::new(0, 4096)),
        block: block(128, 64),
    },
    BlockRule {
        families: FP16S,
        when: whole(Span::new(4, 4), Span::new(0, 2048)),
        block: block(64, 64),
    },
    // One tile a warp.
    BlockRule {
        families: FP16S,
        when: When::OneTile {
            pairs: Span::new(1, 64),
        },
        block: block(128, 16),
    },
    BlockRule {
        families: FP16S,
        when: When::OneTile {
            pairs: Span::new(1, 64),
        },
        block: block(128, 32),
    },
    BlockRule {
        families: &[Family::BoostedLowBit],
        when: When::OneTile {
            pairs: Span::new(1, 32),
        },
        block: block(128, 16),
    },
    // Few pairs.
    BlockRule {
        families: &[Family::Fp16],
        when: When::FewPairs {
            pairs: Span::new(1, 16),
            buckets: Span::from(0),
            splits_from_default: false,
        },
        block: block(128, 32),
    },
    BlockRule {
        families: &[Family::Fp16],
        when: When::FewPairs {
            pairs: Span::new(17, 64),
            buckets: Span::new(0, 16384),
            splits_from_default: false,
        },
        block: block(128, 32),
    },
    BlockRule {
        families: &[Family::Fp16TwoTiles],
        when: When::FewPairs {
            pairs: Span::new(1, 16),
            buckets: Span::from(0),
            splits_from_default: false,
        },
        block: block(256, 32),
    },
    BlockRule {
        families: &[Family::Fp16TwoTiles],
        when: When::FewPairs {
            pairs: Span::new(17, 64),
            buckets: Span::new(0, 16384),
            splits_from_default: false,
        },
        block: block(256, 32),
    },
    BlockRule {
        families: &[Family::ShortStaging],
        when: When::FewPairs {
            pairs: Span::new(1, 64),
            buckets: Span::from(4096),
            splits_from_default: true,
        },
        block: short(block(128, 32)),
    },
    BlockRule {
        families: &[Family::ShortStaging],
        when: When::FewPairs {
            pairs: Span::new(64, 256),
            buckets: Span::new(1024, 8192),
            splits_from_default: true,
        },
        block: short(block(128, 32)),
    },
    BlockRule {
        families: LOW_BITS,
        when: When::FewPairs {
            pairs: Span::new(32, 64),
            buckets: Span::new(2048, 8192),
            splits_from_default: false,
        },
        block: unpacked(block(128, 32)),
    },
];

/// The numbers of the split, piece, staging, stored-score and fast-memory rules.
pub const CONSTANTS: Constants = Constants {
    // A grid's split count fills at least nine tenths of a wave of resident CTAs: CTAs of one
    // launch take about equal time, so 1.6 waves run as long as two.
    fill_permille: 900,
    most_splits: 256,
    max_splits: 1024,
    // Fewest bucket tokens a split warp gets: 64 in general, 32 for quantized K or V (and FP16's
    // kernels of several head tiles) at buckets up to 4K, where the grid is otherwise too small
    // to fill the GPU (×0.99–×1.31 at B ≤ 4 from 256 tokens to 4K; ×0.90 for Kitty at 8K).
    warp_tokens: 64,
    short_warp_tokens: 32,
    short_context_bucket: 4096,
    // The short staging path of 4-bit K and V pays where a split warp's share of the bucket is
    // long: ×1.009 at 4096 tokens a warp, ×0.967 at 512.
    short_staging_min_warp_tokens: 4096,
    // Stored key scores pay past 4K buckets (×1.06–×1.31 at 32K and 128K, ×0.95–×1.00 at 4K),
    // for keys of 2 bits or more only up to 4 query heads a CTA: past it a key's scores (4 bytes
    // a head, written and read) cost more than reading the key again (×1.003–×1.13 without them
    // at GQA 8). 1-bit keys keep them at any GQA (×0.84–×1.05 without).
    stored_scores_max_gqa: 4,
    // Pieces: two a split over the last tenth of the cost where a split warp's share is 4096
    // tokens or more (8-bit: ×1.01–×1.03; shorter shares ×0.7–×1.0).
    long_shares_min_warp_tokens: 4096,
    long_shares_per_split: 2,
    long_shares_permille: 100,
    // Two pieces a (sequence, KV head) over the last twentieth with at most 16 split warps and
    // shares of at least 256 tokens (uncalibrated 1- and 2-bit: ×1.01–×1.16 at 12 split warps,
    // ×0.60–×0.95 at 48 and more).
    few_splits_max_warps: 16,
    few_splits_min_warp_tokens: 256,
    few_splits_count: 2,
    few_splits_permille: 50,
    // Fast memory: between the H100's 25.4 GB/s an SM and the H200's 36.5. KIVI-4 there ran
    // ×1.05–×1.12 with twelve warps an SM from 668 bucket tokens a split warp, ×0.91–×1.00 at
    // 32–170; 64-token tiles pay on top from 1365 (×1.011–×1.075).
    fast_memory_gbps_per_sm: 30.0,
    fast_memory_warps_per_sm: 12,
    fast_memory_min_warp_tokens: 512,
    fast_memory_tile64_min_warp_tokens: 1024,
    // Whole-pairs blocks need their last wave 90% full: at 73% eight-warp CTAs lost ×0.73–×0.96.
    whole_pairs_fill_permille: 900,
    // Below 256 tokens a split is the only sensible choice, so short contexts share a bucket.
    min_rule_bucket: 256,
};
