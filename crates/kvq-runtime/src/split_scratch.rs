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
        let parts = (Input::Slice(&self.part_acc), Input::Slice(&self.part_ml));
        let dst = (Output::Slice(out), Output::Raw(0));
        // SAFETY: the caller's decode filled `splits` partials of every head into this scratch,
        // reserved for that grid; `out` is a slice.
        unsafe {
            combine(
                stream,
                (function, entry),
                parts,
                dst,
                (q_heads, rows),
                splits,
            )
        }
    }
}

/// Enqueues the shared combine (`function`, generated as `entry`) over `splits` partials
/// (`parts`: accumulators and (max, denominator)) of each query head of `(q_heads, rows)` into
/// `out` (`[rows][q_heads][head_dim]`) and, where its address is not 0, `lse` (`[rows][q_heads]`).
///
/// # Safety
/// Raw addresses are device memory of `stream`'s context of those sizes; the partials hold
/// `splits` parts of every head.
pub(crate) unsafe fn combine(
    stream: &Arc<CudaStream>,
    (function, entry): (&CudaFunction, &KernelEntry),
    (part_acc, part_ml): (Input<'_, f32>, Input<'_, f32>),
    (out, lse): (Output<'_, u16>, Output<'_, f32>),
    (q_heads, rows): (usize, usize),
    splits: usize,
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (q_heads as u32, rows as u32, 1),
        block_dim: (entry.block, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = Args::new(stream);
    args.input(part_acc).input(part_ml).output(out);
    match lse {
        Output::Raw(0) => args.null(),
        lse => args.output(lse),
    };
    args.int(splits as i32);
    // SAFETY: the combine entry's params; the caller vouches for the buffers.
    unsafe { args.launch(function, cfg, false) }.map_err(launch_err(&entry.name))
}
