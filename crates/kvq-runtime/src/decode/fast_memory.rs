//! Twelve warps an SM for KIVI-4's kernels on GPUs whose memory is fast for their SMs.
//!
//! The block rules and the codegen default were measured on an H100 (3352 GB/s peak over 132 SMs,
//! 25 GB/s an SM), where KIVI-4's ring kernel runs best with eight warps an SM: it is close to the
//! copy bandwidth there and spends the registers on its own work. An H200 has the same SMs and 4814
//! GB/s (36 GB/s an SM): the same kernel reaches only 76% of its copy bandwidth there, and more warps
//! an SM keep more loads in flight (why twelve pay there and not on the H100 was not profiled).
//! Forced to twelve on an H200 (docs/BENCHMARKS.md,
//! thirty-ninth round), KIVI-4 ran ×1.05–×1.12 where a split warp's share of the context bucket is
//! 668 tokens or more (B=1 L=128K, B ∈ {4, 8} at L ≥ 32K, B=16 L=128K) and ×1.02 at 341, but
//! ×0.91–×1.00 at 32–170 tokens a warp, and ×0.88 at B=16 L=32K where the larger grid's warps fell
//! below the short staging path's threshold (the tuner's twelve-warp choice there keeps that path:
//! ×1.017). With this rule the H200 ran KIVI-4 ×1.02–×1.12 at B ∈ {4, 8, 16} × L ∈ {32K, 128K}
//! and B=1 L=128K; the H100's launches are unchanged. Where a split warp of that grid takes 1024
//! tokens or more, 64-token tiles pay on top (the forty-first round: ×1.021–×1.075 at B ∈ {2, 4,
//! 8}, the tuner's choice there).

use kvq_codegen::{short_staging_changes, KernelShape, TuneParams};
use kvq_spec::SchemeSpec;

/// Peak DRAM bandwidth a streaming multiprocessor (GB/s) from which [`fast_memory_block`] applies:
/// between the H100's 25.4 and the H200's 36.5.
pub const FAST_MEMORY_GBPS_PER_SM: f64 = 30.0;

/// Fewest bucket tokens a split warp of the twelve-warp grid takes for [`fast_memory_block`] to
/// apply: on the H200 it gained from 668 (×1.02 at 341) and lost or held at 32–170.
pub const FAST_MEMORY_MIN_WARP_TOKENS: usize = 512;

/// Fewest bucket tokens a split warp of the twelve-warp grid takes for [`fast_memory_block`] to
/// stage 64-token tiles: on an H200 the tuner chose them at 1365–5461 tokens a warp (×1.011–×1.071)
/// and kept 32 at 668–682.
pub const FAST_MEMORY_TILE64_MIN_WARP_TOKENS: usize = 1024;

/// Whether a GPU of `peak_gbps` peak DRAM bandwidth over `sm_count` SMs counts as fast memory
/// ([`FAST_MEMORY_GBPS_PER_SM`]). A GPU that reports no memory clock (0 GB/s) does not.
///
/// ```
/// use kvq_runtime::decode::is_fast_memory;
/// assert!(!is_fast_memory(3352.0, 132)); // H100 SXM
/// assert!(is_fast_memory(4814.0, 132)); // H200
/// assert!(!is_fast_memory(2039.0, 114)); // H100 PCIe
/// ```
pub fn is_fast_memory(peak_gbps: f64, sm_count: usize) -> bool {
    sm_count > 0 && peak_gbps / sm_count as f64 >= FAST_MEMORY_GBPS_PER_SM
}

/// Whether [`fast_memory_block`] can change this scheme's launches at this kernel shape: KIVI-4's
/// family at head_dim 128, where it was measured.
pub fn fast_memory_applies(spec: &SchemeSpec, shape: &KernelShape) -> bool {
    twelve_warp_candidate(spec, shape, &TuneParams::default_for(spec, shape))
}

/// Whether `params` renders a 4-bit K and V kernel at head_dim 128 with a short staging path
/// (KIVI-4's family) whose occupancy floor of twelve warps an SM changes it.
fn twelve_warp_candidate(spec: &SchemeSpec, shape: &KernelShape, params: &TuneParams) -> bool {
    let four_bits = |t: &kvq_spec::TensorQuant| t.as_int().is_some_and(|q| q.bits == 4);
    let twelve = TuneParams {
        min_warps_per_sm: 12,
        short_staging: true,
        ..*params
    };
    shape.head_dim == 128
        && four_bits(&spec.k)
        && four_bits(&spec.v)
        && params.min_warps_per_sm == 0
        && short_staging_changes(spec, shape, &twelve)
        && TuneParams::candidates_for(spec, shape).contains(&twelve)
}

/// The block of twelve warps an SM, with the short staging path, that a launch of `params` takes
/// on a fast-memory GPU, and its split count: `splits_for` gives the split count of a grid of that
/// many resident CTAs. Its tiles are 64 tokens where a split warp's share of the `bucket` reaches
/// [`FAST_MEMORY_TILE64_MIN_WARP_TOKENS`], else `params`' own. `None` where the launch keeps
/// `params`: another family, or a split warp's share below [`FAST_MEMORY_MIN_WARP_TOKENS`].
pub fn fast_memory_block(
    spec: &SchemeSpec,
    shape: &KernelShape,
    params: &TuneParams,
    bucket: usize,
    sm_count: usize,
    splits_for: impl Fn(usize) -> usize,
) -> Option<(TuneParams, usize)> {
    if !twelve_warp_candidate(spec, shape, params) {
        return None;
    }
    let warps = params.warps().max(1);
    let splits = splits_for(sm_count * (12 / warps)).max(1);
    let warp_tokens = bucket / (splits * warps);
    if warp_tokens < FAST_MEMORY_MIN_WARP_TOKENS {
        return None;
    }
    let twelve = TuneParams {
        min_warps_per_sm: 12,
        short_staging: true,
        ..*params
    };
    let wide = TuneParams {
        tile_tokens: 64,
        ..twelve
    };
    let wide_pays = warp_tokens >= FAST_MEMORY_TILE64_MIN_WARP_TOKENS
        && TuneParams::candidates_for(spec, shape).contains(&wide)
        && short_staging_changes(spec, shape, &wide);
    Some((if wide_pays { wide } else { twelve }, splits))
}
