//! The tunable parameters of the decode kernel, their valid ranges, and the untuned default.

use crate::decode::{
    packs_heads, raises_occupancy, short_staging_changes, store_scores_changes, uses_stage_ring,
};
use crate::rules::default_block_away_from_128;
use crate::rules::variants::twelve_warps_by_default;
use crate::{CodegenError, KernelShape};
use kvq_spec::SchemeSpec;
use serde::{Deserialize, Serialize};

/// Block-level choices that change speed, never results (beyond float reassociation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TuneParams {
    /// Threads per CTA: 64, 128 or 256.
    pub threads: u32,
    /// Tokens scored per shared-memory tile: 16, 32 or 64.
    pub tile_tokens: u32,
    /// Warps per SM the decode kernel's registers must leave room for: 0 (as many registers as
    /// the compiler wants), 12 (at most 168 a thread: `__launch_bounds__(threads,
    /// min_ctas_per_sm())`) or 16 (at most 128, tried only below head_dim 128). Which is faster depends on the GPU and the shape: on an H100 twelve
    /// warps suit the 1- and 2-bit and FP16 kernels but slow KIVI-4 (×0.945 at B=16 L=32K) and
    /// INT8, which run eight; on an H200 KIVI-4 ran ×1.06 at B=16 L=32K with twelve, slower at
    /// short contexts (docs/KERNELS.md, *Occupancy*). Absent in results stored before the
    /// parameter existed, which the tuning file's version retires.
    #[serde(default)]
    pub min_warps_per_sm: u32,
    /// Whether a kernel that can hold two 16-token subtiles in one score fragment does so
    /// (`MmaCtx::pack_heads`: Kitty's boosted plane on the integer path at GQA ≤ 4, tiles of 32
    /// or 64 tokens; every other kernel renders the same either way). On an H100 packing ran
    /// Kitty ×1.020 and Kitty-Pro ×1.010 at B=16 L=32K but ×0.975 and ×0.966 at B=4 L=4K, so
    /// the default packs and the tuner tries both.
    /// Absent in results stored before the parameter existed: true, as those kernels did.
    #[serde(default = "packs_heads_by_default")]
    pub pack_heads: bool,
    /// Whether a kernel whose ring stages 4-bit K and V takes the short staging path for chunks
    /// inside quantized pages, as every other ring kernel always does (`StagePlan::quant_fast_path`).
    /// On an H100 with 128-byte stage sections it ran KIVI-4 ×1.009 at B=16 L=32K and ×1.005 at
    /// L=128K, where a warp's share of the context is 4096 tokens and more, but ×0.967 at B=16
    /// L=4K and ×0.970 at B=1 L=128K: the launch rules ([`crate::rules`]) take it by the warp's
    /// share, and with 32-token tiles at small batches, and the tuner tries both. Absent in
    /// results stored before the parameter existed: false, as those kernels did.
    #[serde(default)]
    pub short_staging: bool,
    /// Whether a calibrated scheme's range pass stores its keys' scores for the decode kernel,
    /// which then reads them instead of the keys (`MmaCtx::stored_scores`: quantized keys on the
    /// tensor-core kernel; every other kernel renders the same either way). Each key is scored
    /// once a step instead of twice. On an H100 it ran CalibQuant-1 ×1.23 and CalibQuant-2 ×1.12
    /// at B=16 L=32K, ×1.15 and ×1.02 at B=1 L=128K, but ×0.95–×1.00 at L=4K: the default
    /// stores them, the launch rules ([`crate::rules`]) not for short contexts, and the tuner
    /// tries both.
    /// Absent in results stored before the parameter existed: false, as those kernels did.
    #[serde(default)]
    pub store_scores: bool,
}

fn packs_heads_by_default() -> bool {
    true
}

impl TuneParams {
    /// Every value each parameter may take (what the autotuner searches).
    pub const THREADS: &'static [u32] = &[64, 128, 256];
    pub const TILE_TOKENS: &'static [u32] = &[16, 32, 64];
    pub const MIN_WARPS_PER_SM: &'static [u32] = &[0, 12, 16];
    pub const PACK_HEADS: &'static [bool] = &[true, false];
    pub const SHORT_STAGING: &'static [bool] = &[false, true];
    pub const STORE_SCORES: &'static [bool] = &[true, false];

    /// The heuristic default for shapes nobody tuned.
    ///
    /// - 1-, 2- and 4-bit codes whose tensor-core kernel stages 64-token chunks through its
    ///   `cp.async` ring at head_dim 128: 128-thread CTAs. Measured on an H100 against 64-thread
    ///   CTAs (the split count halves, so the warps stay as many): geomeans ×1.013–×1.022 over
    ///   B ∈ {1, 4, 16} × L ∈ {4K, 32K, 128K} for KIVI-4, Kitty, Kitty-Pro and CalibQuant,
    ///   ×1.03–×1.05 at GQA 8 in bf16; kivi2 ×1.022 at B=16 L=32K (127.3 → 124.6 µs) but ×0.93
    ///   at B=4 L=4K, which the tuner recovers. (64 threads had been up to ×1.17 faster while a
    ///   CTA's warps still merged serially.)
    /// - Everything else keeps 64-thread CTAs with 64-token tiles (×1.00–×1.17 over 128
    ///   threads), except schemes with 8-bit codes, which keep 128 threads with 32-token
    ///   tiles: only those let the ring fit in shared memory at 128 threads (INT8 at B=16 L=32K:
    ///   75.5% of copy at 64-token tiles, 89% at 32).
    /// - At head_dim 256 INT8, KIVI-4, FP16, Kitty and Kitty-Pro take smaller tiles (INT8 at 160
    ///   and 192 too), and at head_dim 64 FP16 and INT8 four-warp CTAs of 32-token tiles
    ///   ([`crate::rules::table::DEFAULT_BLOCKS`]). Head dims 80–112 take head_dim 128's
    ///   defaults ([`crate::rule_head_dim`]).
    /// - Calibrated schemes on the tensor-core kernel store their keys' scores
    ///   ([`TuneParams::store_scores`]).
    /// - Twelve warps an SM ([`TuneParams::min_warps_per_sm`]) for the tensor-core kernels of 1-
    ///   and 2-bit K and V and of FP16 at head_dim ≤ 128: the instruction stream limits them, and
    ///   more warps hide more latency than the few registers the cap costs (an uncapped FP16 kernel
    ///   took 173 registers and ran ×0.98 at B=16). The 4- and 8-bit kernels run uncapped (176–186
    ///   registers, eight warps): capped they ran ×0.95 (KIVI-4) and ×0.975 (INT8) at B=16 L=32K on
    ///   an H100, so the tuner offers the cap and each GPU decides.
    ///
    /// ```
    /// use kvq_codegen::{Dtype, KernelShape, TuneParams};
    /// let shape = KernelShape::new(128, 4, Dtype::F16);
    /// let int8 = kvq_spec::SchemeSpec::parse("k = int(8, channel), v = int(8, token)").unwrap();
    /// let kivi2 = kvq_spec::SchemeSpec::parse("k = int(2, channel), v = int(2, token)").unwrap();
    /// let fp16 = kvq_spec::SchemeSpec::parse("k = fp16, v = fp16").unwrap();
    /// let int8_default = TuneParams::default_for(&int8, &shape);
    /// assert_eq!((int8_default.threads, int8_default.tile_tokens), (128, 32));
    /// let kivi2_default = TuneParams::default_for(&kivi2, &shape);
    /// assert_eq!((kivi2_default.threads, kivi2_default.tile_tokens), (128, 64));
    /// let fp16_default = TuneParams::default_for(&fp16, &shape);
    /// assert_eq!((fp16_default.threads, fp16_default.tile_tokens), (64, 64));
    /// assert_eq!(kivi2_default.min_warps_per_sm, 12);
    /// assert_eq!(int8_default.min_warps_per_sm, 0);
    /// // A 16-token tile at head_dim 256 holds as many channels as a 32-token one at 128.
    /// let d256 = KernelShape::new(256, 4, Dtype::F16);
    /// let int8_d256 = TuneParams::default_for(&int8, &d256);
    /// assert_eq!((int8_d256.threads, int8_d256.tile_tokens), (128, 16));
    /// let kivi2_d256 = TuneParams::default_for(&kivi2, &d256);
    /// assert_eq!((kivi2_d256.threads, kivi2_d256.tile_tokens), (64, 64));
    /// ```
    pub fn default_for(spec: &SchemeSpec, shape: &KernelShape) -> Self {
        let min_warps_per_sm = if twelve_warps_by_default(spec, shape) {
            12
        } else {
            0
        };
        let block = TuneParams {
            min_warps_per_sm,
            ..Self::block_default(spec, shape)
        };
        TuneParams {
            store_scores: store_scores_changes(spec, shape, &block),
            ..block
        }
    }

    /// Threads and tile of [`TuneParams::default_for`] (no occupancy floor).
    fn block_default(spec: &SchemeSpec, shape: &KernelShape) -> Self {
        let eight_bit = [&spec.k, &spec.v]
            .iter()
            .any(|t| t.as_int().is_some_and(|q| q.bits >= 8));
        let four_warps = TuneParams {
            threads: 128,
            tile_tokens: 64,
            min_warps_per_sm: 0,
            pack_heads: true,
            short_staging: false,
            store_scores: false,
        };
        let rule_dim = crate::rule_head_dim(spec, shape);
        if let Some((threads, tile_tokens)) = default_block_away_from_128(spec, rule_dim) {
            return TuneParams {
                threads,
                tile_tokens,
                ..four_warps
            };
        }
        if !eight_bit && rule_dim == 128 && uses_stage_ring(spec, shape, &four_warps) {
            return four_warps;
        }
        let wide = TuneParams {
            threads: if eight_bit { 128 } else { 64 },
            tile_tokens: 64,
            min_warps_per_sm: 0,
            pack_heads: true,
            short_staging: false,
            store_scores: false,
        };
        let narrow = TuneParams {
            tile_tokens: 32,
            ..wide
        };
        if !uses_stage_ring(spec, shape, &wide) && uses_stage_ring(spec, shape, &narrow) {
            narrow
        } else {
            wide
        }
    }

    /// Warps per CTA (the split rule keeps at least 32 or 64 bucket tokens per warp of a split:
    /// [`crate::rules::LaunchRules::min_warp_tokens`]).
    pub fn warps(&self) -> usize {
        self.threads as usize / 32
    }

    /// CTAs per SM the decode kernel's `__launch_bounds__` asks registers for: enough for
    /// [`TuneParams::min_warps_per_sm`] (rounded down to whole CTAs), at least one.
    ///
    /// ```
    /// use kvq_codegen::TuneParams;
    /// let p = |threads, min_warps_per_sm| TuneParams {
    ///     threads,
    ///     tile_tokens: 64,
    ///     min_warps_per_sm,
    ///     pack_heads: true,
    ///     short_staging: false,
    ///     store_scores: false,
    /// };
    /// assert_eq!(p(64, 12).min_ctas_per_sm(), 6);
    /// assert_eq!(p(128, 12).min_ctas_per_sm(), 3);
    /// assert_eq!(p(256, 12).min_ctas_per_sm(), 1); // one 8-warp CTA: no floor
    /// assert_eq!(p(128, 0).min_ctas_per_sm(), 1);
    /// ```
    pub fn min_ctas_per_sm(&self) -> u32 {
        (self.min_warps_per_sm / (self.threads / 32).max(1)).max(1)
    }

    /// Every valid combination.
    pub fn candidates() -> impl Iterator<Item = TuneParams> {
        Self::THREADS.iter().flat_map(|&threads| {
            Self::TILE_TOKENS.iter().flat_map(move |&tile_tokens| {
                Self::MIN_WARPS_PER_SM
                    .iter()
                    .flat_map(move |&min_warps_per_sm| {
                        Self::PACK_HEADS.iter().flat_map(move |&pack_heads| {
                            Self::SHORT_STAGING.iter().flat_map(move |&short_staging| {
                                Self::STORE_SCORES
                                    .iter()
                                    .map(move |&store_scores| TuneParams {
                                        threads,
                                        tile_tokens,
                                        min_warps_per_sm,
                                        pack_heads,
                                        short_staging,
                                        store_scores,
                                    })
                            })
                        })
                    })
            })
        })
    }

    /// The combinations that render different kernels for `spec` at `shape` (what the tuner
    /// times): every threads × tile, each without an occupancy floor and, where the floor
    /// changes the tensor-core kernel's register budget at head_dim ≤ 128 (CTAs of at most six
    /// warps), with twelve warps an SM; each packing its score fragments and, where the kernel
    /// would pack, not; each on the general staging path and, where the kernel would take it,
    /// on the short one; each storing a calibrated scheme's scores where the kernel can, and
    /// not. The default comes first.
    pub fn candidates_for(spec: &SchemeSpec, shape: &KernelShape) -> Vec<TuneParams> {
        let default = Self::default_for(spec, shape);
        let mut out = vec![default];
        out.extend(Self::candidates().filter(|p| {
            let packing = TuneParams {
                pack_heads: true,
                ..*p
            };
            let general = TuneParams {
                short_staging: false,
                ..*p
            };
            *p != default
                && (p.min_warps_per_sm == 0 || raises_occupancy(spec, shape, p))
                && (p.pack_heads || packs_heads(spec, shape, &packing))
                && (!p.short_staging || short_staging_changes(spec, shape, &general))
                && (!p.store_scores || store_scores_changes(spec, shape, p))
        }));
        out
    }

    pub fn validate(&self) -> Result<(), CodegenError> {
        if !Self::THREADS.contains(&self.threads) {
            return Err(CodegenError::Shape(format!(
                "threads = {} (expected one of {:?})",
                self.threads,
                Self::THREADS
            )));
        }
        if !Self::TILE_TOKENS.contains(&self.tile_tokens) {
            return Err(CodegenError::Shape(format!(
                "tile_tokens = {} (expected one of {:?})",
                self.tile_tokens,
                Self::TILE_TOKENS
            )));
        }
        if !Self::MIN_WARPS_PER_SM.contains(&self.min_warps_per_sm) {
            return Err(CodegenError::Shape(format!(
                "min_warps_per_sm = {} (expected one of {:?})",
                self.min_warps_per_sm,
                Self::MIN_WARPS_PER_SM
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dtype;

    fn block(text: &str, head_dim: u32) -> (u32, u32) {
        let spec = SchemeSpec::parse(text).unwrap();
        let p = TuneParams::default_for(&spec, &KernelShape::new(head_dim, 4, Dtype::F16));
        (p.threads, p.tile_tokens)
    }

    const FP16: &str = "k = fp16, v = fp16";
    const INT8: &str = "k = int(8, channel, symmetric), v = int(8, channel, symmetric)";
    const KIVI4: &str = "k = int(4, channel), v = int(4, token), local = 128";
    const KIVI2: &str = "k = int(2, channel), v = int(2, token), local = 128";
    const KITTY: &str =
        "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token), local = 128";
    const CALIBQUANT1: &str = "k = int(1, channel), v = int(1, channel), local = 128, \
                               calibrate = calibrate(tau1 = 0.6, tau2 = 0.1)";

    #[test]
    fn head_dim_256_takes_smaller_tiles_for_the_families_measured_there() {
        assert_eq!(block(INT8, 256), (128, 16));
        assert_eq!(block(KIVI4, 256), (128, 16));
        assert_eq!(block(FP16, 256), (64, 16));
        assert_eq!(block(KITTY, 256), (128, 32));
        // kivi2 and CalibQuant keep the general default.
        assert_eq!(block(KIVI2, 256), (64, 64));
        assert_eq!(block(CALIBQUANT1, 256), (64, 64));
    }

    #[test]
    fn head_dim_64_takes_four_warp_32_token_tiles_for_fp16_and_int8_only() {
        assert_eq!(block(FP16, 64), (128, 32));
        assert_eq!(block(INT8, 64), (128, 32));
        assert_eq!(block(KIVI4, 64), (64, 64));
        assert_eq!(block(KITTY, 64), (64, 64));
        assert_eq!(block(CALIBQUANT1, 64), (64, 64));
    }

    #[test]
    fn head_dim_128_keeps_its_rules() {
        assert_eq!(block(FP16, 128), (64, 64));
        assert_eq!(block(INT8, 128), (128, 32));
        assert_eq!(block(KIVI2, 128), (128, 64));
        assert_eq!(block(KITTY, 128), (128, 64));
    }

    #[test]
    fn head_dims_80_to_112_take_128s_blocks_and_int8_at_160_and_192_takes_256s() {
        for d in [80, 96, 112] {
            for scheme in [FP16, INT8, KIVI4, KIVI2, KITTY, CALIBQUANT1] {
                assert_eq!(block(scheme, d), block(scheme, 128), "{scheme} d{d}");
            }
            let kivi2 = SchemeSpec::parse(KIVI2).unwrap();
            let shape = KernelShape::new(d, 4, Dtype::F16);
            assert_eq!(crate::rule_head_dim(&kivi2, &shape), 128);
            assert_eq!(
                crate::rules::family(&kivi2, &shape),
                crate::rules::family(&kivi2, &KernelShape::new(128, 4, Dtype::F16)),
                "d{d}"
            );
        }
        for d in [160, 192] {
            assert_eq!(block(INT8, d), (128, 16), "d{d}");
            // The others lost with 256's blocks there: the general default.
            assert_eq!(block(KIVI4, d), (64, 64), "d{d}");
            assert_eq!(block(KITTY, d), (64, 64), "d{d}");
        }
    }

    #[test]
    fn calibrated_schemes_of_any_width_keep_the_general_default() {
        let calibrated_int8 = "k = int(8, channel, symmetric), v = int(8, channel, symmetric), \
                               calibrate = calibrate(tau1 = -0.5, tau2 = 0.25)";
        assert_eq!(block(calibrated_int8, 256), (128, 64));
    }
}
