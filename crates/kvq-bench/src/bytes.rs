//! The bytes a decode step must move: the floor that "effective bandwidth" divides by time.
//!
//! Counted once each: every page block a sequence uses (codes, scales/zeros, boost planes and
//! maps, or FP16 pages), the FP16 sink and tail tokens actually present (not the buffers'
//! capacity), the page-table entries and sequence length, the queries read and the outputs
//! written. What a kernel moves on top (the calibration's range pass re-reading K, or the scores
//! it stores for the decode kernel) is not credited (`extra_bytes`).

use kvq::codegen::RebuildPrecision;
use kvq::reference::int::{IntCache, TensorStore};
use kvq::reference::xquant::XQuantCache;

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

/// Bytes of an XQuant decode step over `batch` copies of `cache` with `q_heads` query heads:
/// each sequence's latent store (counted as [`sequence_bytes`] counts an integer cache: the
/// latents are one), XQuant-CL's accumulator latents (f16, K's and V's), the projections' up
/// factors once (`up_k` in f16, both halves for the f32 rebuild, and `up_v` in f32: every CTA
/// reads them, L2 serves all but the first read), and the queries read and outputs written.
pub fn xquant_decode_bytes(
    cache: &XQuantCache,
    batch: usize,
    q_heads: usize,
    precision: RebuildPrecision,
) -> u64 {
    let p = cache.projections();
    let up_k_halves = match precision {
        RebuildPrecision::F16 => 1,
        RebuildPrecision::F32 => 2,
    };
    let factors = (2 * up_k_halves * p.k.rank * p.k.out + 4 * p.v.rank * p.v.out) as u64;
    let accumulator = cache
        .accumulator_latents()
        .map_or(0, |(k, v)| 2 * (k.len() + v.len()) as u64);
    let rows = (batch * q_heads * p.head_dim) as u64;
    batch as u64 * (sequence_bytes(cache.stored()) + accumulator) + factors + 2 * 2 * rows
}

/// The useful tensor-core work of an XQuant step's K rebuild: `2·R·D` FLOP a token and KV head
/// (counted once, whatever passes the rebuild's precision takes), for `batch` copies of `cache`.
pub fn xquant_rebuild_flop(cache: &XQuantCache, batch: usize) -> f64 {
    let p = cache.projections();
    2.0 * (p.k.rank * p.head_dim * p.kv_heads) as f64 * (cache.tokens() * batch) as f64
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
    fn xquant_counts_its_latents_factors_and_rows() {
        let spec = by_name("xquant2").unwrap().spec;
        let c = kvq::runtime::xquant::synthetic_cache(&spec, (2, 64, 256), 300, 1).unwrap();
        let (r, out) = (128usize, 128usize);
        let factors = (2 * r * out + 4 * r * out) as u64;
        let rows = (3 * 4 * 64) as u64;
        let f16 = xquant_decode_bytes(&c, 3, 4, RebuildPrecision::F16);
        assert_eq!(f16, 3 * sequence_bytes(c.stored()) + factors + 4 * rows);
        // The f32 rebuild reads up_k's low half too.
        let f32 = xquant_decode_bytes(&c, 3, 4, RebuildPrecision::F32);
        assert_eq!(f32 - f16, (2 * r * out) as u64);
        // 2-bit latents of 128 take fewer bytes a token than the FP16 K/V of 2 heads × 64.
        assert!(sequence_bytes(c.stored()) < 300 * 2 * 2 * 128);
        assert_eq!(
            xquant_rebuild_flop(&c, 3),
            2.0 * (128 * 64 * 2) as f64 * 900.0
        );
        // XQuant-CL also reads its accumulator's f16 latents.
        let cl = by_name("xquant-cl2").unwrap().spec;
        let c = kvq::runtime::xquant::synthetic_cache(&cl, (2, 64, 256), 300, 1).unwrap();
        let with = xquant_decode_bytes(&c, 1, 4, RebuildPrecision::F16);
        assert_eq!(
            with,
            sequence_bytes(c.stored()) + 2 * 2 * 300 * 128 + factors + 4 * (4 * 64)
        );
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
