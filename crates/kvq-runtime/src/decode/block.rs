//! Blocks (threads, tile and the other compile-time parameters) the untuned default takes instead
//! of the codegen's where a launch has few (sequence, KV head) pairs. [`TuneParams::default_for`]
//! knows only the scheme and the kernel shape; the batch shape and context bucket can call for
//! another block. `TuneChoice::default_block` and `TuneChoice::occupancy_block` apply the rules.

use kvq_codegen::{short_staging_changes, KernelShape, TuneParams};
use kvq_spec::SchemeSpec;

use crate::tune::context_bucket;

/// Most (sequence, KV head) pairs a launch may have for FP16 to take
/// [`FP16_FEW_PAIRS_BLOCK`]: B ≤ 2 at 8 KV heads. At B=4 (32 pairs) the block ran ×1.00–×1.03 on
/// an H100 (docs/BENCHMARKS.md, thirty-second round).
pub const FP16_FEW_PAIRS_MAX: usize = 16;

/// Shortest context bucket at which FP16 with few (sequence, KV head) pairs takes
/// [`FP16_FEW_PAIRS_BLOCK`]. At 4K the block lost ×0.94 at B=1 (thirty-first round): there the
/// tokens a warp must get, not the GPU, bound the split count, and four-warp CTAs halve it.
pub const FP16_FEW_PAIRS_MIN_BUCKET: usize = 8 * 1024;

/// Threads and tile of FP16's block at head_dim 128 where a launch has few (sequence, KV head)
/// pairs over long contexts: four-warp CTAs of 32-token tiles instead of two-warp CTAs of 64.
/// With so few pairs the grid is all splits; four warps a CTA halve them (49 instead of 99 at
/// B=1 on an H100), so the combine reads half the partials, and a CTA's warps merge on chip (why
/// the block runs faster was not profiled). Measured on an H100 (docs/BENCHMARKS.md, thirty-second round), against the two-warp block in
/// the same run: B=1 ×1.01–×1.09 from 8K to 64K and ×1.00 at 128K; B=2 ×1.03–×1.08 from 8K to
/// 64K, ×1.01 at 128K. Where buffers land still matters: at B=1 L=32K this block ran 57.4–58.0
/// µs at both placement pads, where the two-warp block ran 59.4 at one and 66.6–66.9 at the
/// other, but 65.9 µs in a checked run of every scheme.
pub const FP16_FEW_PAIRS_BLOCK: (u32, u32) = (128, 32);

/// Most (sequence, KV head) pairs a launch may have for a kernel whose ring stages 4-bit K and V
/// (KIVI-4's) to take [`SHORT_STAGING_FEW_PAIRS_BLOCK`]: B ≤ 8 at 8 KV heads, the largest batch
/// measured (docs/BENCHMARKS.md, thirty-second round).
pub const SHORT_STAGING_FEW_PAIRS_MAX: usize = 64;

/// Shortest context bucket at which KIVI-4's kernels with few (sequence, KV head) pairs take
/// [`SHORT_STAGING_FEW_PAIRS_BLOCK`]: the shortest measured.
pub const SHORT_STAGING_FEW_PAIRS_MIN_BUCKET: usize = 4096;

/// Threads and tile of KIVI-4's block at head_dim 128 where a launch has few (sequence, KV head)
/// pairs: 32-token tiles on the short staging path instead of 64-token tiles on the general one.
/// Its smaller ring lets an SM hold three CTAs instead of two, but its split count fills waves of
/// the 64-token block's two ([`FewPairsBlock::splits_from_default`]): on an H100 at B ≤ 8 from
/// 4K to 128K (docs/BENCHMARKS.md, thirty-second round) that ran ×0.997–×1.135 (B=1 L=32K
/// ×1.085, L=128K ×1.052), where splits filling three CTAs an SM ran ×0.98–×1.11 (B=1 L=32K
/// ×1.023) and the general path with tiles of 32 lost up to ×0.947.
pub const SHORT_STAGING_FEW_PAIRS_BLOCK: (u32, u32) = (128, 32);

/// A block the untuned default takes instead of the codegen's where a launch has few (sequence,
/// KV head) pairs: with few pairs the grid is all splits, and another block divides the work
/// better.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FewPairsBlock {
    /// The block (the launch variants, short staging and stored scores, as it says).
    pub params: TuneParams,
    /// Most (sequence, KV head) pairs, batch × KV heads, a launch may have to take it.
    pub max_pairs: usize,
    /// Shortest context bucket at which a launch takes it.
    pub min_bucket: usize,
    /// Whether the split count fills waves of the codegen default block's occupancy rather
    /// than of this block's own.
    pub splits_from_default: bool,
}

impl FewPairsBlock {
    /// Whether a launch of `batch` sequences of `kv_heads` KV heads and at most `max_len`
    /// tokens takes this block.
    pub fn applies(&self, batch: usize, kv_heads: usize, max_len: usize) -> bool {
        batch * kv_heads <= self.max_pairs && context_bucket(max_len) >= self.min_bucket
    }
}

/// The block the untuned default takes for launches with few (sequence, KV head) pairs
/// ([`FewPairsBlock::applies`]), where the scheme and shape have one: FP16 at head_dim 128 takes [`FP16_FEW_PAIRS_BLOCK`]; kernels whose
/// ring stages 4-bit K and V (KIVI-4's) at head_dim 128 take [`SHORT_STAGING_FEW_PAIRS_BLOCK`] on
/// the short staging path. Both were measured at GQA 4 in f16. `None` for every other scheme and
/// shape.
pub fn few_pairs_block(spec: &SchemeSpec, shape: &KernelShape) -> Option<FewPairsBlock> {
    if shape.head_dim != 128 {
        return None;
    }
    let base = TuneParams::default_for(spec, shape);
    let fp16 = !spec.k.is_quantized() && !spec.v.is_quantized();
    if fp16 {
        let (threads, tile_tokens) = FP16_FEW_PAIRS_BLOCK;
        return Some(FewPairsBlock {
            params: TuneParams {
                threads,
                tile_tokens,
                ..base
            },
            max_pairs: FP16_FEW_PAIRS_MAX,
            min_bucket: FP16_FEW_PAIRS_MIN_BUCKET,
            splits_from_default: false,
        });
    }
    let (threads, tile_tokens) = SHORT_STAGING_FEW_PAIRS_BLOCK;
    let short = TuneParams {
        threads,
        tile_tokens,
        short_staging: true,
        ..base
    };
    short_staging_changes(spec, shape, &short).then_some(FewPairsBlock {
        params: short,
        max_pairs: SHORT_STAGING_FEW_PAIRS_MAX,
        min_bucket: SHORT_STAGING_FEW_PAIRS_MIN_BUCKET,
        splits_from_default: true,
    })
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

    /// The heuristic's block and the block whose occupancy its splits fill, for `batch`
    /// sequences of `kv_heads` KV heads and at most `len` tokens.
    fn blocks(
        spec: &SchemeSpec,
        shape: &KernelShape,
        batch: usize,
        kv_heads: usize,
        len: usize,
    ) -> (TuneParams, TuneParams) {
        let p = TuneProblem::new(*spec, *shape, kv_heads, batch, len);
        (
            TuneChoice::default_block(&p),
            TuneChoice::occupancy_block(&p),
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
        // Too many pairs (B=4 at 8 KV heads, B=1 at 32), or a short bucket.
        assert_eq!(blocks(&fp16, &shape, 4, 8, 32768).0, base);
        assert_eq!(blocks(&fp16, &shape, 1, 32, 32768).0, base);
        assert_eq!(blocks(&fp16, &shape, 1, 8, 4096).0, base);
        // Another head size, or a quantized scheme.
        let d64 = KernelShape::new(64, 4, Dtype::F16);
        assert_eq!(
            blocks(&fp16, &d64, 1, 8, 32768).0,
            TuneParams::default_for(&fp16, &d64)
        );
        let kivi2 = spec("k = int(2, channel), v = int(2, token)");
        assert_eq!(few_pairs_block(&kivi2, &shape), None);
        assert_eq!(
            blocks(&kivi2, &shape, 1, 8, 32768).0,
            TuneParams::default_for(&kivi2, &shape)
        );
        // FP16's split count fills its own block's waves.
        for batch in [1, 4] {
            let (block, occupancy) = blocks(&fp16, &shape, batch, 8, 32768);
            assert_eq!(occupancy, block);
        }
    }

    #[test]
    fn kivi4_with_few_pairs_takes_short_staged_tiles_of_32_with_the_default_blocks_occupancy() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let kivi4 = spec("k = int(4, channel), v = int(4, token)");
        let base = TuneParams::default_for(&kivi4, &shape);
        assert_eq!((base.threads, base.tile_tokens), (128, 64));
        assert!(!base.short_staging);
        let few = few_pairs_block(&kivi4, &shape).unwrap();
        assert!(few.splits_from_default);
        let short = TuneParams {
            tile_tokens: 32,
            short_staging: true,
            ..base
        };
        assert_eq!(few.params, short);
        for (batch, len) in [(1, 4096), (1, 131072), (8, 4096), (8, 32768)] {
            assert_eq!(blocks(&kivi4, &shape, batch, 8, len), (short, base));
        }
        // B=16 at 8 KV heads, or a bucket under 4096 tokens: the codegen default.
        for (batch, len) in [(16, 32768), (1, 2048)] {
            assert_eq!(blocks(&kivi4, &shape, batch, 8, len), (base, base));
        }
        // Other head sizes keep the codegen default.
        let d64 = KernelShape::new(64, 4, Dtype::F16);
        assert_eq!(few_pairs_block(&kivi4, &d64), None);
    }
}
