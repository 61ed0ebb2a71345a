//! The split partials a CUDA-core split-K decode (codebook, XQuant) writes and the shared combine
//! reads: `[rows·q_heads·splits][head_dim]` unnormalised outputs and `[…][2]` (max, denominator),
//! kvq-allocated and grown as launches need.

use crate::error::{Result, RuntimeError};
use crate::launch::{launch_err, Args, Input, Output};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use kvq_codegen::KernelEntry;
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

    /// Enqueues the shared combine (`function`, generated as `entry`) over `splits` partials of
    /// each query head of `(q_heads, rows)` into `out` (`[rows][q_heads][head_dim]`, no LSE).
    pub(crate) fn combine(
        &self,
        stream: &Arc<CudaStream>,
        function: &CudaFunction,
        entry: &KernelEntry,
        out: &mut CudaSlice<u16>,
        (q_heads, rows): (usize, usize),
        splits: usize,
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (q_heads as u32, rows as u32, 1),
            block_dim: (entry.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = Args::new(stream);
        args.input(Input::Slice(&self.part_acc))
            .input(Input::Slice(&self.part_ml))
            .output(Output::Slice(out))
            .null()
            .int(splits as i32);
        // SAFETY: the combine entry's params; the caller's decode filled `splits` partials of
        // every head into this scratch, reserved for that grid.
        unsafe { args.launch(function, cfg, false) }.map_err(launch_err(&entry.name))
    }
}
