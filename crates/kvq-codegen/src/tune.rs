//! The tunable parameters of the decode kernel, their valid ranges, and the untuned default.

use crate::{CodegenError, KernelShape};
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

    /// The heuristic default for shapes nobody tuned: 64-token tiles, which every tuned winner
    /// on an H200 chose (docs/BENCHMARKS.md), with 128 threads.
    pub fn default_for(_shape: &KernelShape) -> Self {
        TuneParams {
            threads: 128,
            tile_tokens: 64,
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
