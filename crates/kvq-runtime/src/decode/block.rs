//! Which kernel block (threads, tile and the other compile-time parameters) the untuned default
//! launches a problem with. The codegen's [`TuneParams::default_for`] knows only the scheme and
//! the kernel shape; the batch shape and context bucket can call for another block.

use kvq_codegen::{KernelShape, TuneParams};
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
/// B=1 on an H100), so the combine reads half the partials, and a CTA's warps merge on chip.
/// Measured on an H100 (docs/BENCHMARKS.md, thirty-second round), against the two-warp block in
/// the same run: B=1 ×1.02–×1.09 from 8K to 64K and ×1.00 at 128K; B=2 ×1.03–×1.07 from 8K to
/// 64K, ×1.01 at 128K. Where buffers land still matters: at B=1 L=32K this block ran 57.4–58.0
/// µs at both placement pads, where the two-warp block ran 59.4 at one and 66.6–66.9 at the
/// other, but 65.9 µs in a checked run of every scheme.
pub const FP16_FEW_PAIRS_BLOCK: (u32, u32) = (128, 32);

/// The block the untuned default launches `batch` sequences of `kv_heads` KV heads and at most
/// `max_len` tokens with: [`TuneParams::default_for`], except where [`few_pairs_block`] has a
/// block for the scheme and shape, which launches with at most [`FP16_FEW_PAIRS_MAX`] (sequence,
/// KV head) pairs and a context bucket of at least [`FP16_FEW_PAIRS_MIN_BUCKET`] tokens take.
/// Like the split count it depends only on the batch shape and the bucket, so a captured graph
/// stays valid while sequences grow within their bucket.
pub fn default_block(
    spec: &SchemeSpec,
    shape: &KernelShape,
    batch: usize,
    kv_heads: usize,
    max_len: usize,
) -> TuneParams {
    let few_pairs = batch * kv_heads <= FP16_FEW_PAIRS_MAX;
    let long = context_bucket(max_len) >= FP16_FEW_PAIRS_MIN_BUCKET;
    match few_pairs_block(spec, shape) {
        Some(block) if few_pairs && long => block,
        _ => TuneParams::default_for(spec, shape),
    }
}

/// The block of [`default_block`] for launches with few (sequence, KV head) pairs over long
/// contexts, where it differs from the codegen default: FP16 at head_dim 128 takes
/// [`FP16_FEW_PAIRS_BLOCK`] (measured at GQA 4 in f16); `None` for every other scheme and shape.
pub fn few_pairs_block(spec: &SchemeSpec, shape: &KernelShape) -> Option<TuneParams> {
    let fp16 = !spec.k.is_quantized() && !spec.v.is_quantized();
    (fp16 && shape.head_dim == 128).then(|| {
        let (threads, tile_tokens) = FP16_FEW_PAIRS_BLOCK;
        TuneParams {
            threads,
            tile_tokens,
            ..TuneParams::default_for(spec, shape)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq_codegen::Dtype;

    fn spec(text: &str) -> SchemeSpec {
        SchemeSpec::parse(text).unwrap()
    }

    const FP16: &str = "k = fp16, v = fp16";

    #[test]
    fn fp16_with_few_pairs_over_long_contexts_takes_four_warp_tiles_of_32() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let fp16 = spec(FP16);
        let base = TuneParams::default_for(&fp16, &shape);
        assert_eq!((base.threads, base.tile_tokens), (64, 64));
        for (batch, len) in [(1, 8192), (1, 5000), (1, 32768), (2, 131072)] {
            let b = default_block(&fp16, &shape, batch, 8, len);
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
        assert_eq!(default_block(&fp16, &shape, 4, 8, 32768), base);
        assert_eq!(default_block(&fp16, &shape, 1, 32, 32768), base);
        assert_eq!(default_block(&fp16, &shape, 1, 8, 4096), base);
        // Another head size, or a quantized scheme.
        let d64 = KernelShape::new(64, 4, Dtype::F16);
        assert_eq!(
            default_block(&fp16, &d64, 1, 8, 32768),
            TuneParams::default_for(&fp16, &d64)
        );
        let kivi2 = spec("k = int(2, channel), v = int(2, token)");
        assert_eq!(
            default_block(&kivi2, &shape, 1, 8, 32768),
            TuneParams::default_for(&kivi2, &shape)
        );
    }
}
