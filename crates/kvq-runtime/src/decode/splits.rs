//! How many split-K partitions a decode launch uses.

use std::cmp::Reverse;

/// Splits per (sequence, KV head) for a grid that fills whole waves of the GPU.
///
/// `resident_ctas` is how many decode CTAs the GPU holds at once (SMs × CTAs per SM, from
/// [`DecodeKernel::resident_ctas`](super::DecodeKernel::resident_ctas)). CTAs of one launch take
/// about equal time, so a grid of 1.6 waves (ncu: the earlier four-per-SM rule at B=16 on an H100)
/// runs about as long as two; the split count is therefore the one, between the fewest that fill
/// 90% of a wave and twice that, whose last wave is the fullest (ties: fewer splits, so less
/// merging). Never fewer than 64 tokens per warp of a split (`warps_per_cta` warps share one) in
/// the context bucket (the longest sequence rounded up to a power of two), nor more than 256
/// splits. It depends only on the batch shape, that bucket and the block, so a captured CUDA graph
/// stays valid while sequences grow within their bucket.
pub fn default_splits(
    batch: usize,
    kv_heads: usize,
    max_len: usize,
    resident_ctas: usize,
    warps_per_cta: usize,
) -> usize {
    let bucket = max_len.max(1).next_power_of_two();
    let most = (bucket / (64 * warps_per_cta.max(1))).clamp(1, 256);
    let ctas = (batch * kv_heads).max(1);
    let slots = resident_ctas.max(1);
    let fewest = (9 * slots).div_ceil(10 * ctas).clamp(1, most);
    (fewest..=(2 * fewest).min(most))
        .max_by_key(|&s| {
            let grid = ctas * s;
            let waves = grid.div_ceil(slots);
            (1000 * grid / (waves * slots), Reverse(s))
        })
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_whole_waves() {
        // H100, 3 CTAs per SM: 396 slots.
        assert_eq!(default_splits(1, 8, 32768, 396, 4), 49); // 392 CTAs, one wave
        assert_eq!(default_splits(16, 8, 32768, 396, 4), 3); // 384 CTAs, not 640 (1.6 waves)
        assert_eq!(default_splits(64, 8, 32768, 396, 4), 2); // 1024 CTAs in 3 waves (86%)
        assert_eq!(default_splits(256, 8, 32768, 396, 4), 2); // 94% of 11 waves, not 86% of 6
        assert_eq!(default_splits(99, 4, 32768, 396, 4), 1); // exactly one wave

        // 2 CTAs per SM: 264 slots.
        assert_eq!(default_splits(1, 8, 32768, 264, 4), 33);
    }

    #[test]
    fn never_more_splits_than_chunks_and_stable_within_a_bucket() {
        assert_eq!(default_splits(1, 8, 100, 396, 4), 1);
        assert_eq!(default_splits(1, 8, 4096, 396, 4), 16);
        assert_eq!(
            default_splits(2, 8, 5000, 396, 4),
            default_splits(2, 8, 8000, 396, 4)
        );
        assert_eq!(default_splits(0, 0, 0, 0, 0), 1);
    }

    #[test]
    fn smaller_ctas_may_take_shorter_splits() {
        // Two-warp CTAs, six per SM: 792 slots; 64 tokens per warp allow 32 splits of 4K.
        assert_eq!(default_splits(1, 8, 4096, 792, 2), 32);
        assert_eq!(default_splits(1, 8, 32768, 792, 2), 99);
    }
}
