//! How many split-K partitions a decode launch uses.

/// Splits per (sequence, KV head) so the grid has about four CTAs per SM (the autotuner's winners
/// on an H200 used 2–4× the earlier two per SM), never more splits than 256-token chunks of the
/// longest context. It depends only on the batch shape and a context bucket
/// (the longest sequence rounded up to a power of two), so a captured CUDA graph stays valid
/// while sequences grow within their bucket.
pub fn default_splits(batch: usize, kv_heads: usize, max_len: usize, sm_count: usize) -> usize {
    let bucket = max_len.max(1).next_power_of_two();
    let ctas = (batch * kv_heads).max(1);
    let want = (4 * sm_count).div_ceil(ctas);
    want.clamp(1, (bucket / 256).max(1)).min(256)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_the_gpu_for_small_batches_and_not_beyond() {
        assert_eq!(default_splits(1, 8, 32768, 132), 66);
        assert_eq!(default_splits(16, 8, 32768, 132), 5);
        assert_eq!(default_splits(64, 8, 32768, 132), 2);
        assert_eq!(default_splits(256, 8, 32768, 132), 1);
        assert_eq!(default_splits(1, 8, 100, 132), 1);
        // Same bucket, same splits.
        assert_eq!(
            default_splits(2, 8, 5000, 132),
            default_splits(2, 8, 8000, 132)
        );
    }
}
