//! Blocks (threads, tile and the other compile-time parameters) the untuned default takes instead
//! of the codegen's, by batch shape, context bucket and SM count. [`TuneParams::default_for`]
//! knows only the scheme and the kernel shape; how many (sequence, KV head) pairs a launch has,
//! how long its contexts are and how many SMs share them can call for another block, and for
//! another way of counting its splits. [`rule_block`] applies the rules (whole-pairs blocks, then
//! one-tile blocks, then few-pairs blocks);
//! `TuneChoice::default_block`, `TuneChoice::occupancy_block` and `TuneChoice::heuristic` take
//! what it gives.

use std::ops::RangeInclusive;

use kvq_codegen::{short_staging_changes, store_scores_changes, KernelShape, TuneParams};
use kvq_spec::SchemeSpec;

use crate::tune::{context_bucket, MAX_SPLITS};

/// Most (sequence, KV head) pairs a launch may have for FP16 to take [`FP16_FEW_PAIRS_BLOCK`] at
/// any context bucket: B ≤ 2 at 8 KV heads.
pub const FP16_FEW_PAIRS_MAX: usize = 16;

/// (Sequence, KV head) pairs past [`FP16_FEW_PAIRS_MAX`] at which FP16 takes
/// [`FP16_FEW_PAIRS_BLOCK`] over [`FP16_MIDDLE_PAIRS_BUCKETS`]: B from 3 to 8 at 8 KV heads.
/// Measured on an H100 (docs/BENCHMARKS.md, thirty-fourth round) against the two-warp block, with
/// the splits of each block's own occupancy: B=4 and B=8 ×0.997–×1.083 from 512 tokens to 16K.
pub const FP16_MIDDLE_PAIRS: RangeInclusive<usize> = 17..=64;

/// Context buckets of [`FP16_MIDDLE_PAIRS`]: the longest measured is 16K.
pub const FP16_MIDDLE_PAIRS_BUCKETS: RangeInclusive<usize> = 0..=16384;

/// Threads and tile of FP16's block at head_dim 128 where a launch has few (sequence, KV head)
/// pairs and no [`OneTileBlock`] applies: four-warp CTAs of 32-token tiles instead of two-warp
/// CTAs of 64. With so few pairs the grid is all splits; four warps a CTA halve them (49 instead
/// of 99 at B=1 on an H100), so the combine reads half the partials, and a CTA's warps merge on
/// chip (why the block runs faster was not profiled). Measured on an H100 against the two-warp
/// block in the same run: B=1 ×1.01–×1.09 from 8K to 64K and ×1.00 at 128K, B=2 ×1.03–×1.08 from
/// 8K to 64K and ×1.01 at 128K (thirty-second round); B ≤ 8 ×0.997–×1.083 from 512 tokens to 16K
/// (thirty-fourth round). Where buffers land still matters: at B=1 L=32K this block ran
/// 57.4–58.0 µs at both placement pads, where the two-warp block ran 59.4 at one and 66.6–66.9 at
/// the other, but 65.9 µs in a checked run of every scheme.
pub const FP16_FEW_PAIRS_BLOCK: (u32, u32) = (128, 32);

/// [`FP16_FEW_PAIRS_BLOCK`] for FP16's two-tile kernels (more than 8 query heads a KV head at
/// head_dim 128: `MmaCtx::head_tiles` in kvq-codegen): eight-warp CTAs of 32-token tiles. A
/// two-tile CTA does two one-tile CTAs' work, and the grid has half the rows: with the one-tile
/// kernels' block it took 19.7 µs at B=1 L=4K (GQA 16, H100) where the one-tile kernel had
/// taken 17.2, and the tuner picked this block (16.1 µs). With it, and [`min_warp_tokens`]'s 32
/// tokens a split warp (forty-fourth round, against the one-tile kernel's untuned launch in the
/// same run, docs/BENCHMARKS.md): GQA 16 ×1.03–×1.13 at B=1 L=4K, B=2 over 2K–4K and B ∈ {4, 8}
/// over 1K–4K but B=8 at 1K, GQA 11 ×1.04–×1.14 there. The two-tile kernel's grid fills the
/// GPU worst at B=1 over 1K–2K and B=2 at 1K, where the one-tile blocks (or this one) still run
/// it ×0.91–×0.94 (GQA 16) and ×0.96–×0.98 (GQA 11), and at B=8 L=1K (×0.92 and ×0.98): there
/// the one-tile kernel's two rows made a whole-pairs wave of eight-warp CTAs.
///
/// [`min_warp_tokens`]: super::min_warp_tokens
pub const FP16_TWO_TILE_FEW_PAIRS_BLOCK: (u32, u32) = (256, 32);

/// Most (sequence, KV head) pairs a launch may have for FP16 to take a [`OneTileBlock`]: B ≤ 8 at
/// 8 KV heads, the batches measured.
pub const FP16_ONE_TILE_MAX_PAIRS: usize = 64;

/// FP16's [`OneTileBlock`]s at head_dim 128, in the order [`rule_block`] tries them: four-warp
/// CTAs (twelve warps an SM) of 16-token tiles, then of 32-token tiles. Measured on an H100
/// (docs/BENCHMARKS.md, thirty-fourth round) against the two-warp block of 64-token tiles and
/// its splits: where 16-token tiles fit the wave (B=1 up to 2K, B=2 up to 1K, B=4 at 512 tokens)
/// ×1.24–×1.43; where only 32-token tiles do (B=1 at 4K, B=2 at 2K, B=4 at 1K, B=8 at 512
/// tokens) ×1.14–×1.15. Where neither fits, one tile a warp lost: 16-token tiles ran
/// ×1.05–×1.08 where 32-token ones ran ×1.14–×1.15, and 32-token tiles ×0.945–×0.995 where the
/// few-pairs block ran ×1.005–×1.035.
pub const FP16_ONE_TILE_BLOCKS: [(u32, u32); 2] = [(128, 16), (128, 32)];

/// Most (sequence, KV head) pairs a launch may have for the uncalibrated kernels with Kitty's
/// boosted key channels (Kitty, Kitty-Pro) to take [`BOOSTED_ONE_TILE_BLOCK`]: B ≤ 4 at 8 KV heads.
pub const BOOSTED_ONE_TILE_MAX_PAIRS: usize = 32;

/// Threads and tile of the [`OneTileBlock`] of the uncalibrated kernels with boosted key channels
/// at head_dim 128: four-warp CTAs (twelve warps an SM) of 16-token tiles. Measured on an H100
/// (docs/BENCHMARKS.md, thirty-fourth round) against the default, where its grid fits the wave
/// (B=1 up to 2K, B=2 up to 1K, B=4 at 512 tokens): Kitty ×1.01–×1.17, Kitty-Pro ×1.00–×1.18
/// (×1.06–×1.18 up to 1K at B ≤ 2, ×1.02–×1.07 at B=4 L=512, ×1.00–×1.01 at B=1 L=2K). kivi2
/// ran ×0.96–×1.04 with it, and 32-token tiles gave Kitty and Kitty-Pro ×0.985–×1.04, so
/// neither takes a one-tile block.
pub const BOOSTED_ONE_TILE_BLOCK: (u32, u32) = (128, 16);

/// Most (sequence, KV head) pairs a launch may have for a kernel whose ring stages 4-bit K and V
/// (KIVI-4's) to take [`SHORT_STAGING_FEW_PAIRS_BLOCK`] at any bucket from
/// [`SHORT_STAGING_FEW_PAIRS_MIN_BUCKET`]: B ≤ 8 at 8 KV heads (docs/BENCHMARKS.md,
/// thirty-second round). More pairs take it over [`SHORT_STAGING_MIDDLE_BUCKETS`] only.
pub const SHORT_STAGING_FEW_PAIRS_MAX: usize = 64;

/// Shortest context bucket at which KIVI-4's kernels with few (sequence, KV head) pairs take
/// [`SHORT_STAGING_FEW_PAIRS_BLOCK`]: the shortest measured at B < 8 (B=8 takes it from 1K, as
/// [`SHORT_STAGING_MIDDLE_PAIRS`] includes 64 pairs).
pub const SHORT_STAGING_FEW_PAIRS_MIN_BUCKET: usize = 4096;

/// (Sequence, KV head) pairs and context buckets at which KIVI-4's kernels also take
/// [`SHORT_STAGING_FEW_PAIRS_BLOCK`] past [`SHORT_STAGING_FEW_PAIRS_MAX`] pairs or under
/// [`SHORT_STAGING_FEW_PAIRS_MIN_BUCKET`]: B from 8 to 32 at 8 KV heads over 1K to 8K tokens.
/// Measured on an H100 (docs/BENCHMARKS.md, thirty-third round) against the 64-token block:
/// B=8 ×1.04 and ×1.09–×1.10 at 1K and 2K, B=16 and B=32 ×1.03–×1.10 from 1K to 8K; at 16K and
/// 32K ×0.99–×1.02.
pub const SHORT_STAGING_MIDDLE_PAIRS: RangeInclusive<usize> = 64..=256;

/// Context buckets of [`SHORT_STAGING_MIDDLE_PAIRS`].
pub const SHORT_STAGING_MIDDLE_BUCKETS: RangeInclusive<usize> = 1024..=8192;

/// Threads and tile of KIVI-4's block at head_dim 128 where a launch has few (sequence, KV head)
/// pairs: 32-token tiles on the short staging path instead of 64-token tiles on the general one.
/// Its smaller ring lets an SM hold three CTAs instead of two, but its split count fills waves of
/// the 64-token block's two ([`FewPairsBlock::splits_from_default`]): on an H100 at B ≤ 8 from
/// 4K to 128K (docs/BENCHMARKS.md, thirty-second round) that ran ×0.997–×1.135 (B=1 L=32K
/// ×1.085, L=128K ×1.052), where splits filling three CTAs an SM ran ×0.98–×1.11 (B=1 L=32K
/// ×1.023) and the general path with tiles of 32 lost up to ×0.947.
pub const SHORT_STAGING_FEW_PAIRS_BLOCK: (u32, u32) = (128, 32);

/// (Sequence, KV head) pairs a launch must have for the uncalibrated 1- and 2-bit kernels to
/// take [`LOW_BIT_FEW_PAIRS_BLOCK`]: B from 4 to 8 at 8 KV heads. At B=2 the block ran kivi2
/// ×0.97 at 2K and 4K on an H100 (docs/BENCHMARKS.md, thirty-third round).
pub const LOW_BIT_FEW_PAIRS: RangeInclusive<usize> = 32..=64;

/// Context buckets at which the uncalibrated 1- and 2-bit kernels with
/// [`LOW_BIT_FEW_PAIRS`] take [`LOW_BIT_FEW_PAIRS_BLOCK`]: the tuner kept the default block
/// at 16K, or found at most ×1.01 (thirty-third round), and 1K was not measured with the block.
pub const LOW_BIT_FEW_PAIRS_BUCKETS: RangeInclusive<usize> = 2048..=8192;

/// Threads and tile of the uncalibrated 1- and 2-bit kernels' block at head_dim 128 where a launch
/// has [`LOW_BIT_FEW_PAIRS`] over [`LOW_BIT_FEW_PAIRS_BUCKETS`]: 32-token tiles instead of 64,
/// with Kitty's boosted plane unpacked (`TuneParams::pack_heads` false) and the twelve-warp floor
/// kept. Each split warp's share of a short context is then walked in twice as many, smaller
/// steps (why that runs faster was not profiled). Measured on an H100 (docs/BENCHMARKS.md,
/// thirty-third round) against the 64-token block in the same run: kivi2 ×0.99–×1.09, Kitty and
/// Kitty-Pro ×1.00–×1.13 at B ∈ {4, 8} × L ∈ {2K, 4K, 8K}.
pub const LOW_BIT_FEW_PAIRS_BLOCK: (u32, u32) = (128, 32);

/// Which rule a block of [`rule_block`] comes from, and so how its split count is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockSplits {
    /// `default_splits` fills waves of this block's own occupancy.
    OwnOccupancy,
    /// `default_splits` fills waves of the codegen default block's occupancy
    /// ([`FewPairsBlock::splits_from_default`]).
    DefaultOccupancy,
    /// One split and no pieces: each CTA takes a whole (sequence, KV head)
    /// ([`WholePairsBlock`]).
    OnePerPair,
    /// This many splits, each warp one tile of the context bucket ([`OneTileBlock`]).
    OneTilePerWarp(usize),
}

/// A block the untuned default takes instead of the codegen's ([`rule_block`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleBlock {
    /// The block (the launch variants, short staging and stored scores, as it says).
    pub params: TuneParams,
    /// How its split count is counted.
    pub splits: BlockSplits,
}

/// A block the untuned default takes instead of the codegen's where a launch has few (sequence,
/// KV head) pairs: with few pairs the grid is all splits, and another block divides the work
/// better.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FewPairsBlock {
    /// The block (the launch variants, short staging and stored scores, as it says).
    pub params: TuneParams,
    /// (Sequence, KV head) pairs, batch × KV heads, a launch must have to take it.
    pub pairs: RangeInclusive<usize>,
    /// Context buckets at which a launch takes it.
    pub buckets: RangeInclusive<usize>,
    /// Whether the split count fills waves of the codegen default block's occupancy rather
    /// than of this block's own.
    pub splits_from_default: bool,
}

impl FewPairsBlock {
    /// Whether a launch of `batch` sequences of `kv_heads` KV heads and at most `max_len`
    /// tokens takes this block.
    pub fn applies(&self, batch: usize, kv_heads: usize, max_len: usize) -> bool {
        self.pairs.contains(&(batch * kv_heads)) && self.buckets.contains(&context_bucket(max_len))
    }
}

/// A block whose CTAs each take a whole (sequence, KV head): one split, no pieces, so the decode
/// kernel writes the output itself and no combine runs. Where the pairs fill whole waves of SMs
/// ([`whole_pair_waves`]) and the contexts are short, the combine's launch and the partials it
/// reads weigh more than the warps a split count would add. Each block holds its waves' CTAs on an
/// SM at once: `W` waves take a block of which an SM holds at least `W` CTAs (eight-warp CTAs one,
/// four-warp CTAs under the twelve-warp floor three, two-warp ones six), so every pair runs from
/// the start and an SM's work is `W` pairs. A scheme's blocks ([`whole_pairs_blocks`]) were
/// measured on an H100 (132 SMs; docs/BENCHMARKS.md, thirty-third round) at B ∈ {16, 24, 32, 48,
/// 64} × L ∈ {1K … 8K}.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WholePairsBlock {
    /// The block (stored scores as launched: the heuristic keeps this block's).
    pub params: TuneParams,
    /// Waves of SMs ([`whole_pair_waves`]) a launch's pairs must take.
    pub waves: RangeInclusive<usize>,
    /// Context buckets at which a launch takes it.
    pub buckets: RangeInclusive<usize>,
}

impl WholePairsBlock {
    /// Fewest thousandths of their last wave's SMs the pairs must fill (the same nine tenths
    /// `default_splits` asks of a grid): at B=24 (192 pairs on 132 SMs, 73% of two waves) eight-warp
    /// CTAs lost (×0.73–×0.96) at every shape measured but one (INT8 at L=1K, ×1.02).
    pub const MIN_FILL_PERMILLE: usize = 900;

    /// Whether a launch of `batch` sequences of `kv_heads` KV heads and at most `max_len`
    /// tokens on `sm_count` SMs takes this block.
    pub fn applies(&self, batch: usize, kv_heads: usize, max_len: usize, sm_count: usize) -> bool {
        whole_pair_waves(batch * kv_heads, sm_count).is_some_and(|w| self.waves.contains(&w))
            && self.buckets.contains(&context_bucket(max_len))
    }
}

/// A block whose split warps each take one tile of the context bucket, where the grid that gives
/// fits in one wave of the CTAs the block's occupancy floor holds on an SM
/// ([`OneTileBlock::applies`]): every warp then reads its one tile from the start, and no warp's
/// share is a tile and a part of another. With few pairs and short contexts the grid is
/// otherwise bounded by the tokens a warp must get (`min_warp_tokens`), so it leaves SMs idle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OneTileBlock {
    /// The block, with the occupancy floor that [`OneTileBlock::applies`] counts CTAs by.
    pub params: TuneParams,
    /// (Sequence, KV head) pairs, batch × KV heads, a launch must have to take it.
    pub pairs: RangeInclusive<usize>,
}

impl OneTileBlock {
    /// The splits that give each warp one tile of the context bucket of `max_len`: the bucket
    /// over a CTA's tiles.
    pub fn splits(&self, max_len: usize) -> usize {
        context_bucket(max_len) / (self.params.tile_tokens as usize * self.params.warps()).max(1)
    }

    /// CTAs an SM holds at once under the block's occupancy floor (at least one).
    pub fn floor_ctas_per_sm(&self) -> usize {
        (self.params.min_warps_per_sm as usize / self.params.warps().max(1)).max(1)
    }

    /// Whether a launch of `batch` sequences of `kv_heads` KV heads and at most `max_len`
    /// tokens on `sm_count` SMs takes this block: its pairs are in range, and its grid of
    /// [`OneTileBlock::splits`] splits has CTAs, at most `MAX_SPLITS` splits a pair and at most
    /// [`OneTileBlock::floor_ctas_per_sm`] CTAs an SM.
    pub fn applies(&self, batch: usize, kv_heads: usize, max_len: usize, sm_count: usize) -> bool {
        let (pairs, splits) = (batch * kv_heads, self.splits(max_len));
        self.pairs.contains(&pairs)
            && (1..=MAX_SPLITS).contains(&splits)
            && pairs * splits <= self.floor_ctas_per_sm() * sm_count.max(1)
    }
}

/// The waves of `sm_count` SMs `pairs` (sequence, KV head) pairs take at one an SM, where they
/// fill at least [`WholePairsBlock::MIN_FILL_PERMILLE`] of them; `None` where they do not.
pub fn whole_pair_waves(pairs: usize, sm_count: usize) -> Option<usize> {
    let sms = sm_count.max(1);
    let waves = pairs.div_ceil(sms);
    (pairs > 0 && 1000 * pairs >= WholePairsBlock::MIN_FILL_PERMILLE * waves * sms).then_some(waves)
}

/// The block the untuned default takes for a launch of `batch` sequences of `kv_heads` KV heads
/// (decode grid rows: KV heads times head groups, [`TuneProblem::grid_heads`](crate::TuneProblem::grid_heads))
/// and at most `max_len` tokens on `sm_count` SMs, where a rule gives one: the first of the
/// scheme's [`whole_pairs_blocks`] that applies, else the first of its [`one_tile_blocks`], else
/// the first of its [`few_pairs_blocks`].
/// `None` where the codegen default stays.
pub fn rule_block(
    spec: &SchemeSpec,
    shape: &KernelShape,
    batch: usize,
    kv_heads: usize,
    max_len: usize,
    sm_count: usize,
) -> Option<RuleBlock> {
    if let Some(whole) = whole_pairs_blocks(spec, shape)
        .into_iter()
        .find(|w| w.applies(batch, kv_heads, max_len, sm_count))
    {
        return Some(RuleBlock {
            params: whole.params,
            splits: BlockSplits::OnePerPair,
        });
    }
    if let Some(one) = one_tile_blocks(spec, shape)
        .into_iter()
        .find(|o| o.applies(batch, kv_heads, max_len, sm_count))
    {
        return Some(RuleBlock {
            splits: BlockSplits::OneTilePerWarp(one.splits(max_len)),
            params: one.params,
        });
    }
    few_pairs_blocks(spec, shape)
        .into_iter()
        .find(|f| f.applies(batch, kv_heads, max_len))
        .map(|f| RuleBlock {
            params: f.params,
            splits: if f.splits_from_default {
                BlockSplits::DefaultOccupancy
            } else {
                BlockSplits::OwnOccupancy
            },
        })
}

/// The kernel families the block rules tell apart, by the codegen default at head_dim 128.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Fp16,
    /// 4-bit K and V on a ring with a general staging path (KIVI-4).
    ShortStaging,
    /// 1- or 2-bit K and V (boosted channels allowed) on the four-warp ring, uncalibrated.
    LowBit,
    /// The same, calibrated (CalibQuant): a range pass before the decode kernel.
    CalibratedLowBit,
    /// 8-bit K and V.
    EightBit,
}

/// Whether the tensor-core kernel's warps hold more than one head tile (FP16 past 8 query heads a
/// KV head; two at head_dim 128, where FP16's rules apply).
fn two_head_tiles(spec: &SchemeSpec, shape: &KernelShape) -> bool {
    kvq_codegen::decode_groups(spec, shape).tiles() > 1
}

fn family(spec: &SchemeSpec, shape: &KernelShape) -> Option<Family> {
    if shape.head_dim != 128 {
        return None;
    }
    let base = TuneParams::default_for(spec, shape);
    if !spec.k.is_quantized() && !spec.v.is_quantized() {
        return Some(Family::Fp16);
    }
    let (threads, tile_tokens) = SHORT_STAGING_FEW_PAIRS_BLOCK;
    let short = TuneParams {
        threads,
        tile_tokens,
        short_staging: true,
        ..base
    };
    if short_staging_changes(spec, shape, &short) {
        return Some(Family::ShortStaging);
    }
    let (k, v) = (spec.k.as_int()?, spec.v.as_int()?);
    let ring = base.threads == 128 && base.tile_tokens == 64 && base.min_warps_per_sm == 12;
    if k.bits <= 2 && v.bits <= 2 && ring {
        return Some(if store_scores_changes(spec, shape, &base) {
            Family::CalibratedLowBit
        } else {
            Family::LowBit
        });
    }
    (k.bits == 8 && v.bits == 8).then_some(Family::EightBit)
}

/// The blocks the untuned default takes for launches with few (sequence, KV head) pairs
/// ([`FewPairsBlock::applies`]), in the order [`rule_block`] tries them, all at head_dim 128:
/// FP16 takes [`FP16_FEW_PAIRS_BLOCK`] up to [`FP16_FEW_PAIRS_MAX`] pairs at any bucket and at
/// [`FP16_MIDDLE_PAIRS`] over [`FP16_MIDDLE_PAIRS_BUCKETS`]; kernels whose ring stages 4-bit K
/// and V (KIVI-4's) take [`SHORT_STAGING_FEW_PAIRS_BLOCK`] on the short staging path, at few
/// pairs from 4K and at [`SHORT_STAGING_MIDDLE_PAIRS`] over [`SHORT_STAGING_MIDDLE_BUCKETS`]; the
/// uncalibrated 1- and 2-bit kernels take [`LOW_BIT_FEW_PAIRS_BLOCK`]. All were measured at GQA
/// 4 in f16. Empty for every other scheme and shape.
pub fn few_pairs_blocks(spec: &SchemeSpec, shape: &KernelShape) -> Vec<FewPairsBlock> {
    let base = TuneParams::default_for(spec, shape);
    let fp16_block = if two_head_tiles(spec, shape) {
        FP16_TWO_TILE_FEW_PAIRS_BLOCK
    } else {
        FP16_FEW_PAIRS_BLOCK
    };
    let few = |(threads, tile_tokens), pairs, buckets, splits_from_default| FewPairsBlock {
        params: TuneParams {
            threads,
            tile_tokens,
            ..base
        },
        pairs,
        buckets,
        splits_from_default,
    };
    match family(spec, shape) {
        Some(Family::Fp16) => vec![
            few(fp16_block, 1..=FP16_FEW_PAIRS_MAX, 0..=usize::MAX, false),
            few(
                fp16_block,
                FP16_MIDDLE_PAIRS,
                FP16_MIDDLE_PAIRS_BUCKETS,
                false,
            ),
        ],
        Some(Family::ShortStaging) => [
            (
                1..=SHORT_STAGING_FEW_PAIRS_MAX,
                SHORT_STAGING_FEW_PAIRS_MIN_BUCKET..=usize::MAX,
            ),
            (SHORT_STAGING_MIDDLE_PAIRS, SHORT_STAGING_MIDDLE_BUCKETS),
        ]
        .into_iter()
        .map(|(pairs, buckets)| {
            let mut b = few(SHORT_STAGING_FEW_PAIRS_BLOCK, pairs, buckets, true);
            b.params.short_staging = true;
            b
        })
        .collect(),
        Some(Family::LowBit) => {
            let mut b = few(
                LOW_BIT_FEW_PAIRS_BLOCK,
                LOW_BIT_FEW_PAIRS,
                LOW_BIT_FEW_PAIRS_BUCKETS,
                false,
            );
            b.params.pack_heads = false;
            vec![b]
        }
        _ => Vec::new(),
    }
}

/// The scheme's [`OneTileBlock`]s, in the order [`rule_block`] tries them, at head_dim 128 and
/// measured at GQA 4 in f16: FP16's [`FP16_ONE_TILE_BLOCKS`] up to [`FP16_ONE_TILE_MAX_PAIRS`]
/// pairs; the uncalibrated 1- and 2-bit kernels with boosted key channels
/// [`BOOSTED_ONE_TILE_BLOCK`] up to [`BOOSTED_ONE_TILE_MAX_PAIRS`]. Empty for every other scheme
/// and shape.
pub fn one_tile_blocks(spec: &SchemeSpec, shape: &KernelShape) -> Vec<OneTileBlock> {
    let (blocks, max_pairs): (&[(u32, u32)], usize) = match family(spec, shape) {
        Some(Family::Fp16) => (&FP16_ONE_TILE_BLOCKS, FP16_ONE_TILE_MAX_PAIRS),
        Some(Family::LowBit) if spec.k.as_int().is_some_and(|k| k.boost.is_some()) => (
            std::slice::from_ref(&BOOSTED_ONE_TILE_BLOCK),
            BOOSTED_ONE_TILE_MAX_PAIRS,
        ),
        _ => return Vec::new(),
    };
    let base = TuneParams::default_for(spec, shape);
    blocks
        .iter()
        .map(|&(threads, tile_tokens)| OneTileBlock {
            params: TuneParams {
                threads,
                tile_tokens,
                ..base
            },
            pairs: 1..=max_pairs,
        })
        .collect()
}

/// The scheme's [`WholePairsBlock`]s, in the order [`rule_block`] tries them, all at head_dim
/// 128 and measured at GQA 4 in f16 on an H100 (docs/BENCHMARKS.md, thirty-third round; ratios
/// against the heuristic's block and splits before the rule, in the same run):
/// - the uncalibrated 1- and 2-bit kernels (kivi2, Kitty, Kitty-Pro): one wave, eight-warp CTAs
///   of 32-token tiles up to 4K (×1.10–×1.38; ×0.94–×0.98 at 8K); two or three waves, four-warp
///   CTAs (twelve warps an SM) of 32-token tiles up to 2K and of 64 from 4K to 8K (×1.06–×1.49;
///   eight-warp CTAs at two waves ran ×0.90–×1.19, at three ×0.79–×1.17); four waves, two-warp
///   CTAs (twelve warps an SM) of 64-token tiles up to 8K (×1.04–×1.42);
/// - the calibrated ones (CalibQuant): one wave, eight-warp CTAs of 32-token tiles, keys scored
///   twice up to 1K (×1.21–×1.30) and their scores stored from 2K to 8K (×1.02–×1.19, where keys
///   scored twice ran ×0.90–×0.95 at 4K); two waves, four-warp CTAs of 64-token tiles without the
///   occupancy floor, keys scored twice up to 2K (×1.22–×1.36) and scores stored from 4K to 8K
///   (×1.09–×1.15; keys scored twice there ran ×0.95–×1.12 against the heuristic of the first
///   rules, whose two-wave block had the floor and stopped at 2K); four waves, two-warp CTAs of
///   64-token tiles (twelve warps an SM) with stored scores up to 4K (×1.01–×1.16; ×0.92 at 8K); at three waves every block tried lost (×0.45–×0.87), where the
///   heuristic already takes one split;
/// - 8-bit K and V: one wave, eight-warp CTAs of 16-token tiles up to 8K (INT8 ×1.02–×1.14;
///   ×0.87–×0.97 at two and four waves, where its heuristic already takes one split);
/// - FP16 (thirty-fourth round): one wave, eight-warp CTAs of 32-token tiles up to 4K
///   (×1.05–×1.17; ×1.00 at 8K); two or three waves, four-warp CTAs (twelve warps an SM) of
///   64-token tiles up to 4K (×1.00–×1.19; ×0.995–×1.009 at 8K, and eight-warp CTAs at three
///   waves ×0.98–×0.99); four waves, the codegen's two-warp CTAs up to 2K (×1.05–×1.21; ×1.00 at
///   4K, ×0.99 at 8K).
///
/// - 4-bit K and V on the short staging path (KIVI-4's; thirty-fifth round): one wave, eight-warp
///   CTAs of 16-token tiles up to 1K, short staging (the tuner's choice at B=16 L=1K at GQA 1 and
///   8 in f16 and GQA 4 in bf16, ×1.10–×1.21 over the default; eight-warp CTAs of longer tiles
///   had run ×0.64–×1.05 at one wave and ×0.55–×0.75 at two, thirty-third round).
///
/// Empty for every other scheme and shape.
pub fn whole_pairs_blocks(spec: &SchemeSpec, shape: &KernelShape) -> Vec<WholePairsBlock> {
    let base = TuneParams::default_for(spec, shape);
    let block = |threads, tile_tokens, min_warps_per_sm, waves, buckets| WholePairsBlock {
        params: TuneParams {
            threads,
            tile_tokens,
            min_warps_per_sm,
            ..base
        },
        waves,
        buckets,
    };
    let stored = |mut b: WholePairsBlock, store_scores| {
        b.params.store_scores = store_scores;
        b
    };
    match family(spec, shape) {
        Some(Family::LowBit) => vec![
            block(256, 32, 0, 1..=1, 0..=4096),
            block(128, 32, 12, 2..=3, 0..=2048),
            block(128, 64, 12, 2..=3, 4096..=8192),
            block(64, 64, 12, 4..=4, 0..=8192),
        ],
        Some(Family::CalibratedLowBit) => vec![
            stored(block(256, 32, 0, 1..=1, 0..=1024), false),
            stored(block(256, 32, 0, 1..=1, 2048..=8192), true),
            stored(block(128, 64, 0, 2..=2, 0..=2048), false),
            stored(block(128, 64, 0, 2..=2, 4096..=8192), true),
            stored(block(64, 64, 12, 4..=4, 0..=4096), true),
        ],
        Some(Family::EightBit) => vec![block(256, 16, 0, 1..=1, 0..=8192)],
        Some(Family::ShortStaging) => {
            let mut b = block(256, 16, 0, 1..=1, 0..=1024);
            b.params.short_staging = true;
            vec![b]
        }
        // Twelve warps an SM where the default takes them: not in FP16's two-tile kernels (past
        // 8 query heads a KV head), whose registers the floor would spill.
        Some(Family::Fp16) => vec![
            block(256, 32, 0, 1..=1, 0..=4096),
            block(128, 64, base.min_warps_per_sm, 2..=3, 0..=4096),
            block(64, 64, base.min_warps_per_sm, 4..=4, 0..=2048),
        ],
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tune::{TuneChoice, TuneProblem};
    use kvq_codegen::Dtype;

    fn spec(text: &str) -> SchemeSpec {
        SchemeSpec::parse(text).unwrap()
    }

    const FP16: &str = "k = fp16, v = fp16";
    const KIVI2: &str = "k = int(2, channel), v = int(2, token)";
    const INT8: &str = "k = int(8, channel), v = int(8, token)";
    const CALIBQUANT1: &str = "k = int(1, channel), v = int(1, channel), sink = 32, local = 128, calibrate = calibrate(tau1 = -1.5, tau2 = 3.25)";
    const KITTY: &str = "k = int(bits = 2, axis = channel, boost = boost(bits = 4, ratio = 0.125, by = magnitude)), \
                         v = int(bits = 2, axis = token, local = 128), page = 128, sink = 32";

    /// An H100's SMs.
    const H100_SMS: usize = 132;

    /// The heuristic's block and the block whose occupancy its splits fill, for `batch`
    /// sequences of `kv_heads` KV heads and at most `len` tokens on an H100.
    fn blocks(
        spec: &SchemeSpec,
        shape: &KernelShape,
        batch: usize,
        kv_heads: usize,
        len: usize,
    ) -> (TuneParams, TuneParams) {
        let p = TuneProblem::new(*spec, *shape, kv_heads, batch, len);
        (
            TuneChoice::default_block(&p, H100_SMS),
            TuneChoice::occupancy_block(&p, H100_SMS),
        )
    }

    #[test]
    fn fp16_with_few_pairs_over_long_contexts_takes_four_warp_tiles_of_32() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let fp16 = spec(FP16);
        let base = TuneParams::default_for(&fp16, &shape);
        assert_eq!((base.threads, base.tile_tokens), (64, 64));
        for (batch, len) in [(1, 8192), (1, 5000), (1, 32768), (2, 131072)] {
            let b = blocks(&fp16, &shape, batch, 8, len).0;
            assert_eq!(
                (b.threads, b.tile_tokens),
                FP16_FEW_PAIRS_BLOCK,
                "B={batch} L={len}"
            );
            // Everything else is the default block's (the twelve-warp floor included).
            assert_eq!(
                TuneParams {
                    threads: base.threads,
                    tile_tokens: base.tile_tokens,
                    ..b
                },
                base
            );
        }
    }

    #[test]
    fn other_launches_keep_the_codegen_default() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let fp16 = spec(FP16);
        let base = TuneParams::default_for(&fp16, &shape);
        // Middle pairs (B=4 at 8 KV heads, B=1 at 32) past 16K, or B=16 past one wave's buckets.
        assert_eq!(blocks(&fp16, &shape, 4, 8, 32768).0, base);
        assert_eq!(blocks(&fp16, &shape, 1, 32, 32768).0, base);
        assert_eq!(blocks(&fp16, &shape, 16, 8, 16384).0, base);
        // Another head size, or a quantized scheme.
        let d64 = KernelShape::new(64, 4, Dtype::F16);
        assert_eq!(
            blocks(&fp16, &d64, 1, 8, 32768).0,
            TuneParams::default_for(&fp16, &d64)
        );
        let kivi2 = spec(KIVI2);
        assert_eq!(
            blocks(&kivi2, &shape, 1, 8, 32768).0,
            TuneParams::default_for(&kivi2, &shape)
        );
        // Schemes without a few-pairs or one-tile block.
        for text in [INT8, CALIBQUANT1] {
            assert!(few_pairs_blocks(&spec(text), &shape).is_empty(), "{text}");
        }
        for text in [INT8, CALIBQUANT1, KIVI2] {
            assert!(one_tile_blocks(&spec(text), &shape).is_empty(), "{text}");
        }
        assert!(one_tile_blocks(&fp16, &d64).is_empty());
        // FP16's split count fills its own block's waves.
        for batch in [1, 4] {
            let (block, occupancy) = blocks(&fp16, &shape, batch, 8, 32768);
            assert_eq!(occupancy, block);
        }
    }

    /// FP16's block (threads, tile) and split count for `batch` sequences of 8 KV heads and
    /// `len` tokens on `sms` SMs, and how the rule counts its splits.
    fn fp16_launch(batch: usize, len: usize, sms: usize) -> (u32, u32, usize, Option<BlockSplits>) {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let fp16 = spec(FP16);
        let rule = rule_block(&fp16, &shape, batch, 8, len, sms);
        let p = TuneProblem::new(fp16, shape, 8, batch, len);
        // Resident CTAs as the runtime would load them: three four-warp CTAs an SM.
        let h = TuneChoice::heuristic(&p, crate::tune::Residency::new(sms, 3 * sms));
        (
            h.params.threads,
            h.params.tile_tokens,
            h.splits,
            rule.map(|r| r.splits),
        )
    }

    #[test]
    fn fp16_with_few_pairs_over_short_contexts_gives_each_warp_one_tile_in_one_wave() {
        // 16-token tiles where their grid fits three four-warp CTAs an SM (396 on an H100), else
        // 32-token tiles where theirs fits.
        for (batch, len, tile, splits) in [
            (1, 512, 16, 8),
            (1, 1024, 16, 16),
            (1, 2048, 16, 32),
            (2, 1024, 16, 16),
            (4, 512, 16, 8),
            (1, 4096, 32, 32),
            (2, 2048, 32, 16),
            (4, 1024, 32, 8),
            (8, 512, 32, 4),
            (1, 3000, 32, 32),
        ] {
            assert_eq!(
                fp16_launch(batch, len, H100_SMS),
                (128, tile, splits, Some(BlockSplits::OneTilePerWarp(splits))),
                "B={batch} L={len}"
            );
        }
        // Neither fits: the few-pairs block, its splits from its own occupancy.
        for (batch, len) in [(1, 8192), (2, 4096), (4, 2048), (8, 1024), (8, 16384)] {
            let (threads, tile, _, rule) = fp16_launch(batch, len, H100_SMS);
            assert_eq!(
                (threads, tile, rule),
                (128, 32, Some(BlockSplits::OwnOccupancy)),
                "B={batch} L={len}"
            );
        }
        // The wave follows the GPU's SMs: on 66, B=1 L=2K takes 32-token tiles (128 CTAs, not 256).
        assert_eq!(
            fp16_launch(1, 2048, 66),
            (128, 32, 16, Some(BlockSplits::OneTilePerWarp(16)))
        );
        // The shortest bucket (256 tokens) gives 16-token tiles four splits; one pair may take
        // up to the wave's 396 CTAs, not 512.
        let one = &one_tile_blocks(&spec(FP16), &KernelShape::new(128, 4, Dtype::F16))[0];
        assert_eq!(one.splits(32), 4);
        assert!(one.applies(1, 1, 16384, H100_SMS));
        assert!(!one.applies(1, 1, 32768, H100_SMS));
        assert_eq!(one.floor_ctas_per_sm(), 3);
    }

    #[test]
    fn boosted_kernels_with_few_pairs_over_short_contexts_give_each_warp_one_tile_of_16() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let kitty = spec(KITTY);
        let base = TuneParams::default_for(&kitty, &shape);
        let one = TuneParams {
            tile_tokens: 16,
            ..base
        };
        assert_eq!(
            one_tile_blocks(&kitty, &shape)
                .iter()
                .map(|o| o.params)
                .collect::<Vec<_>>(),
            vec![one]
        );
        // Up to B=4 at 8 KV heads, where 16 tokens a warp fits three CTAs an SM.
        for (batch, len, splits) in [(1, 512, 8), (1, 2048, 32), (2, 1024, 16), (4, 512, 8)] {
            let rule = rule_block(&kitty, &shape, batch, 8, len, H100_SMS).unwrap();
            assert_eq!(
                (rule.params, rule.splits),
                (one, BlockSplits::OneTilePerWarp(splits)),
                "B={batch} L={len}"
            );
        }
        // Grids past the wave, or more pairs: the other rules or the default (no 32-token tiles).
        for (batch, len) in [(1, 4096), (2, 2048), (4, 1024), (8, 512)] {
            assert_ne!(
                blocks(&kitty, &shape, batch, 8, len).0,
                one,
                "B={batch} L={len}"
            );
        }
    }

    #[test]
    fn kivi4_with_few_pairs_takes_short_staged_tiles_of_32_with_the_default_blocks_occupancy() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let kivi4 = spec("k = int(4, channel), v = int(4, token)");
        let base = TuneParams::default_for(&kivi4, &shape);
        assert_eq!((base.threads, base.tile_tokens), (128, 64));
        assert!(!base.short_staging);
        let few = few_pairs_blocks(&kivi4, &shape);
        assert_eq!(few.len(), 2);
        let short = TuneParams {
            tile_tokens: 32,
            short_staging: true,
            ..base
        };
        assert!(few
            .iter()
            .all(|f| f.splits_from_default && f.params == short));
        // Up to B=8 at 8 KV heads from 4K; from B=8 to B=32 over 1K to 8K.
        for (batch, len) in [
            (1, 4096),
            (1, 131072),
            (8, 4096),
            (8, 32768),
            (8, 1024),
            (16, 4096),
            (32, 8192),
            (24, 1000),
        ] {
            assert_eq!(
                blocks(&kivi4, &shape, batch, 8, len),
                (short, base),
                "B={batch} L={len}"
            );
        }
        // Past 32 sequences, B=16 past 8K, or few pairs under 4K (B ≤ 4): the codegen default.
        for (batch, len) in [(64, 4096), (16, 16384), (16, 32768), (4, 2048), (1, 1024)] {
            assert_eq!(
                blocks(&kivi4, &shape, batch, 8, len),
                (base, base),
                "B={batch} L={len}"
            );
        }
        // Other head sizes keep the codegen default.
        let d64 = KernelShape::new(64, 4, Dtype::F16);
        assert!(few_pairs_blocks(&kivi4, &d64).is_empty());
    }

    #[test]
    fn low_bit_kernels_at_middle_batches_over_short_contexts_take_unpacked_tiles_of_32() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        for text in [KIVI2, KITTY] {
            let low_bit = spec(text);
            let base = TuneParams::default_for(&low_bit, &shape);
            assert_eq!((base.threads, base.tile_tokens), (128, 64));
            let few = TuneParams {
                tile_tokens: 32,
                pack_heads: false,
                ..base
            };
            assert_eq!(few_pairs_blocks(&low_bit, &shape)[0].params, few);
            // B=4 and B=8 at 8 KV heads (B=2 at 16), buckets of 2K to 8K: the block, with the
            // splits of its own occupancy.
            for (batch, kv_heads, len) in [(4, 8, 2048), (8, 8, 8192), (8, 8, 5000), (2, 16, 4096)]
            {
                assert_eq!(
                    blocks(&low_bit, &shape, batch, kv_heads, len),
                    (few, few),
                    "{text} B={batch} L={len}"
                );
            }
            // Too few or too many pairs, or a bucket outside 2K–8K.
            for (batch, len) in [(2, 4096), (12, 4096), (4, 1024), (8, 16384)] {
                assert_eq!(
                    blocks(&low_bit, &shape, batch, 8, len),
                    (base, base),
                    "{text} B={batch} L={len}"
                );
            }
        }
    }

    /// The block `text`'s launch of `batch` sequences of 8 KV heads and `len` tokens on `sms`
    /// SMs takes as a whole-pairs block: (threads, tile, twelve-warp floor, stored scores), or
    /// `None` where it takes none.
    fn whole(text: &str, batch: usize, len: usize, sms: usize) -> Option<(u32, u32, u32, bool)> {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let s = spec(text);
        let taken = rule_block(&s, &shape, batch, 8, len, sms)
            .filter(|t| t.splits == BlockSplits::OnePerPair)?;
        let first = whole_pairs_blocks(&s, &shape)
            .into_iter()
            .find(|w| w.applies(batch, 8, len, sms))
            .expect("a whole-pairs block that applies");
        assert_eq!(first.params, taken.params);
        let p = taken.params;
        Some((p.threads, p.tile_tokens, p.min_warps_per_sm, p.store_scores))
    }

    #[test]
    fn pairs_that_fill_whole_waves_of_sms_over_short_contexts_take_one_split_each() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        // The 1- and 2-bit kernels on an H100: B=16, 32, 48 and 64 fill one to four waves of
        // 132 SMs; B=24 fills 73% of its second wave.
        for (batch, len, block) in [
            (16, 1024, Some((256, 32, 0, false))),
            (16, 4096, Some((256, 32, 0, false))),
            (16, 8192, None),
            (32, 2048, Some((128, 32, 12, false))),
            (48, 4096, Some((128, 64, 12, false))),
            (32, 8192, Some((128, 64, 12, false))),
            (32, 16384, None),
            (64, 8192, Some((64, 64, 12, false))),
            (64, 16384, None),
            (24, 1024, None),
            (8, 1024, None),
            (80, 1024, None),
            (128, 1024, None),
        ] {
            for text in [KIVI2, KITTY] {
                assert_eq!(
                    whole(text, batch, len, H100_SMS),
                    block,
                    "{text} B={batch} L={len}"
                );
            }
        }
        // CalibQuant keys twice up to 1K at one wave, stored scores to 8K; four-warp CTAs without
        // the floor at two waves, keys twice up to 2K and stored scores to 8K; two-warp CTAs with
        // stored scores at four waves up to 4K. INT8 one wave up to 8K.
        for (batch, len, calibquant, int8) in [
            (
                16,
                1024,
                Some((256, 32, 0, false)),
                Some((256, 16, 0, false)),
            ),
            (
                16,
                4096,
                Some((256, 32, 0, true)),
                Some((256, 16, 0, false)),
            ),
            (
                16,
                8192,
                Some((256, 32, 0, true)),
                Some((256, 16, 0, false)),
            ),
            (16, 16384, None, None),
            (32, 2048, Some((128, 64, 0, false)), None),
            (32, 4096, Some((128, 64, 0, true)), None),
            (32, 16384, None, None),
            (48, 1024, None, None),
            (64, 4096, Some((64, 64, 12, true)), None),
            (64, 8192, None, None),
        ] {
            assert_eq!(
                whole(CALIBQUANT1, batch, len, H100_SMS),
                calibquant,
                "B={batch} L={len}"
            );
            assert_eq!(whole(INT8, batch, len, H100_SMS), int8, "B={batch} L={len}");
        }
        // The waves are counted on the GPU's own SMs: 128 pairs on 114 SMs fill 56% of two waves,
        // 112 pairs 98% of one.
        assert_eq!(whole_pair_waves(128, 114), None);
        assert_eq!(whole_pair_waves(112, 114), Some(1));
        assert_eq!(whole(KIVI2, 16, 1024, 114), None);
        assert!(whole(KIVI2, 14, 1024, 114).is_some());
        // FP16: eight-warp CTAs at one wave up to 4K, four-warp ones at two and three up to 4K,
        // the codegen's two-warp ones at four up to 2K.
        for (batch, len, block) in [
            (16, 512, Some((256, 32, 0, false))),
            (16, 4096, Some((256, 32, 0, false))),
            (16, 8192, None),
            (32, 4096, Some((128, 64, 12, false))),
            (48, 1024, Some((128, 64, 12, false))),
            (32, 8192, None),
            (64, 2048, Some((64, 64, 12, false))),
            (64, 4096, None),
            (24, 1024, None),
        ] {
            assert_eq!(
                whole(FP16, batch, len, H100_SMS),
                block,
                "B={batch} L={len}"
            );
        }
        // KIVI-4: eight-warp CTAs of 16-token tiles on the short staging path, one wave, up to 1K.
        let kivi4 = spec("k = int(4, channel), v = int(4, token)");
        for (batch, len, taken) in [
            (16, 256, true),
            (16, 1024, true),
            (16, 1025, false),
            (16, 2048, false),
            (32, 1024, false),
            (8, 1024, false),
        ] {
            let rule = rule_block(&kivi4, &shape, batch, 8, len, H100_SMS)
                .filter(|r| r.splits == BlockSplits::OnePerPair);
            assert_eq!(rule.is_some(), taken, "KIVI-4 B={batch} L={len}");
            if let Some(r) = rule {
                let p = r.params;
                assert_eq!((p.threads, p.tile_tokens, p.min_warps_per_sm), (256, 16, 0));
                assert!(p.short_staging);
            }
        }
        // None for other head sizes.
        let d64 = KernelShape::new(64, 4, Dtype::F16);
        assert!(whole_pairs_blocks(&spec(KIVI2), &d64).is_empty());
        // The block is the kernel the launch runs, so it is the occupancy block too; everything
        // else is the codegen default's.
        let base = TuneParams::default_for(&spec(KIVI2), &shape);
        let (block, occupancy) = blocks(&spec(KIVI2), &shape, 16, 8, 4096);
        let eight_warps = TuneParams {
            threads: 256,
            tile_tokens: 32,
            min_warps_per_sm: 0,
            ..base
        };
        assert_eq!((block, occupancy), (eight_warps, eight_warps));
    }
}
