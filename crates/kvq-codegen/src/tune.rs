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

    /// The heuristic default for shapes nobody tuned: 128 threads and 64-token tiles, which every
    /// tuned winner on an H200 chose (docs/BENCHMARKS.md), except where only 32-token tiles let
    /// the tensor-core kernel's `cp.async` ring fit in shared memory (8-bit codes): staged chunks
    /// beat direct loads there (INT8 at B=16 L=32K on an H100: 75.5% of copy at 64-token tiles,
    /// 89% at 32, docs/BENCHMARKS.md).
    ///
    /// ```
    /// use kvq_codegen::{Dtype, KernelShape, TuneParams};
    /// let shape = KernelShape::new(128, 4, Dtype::F16);
    /// let int8 = kvq_spec::SchemeSpec::parse("k = int(8, channel), v = int(8, token)").unwrap();
    /// let kivi2 = kvq_spec::SchemeSpec::parse("k = int(2, channel), v = int(2, token)").unwrap();
    /// assert_eq!(TuneParams::default_for(&int8, &shape).tile_tokens, 32);
    /// assert_eq!(TuneParams::default_for(&kivi2, &shape).tile_tokens, 64);
    /// ```
    pub fn default_for(spec: &SchemeSpec, shape: &KernelShape) -> Self {
        let wide = TuneParams {
            threads: 128,
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
