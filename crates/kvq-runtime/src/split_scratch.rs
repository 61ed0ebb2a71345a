//! The split partials a CUDA-core split-K decode (codebook, XQuant) writes and the shared combine
//! reads: `[rows·q_heads·splits][head_dim]` unnormalised outputs and `[…][2]` (max, denominator),
//! kvq-allocated and grown as launches need.

use crate::error::{Result, RuntimeError};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// Split partials in device memory, grown by the launches that need more.
pub struct SplitScratch {
    pub(crate) part_acc: CudaSlice<f32>,
    pub(crate) part_ml: CudaSlice<f32>,
}

fn alloc(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<f32>> {
    stream
        .alloc_zeros::<f32>(n.max(1))
        .map_err(|e| RuntimeError::driver("allocate the split partials", e))
}

impl SplitScratch {
    /// An empty scratch on `stream`'s device.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(Self {
            part_acc: alloc(stream, 1)?,
            part_ml: alloc(stream, 1)?,
        })
    }

    /// Room for `parts` partials of `head_dim` channels.
    pub(crate) fn reserve(
        &mut self,
        stream: &Arc<CudaStream>,
        parts: usize,
        head_dim: usize,
    ) -> Result<()> {
        if self.part_acc.len() < parts * head_dim {
            self.part_acc = alloc(stream, parts * head_dim)?;
        }
        if self.part_ml.len() < parts * 2 {
            self.part_ml = alloc(stream, parts * 2)?;
        }
        Ok(())
    }
}
