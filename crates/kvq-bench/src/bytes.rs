//! The bytes a decode step must move: the floor that "effective bandwidth" divides by time.
//!
//! Counted once each: every page block a sequence uses (codes, scales/zeros, boost planes and
//! maps, or FP16 pages), the FP16 sink and tail tokens actually present (not the buffers'
//! capacity), the page-table entries and sequence length, the queries read and the outputs
//! written. A kernel that reads something twice (the calibration range pass re-reads K) is not
//! credited for it.

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

/// Bytes a step reads on top of [`decode_bytes`] because of how the scheme is defined:
/// CalibQuant's calibration needs every quantized key's score before the softmax, so its range
/// pass reads K's page blocks once more (the FP16 sink and tail are not calibrated). They are
/// not credited as effective bandwidth; they bound it: at the copy bandwidth a step reaches at
/// most `decode / (decode + reread)` of it.
pub fn reread_bytes(sequences: &[&IntCache]) -> u64 {
    sequences
        .iter()
        .filter(|s| s.spec().calibrate.is_some())
        .map(|s| page_block_bytes(s.k()))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq::runtime::tune::synth::random_kv;
    use kvq::schemes::by_name;

    fn cache(name: &str, tokens: usize) -> IntCache {
        let spec = by_name(name).unwrap().spec;
        let (k, v) = random_kv(2, tokens, 64, 1);
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
    fn only_calibrated_schemes_read_k_twice() {
        let calibrated = cache("calibquant1", 5000);
        let k_blocks = page_block_bytes(calibrated.k());
        assert!(k_blocks > 0);
        assert_eq!(reread_bytes(&[&calibrated, &calibrated]), 2 * k_blocks);
        // K's blocks are a large share of what a 1-bit K and V step reads, and less than half
        // (V's blocks are as large, and the FP16 sink and tail come on top).
        let share = k_blocks as f64 / sequence_bytes(&calibrated) as f64;
        assert!((0.25..0.5).contains(&share), "{share}");
        for name in ["fp16", "kivi2", "kitty", "int8"] {
            assert_eq!(reread_bytes(&[&cache(name, 5000)]), 0, "{name}");
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
