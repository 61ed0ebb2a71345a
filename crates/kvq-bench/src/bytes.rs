//! The bytes a decode step must move: the floor that "effective bandwidth" divides by time.
//!
//! Counted once each: every page block a sequence uses (codes, scales/zeros, boost planes and
//! maps, or FP16 pages), the FP16 sink and tail tokens actually present (not the buffers'
//! capacity), the page-table entries and sequence length, the queries read and the outputs
//! written. What a kernel moves on top (the calibration's range pass re-reading K, or the scores
//! it stores for the decode kernel) is not credited (`extra_bytes`).

use kvq::reference::int::{IntCache, TensorStore};

/// Bytes of one tensor's page blocks (codes and their parameters, or FP16 pages).
fn page_block_bytes(store: &TensorStore) -> u64 {
    (store.pages() * store.kv_heads() * store.block_bytes()) as u64
}

/// Bytes of one tensor (K or V) of one sequence the kernel must read.
pub fn tensor_bytes(store: &TensorStore) -> u64 {
    let blocks = page_block_bytes(store);
    let fp16_tokens = store
        .regions()
        .map_or(0, |r| r.sink().len() + r.tail().len());
    blocks + 2 * (store.kv_heads() * store.head_dim() * fp16_tokens) as u64
}

/// Bytes of one sequence: K, V, its page-table entries and its length.
pub fn sequence_bytes(cache: &IntCache) -> u64 {
    let pages = cache.k().pages().max(cache.v().pages()) as u64;
    tensor_bytes(cache.k()) + tensor_bytes(cache.v()) + 4 * pages + 4
}

/// Bytes of a whole decode step over `sequences` with `q_heads` query heads: every sequence, plus
/// the queries read and the outputs written (16-bit each).
pub fn decode_bytes(sequences: &[&IntCache], q_heads: usize) -> u64 {
    let rows: u64 = sequences
        .iter()
        .map(|s| (q_heads * s.k().head_dim()) as u64)
        .sum();
    sequences.iter().map(|s| sequence_bytes(s)).sum::<u64>() + 2 * 2 * rows
}

/// Bytes a step moves on top of [`decode_bytes`] because of how the scheme is defined:
/// CalibQuant's calibration needs every quantized key's score before the softmax. Where the
/// kernels store the scores (`score_columns` is `Some`: `DecodeKernels::score_columns`, the KV
/// head's query heads, or more where uneven head groups score some twice), the range pass writes
/// that many f32 scores for every quantized key of a KV head and the decode kernel reads them back
/// instead of K; otherwise the range pass reads K's page blocks once more (the FP16 sink and tail
/// are not calibrated either way). They are not credited as effective bandwidth; they bound it: at
/// the copy bandwidth a step reaches at most `decode / (decode + extra)` of it.
pub fn extra_bytes(sequences: &[&IntCache], score_columns: Option<usize>) -> u64 {
    sequences
        .iter()
        .filter(|s| s.spec().calibrate.is_some())
        .map(|s| {
            let k = s.k();
            if let Some(columns) = score_columns {
                let quantized = (0..k.tokens()).filter(|&t| k.is_quantized(t)).count();
                2 * 4 * (quantized * k.kv_heads() * columns) as u64
            } else {
                page_block_bytes(k)
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq::runtime::tune::synth::random_kv;
    use kvq::schemes::by_name;

    fn cache(name: &str, tokens: usize) -> IntCache {
        let spec = by_name(name).unwrap().spec;
        let (k, v) = random_kv(2, tokens, 64, 1).unwrap();
        IntCache::build(&spec, &k, &v).unwrap()
    }

    #[test]
    fn fp16_counts_whole_pages_and_nothing_else() {
        let c = cache("fp16", 256);
        // 2 pages × 2 heads × 128 tokens × 64 ch × 2 B, for K and V; 2 table entries; a length.
        assert_eq!(sequence_bytes(&c), 2 * (2 * 2 * 128 * 64 * 2) + 4 * 2 + 4);
        let q_heads = 8;
        assert_eq!(
            decode_bytes(&[&c, &c], q_heads),
            2 * sequence_bytes(&c) + 2 * 2 * 2 * (8 * 64) as u64
        );
    }

    #[test]
    fn only_calibrated_schemes_move_extra_bytes() {
        let calibrated = cache("calibquant1", 5000);
        let k_blocks = page_block_bytes(calibrated.k());
        assert!(k_blocks > 0);
        // Reading K twice: its page blocks again.
        assert_eq!(extra_bytes(&[&calibrated, &calibrated], None), 2 * k_blocks);
        // K's blocks are a large share of what a 1-bit K and V step reads, and less than half
        // (V's blocks are as large, and the FP16 sink and tail come on top).
        let share = k_blocks as f64 / sequence_bytes(&calibrated) as f64;
        assert!((0.25..0.5).contains(&share), "{share}");
        // Stored scores: 4 query heads a KV head, f32, written and read, for every quantized
        // token of both KV heads (not the sink's or the tail's).
        let k = calibrated.k();
        let quantized = (0..k.tokens()).filter(|&t| k.is_quantized(t)).count();
        assert!(quantized > 0 && quantized < 5000);
        assert_eq!(
            extra_bytes(&[&calibrated], Some(4)),
            2 * 4 * (quantized * 2 * 4) as u64
        );
        // Uneven head groups store every row's columns (GQA 11: two rows of 6).
        assert_eq!(
            extra_bytes(&[&calibrated], Some(12)),
            2 * 4 * (quantized * 2 * 12) as u64
        );
        for name in ["fp16", "kivi2", "kitty", "int8"] {
            for stores in [None, Some(4)] {
                assert_eq!(extra_bytes(&[&cache(name, 5000)], stores), 0, "{name}");
            }
        }
    }

    #[test]
    fn quantized_schemes_count_fp16_tokens_present_not_capacity() {
        for name in ["kivi2", "kitty", "int8", "calibquant1"] {
            let short = cache(name, 40);
            let long = cache(name, 5000);
            let per_token_fp16: u64 = 2 * 2 * 64; // 2 heads × 64 channels × 2 bytes
            assert!(
                tensor_bytes(short.k()) <= 40 * per_token_fp16,
                "{name}: {}",
                tensor_bytes(short.k())
            );
            assert!(
                tensor_bytes(long.k()) < 5000 * per_token_fp16,
                "{name} compresses"
            );
            assert!(tensor_bytes(long.k()) <= long.k().allocated_bytes() as u64);
        }
    }
}
