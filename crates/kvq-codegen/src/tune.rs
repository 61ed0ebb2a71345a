//! The tunable parameters of the decode kernel, their valid ranges, and the untuned default.

use crate::decode::uses_stage_ring;
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
}

impl TuneParams {
    /// Every value each parameter may take (what the autotuner searches).
    pub const THREADS: &'static [u32] = &[64, 128, 256];
    pub const TILE_TOKENS: &'static [u32] = &[16, 32, 64];

    /// The heuristic default for shapes nobody tuned.
    ///
    /// - 1-, 2- and 4-bit codes whose tensor-core kernel stages 64-token chunks through its
    ///   `cp.async` ring at head_dim 128: 128-thread CTAs. Measured on an H100 against 64-thread
    ///   CTAs (the split count halves, so the warps stay as many; docs/BENCHMARKS.md,
    ///   twenty-second round): geomeans ×1.013–×1.022 over B ∈ {1, 4, 16} × L ∈ {4K, 32K,
    ///   128K} for KIVI-4, Kitty, Kitty-Pro and CalibQuant, ×1.03–×1.05 at GQA 8 in bf16; kivi2
    ///   ×1.022 at B=16 L=32K (127.3 → 124.6 µs) but ×0.93 at B=4 L=4K, which the tuner
    ///   recovers. The ninth round had found the opposite (64 threads up to ×1.17 faster), before
    ///   the twelfth round took the serial merge of a CTA's warps out.
    /// - Everything else keeps 64-thread CTAs with 64-token tiles (ninth round: ×1.00–×1.17 over
    ///   128 threads), except schemes with 8-bit codes, which keep 128 threads with 32-token
    ///   tiles: only those let the ring fit in shared memory at 128 threads (INT8 at B=16 L=32K:
    ///   75.5% of copy at 64-token tiles, 89% at 32).
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
    /// ```
    pub fn default_for(spec: &SchemeSpec, shape: &KernelShape) -> Self {
        let eight_bit = [&spec.k, &spec.v]
            .iter()
            .any(|t| t.as_int().is_some_and(|q| q.bits >= 8));
        let four_warps = TuneParams {
            threads: 128,
            tile_tokens: 64,
        };
        if !eight_bit && shape.head_dim == 128 && uses_stage_ring(spec, shape, &four_warps) {
            return four_warps;
        }
        let wide = TuneParams {
            threads: if eight_bit { 128 } else { 64 },
            tile_tokens: 64,
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

    /// Warps per CTA (`default_splits` keeps at least 32 or 64 bucket tokens per warp of a split:
    /// `min_warp_tokens` in kvq-runtime).
    pub fn warps(&self) -> usize {
        self.threads as usize / 32
    }

    /// Every valid combination.
    pub fn candidates() -> impl Iterator<Item = TuneParams> {
        Self::THREADS.iter().flat_map(|&threads| {
            Self::TILE_TOKENS
                .iter()
                .map(move |&tile_tokens| TuneParams {
                    threads,
                    tile_tokens,
                })
        })
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
        Ok(())
    }
}
