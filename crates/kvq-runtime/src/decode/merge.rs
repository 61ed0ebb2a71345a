//! [`MergeKernel`]: merges attention states `(O, LSE)` over disjoint parts of each row's tokens
//! into the state over all of them, on the GPU (context parallelism: each GPU attends its share of
//! a sequence with [`DecodeKernel::attend_with_lse`](super::DecodeKernel::attend_with_lse), then
//! the shares are gathered and merged).

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use kvq_codegen::{merge_kernel, Dtype};
use kvq_jit::launch::Args;

use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::nvrtc::{CompileOptions, Source};

/// The merge kernel of one head size and dtype, loaded.
pub struct MergeKernel {
    generated: kvq_codegen::MergeKernel,
    function: CudaFunction,
}

impl MergeKernel {
    /// Compiles (or loads from the caches) the merge kernel for `head_dim` channels in `dtype`.
    pub fn load(jit: &Jit, head_dim: u32, dtype: Dtype) -> Result<MergeKernel> {
        let generated = merge_kernel(head_dim, dtype)?;
        let source = kvq_codegen::kernel_headers().iter().fold(
            Source::new(
                format!("{}.cu", generated.entry.name),
                generated.source.clone(),
            ),
            |s, (name, text)| s.with_header(*name, *text),
        );
        let function = jit.function(&source, &generated.entry.name, &CompileOptions::default())?;
        Ok(MergeKernel {
            generated,
            function,
        })
    }

    /// The generated unit and entry point.
    pub fn generated(&self) -> &kvq_codegen::MergeKernel {
        &self.generated
    }

    /// Enqueues the merge on `stream`: `out_parts` is `[parts][rows][head_dim]` in the kernel's
    /// dtype and `lse_parts` `[parts][rows]` (each part's `attend_with_lse` output, one after
    /// another); `out` receives `[rows][head_dim]` and `lse`, where given, `[rows]`. A row no part
    /// saw (every LSE −inf) gets zeros and −inf.
    pub fn merge(
        &self,
        stream: &Arc<CudaStream>,
        parts: usize,
        out_parts: &CudaSlice<u16>,
        lse_parts: &CudaSlice<f32>,
        out: &mut CudaSlice<u16>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let d = self.generated.head_dim as usize;
        if out.len() % d != 0 {
            return Err(RuntimeError::InvalidInput(format!(
                "out holds {} values, not whole rows of head_dim {d}",
                out.len()
            )));
        }
        let rows = out.len() / d;
        let (parts_i, rows_i) = self.check(parts, rows)?;
        if out_parts.len() != parts * rows * d || lse_parts.len() != parts * rows {
            return Err(RuntimeError::InvalidInput(format!(
                "out_parts must hold [parts {parts}][rows {rows}][head_dim {d}] = {} values and \
                 lse_parts [parts][rows] = {} floats, got {} and {}",
                parts * rows * d,
                parts * rows,
                out_parts.len(),
                lse_parts.len()
            )));
        }
        if let Some(l) = &lse {
            if l.len() != rows {
                return Err(RuntimeError::InvalidInput(format!(
                    "lse must hold [rows {rows}] floats, got {}",
                    l.len()
                )));
            }
        }
        if rows == 0 {
            return Ok(());
        }
        let mut args = Args::new(stream);
        args.buffer(out_parts)
            .buffer(lse_parts)
            .int(parts_i)
            .int(rows_i)
            .buffer_mut(out);
        match lse {
            Some(l) => args.buffer_mut(l),
            None => args.null(),
        };
        // SAFETY: the arguments follow the entry point's parameters (kvq_codegen::merge_kernel),
        // and every buffer was checked above to hold the rows the grid covers.
        unsafe { self.launch(args, rows) }
    }

    /// [`merge`](Self::merge) on device pointers the caller owns (an engine's memory), `lse` 0
    /// for none.
    ///
    /// # Safety
    /// Each pointer is a device allocation of the stream's context holding what
    /// [`merge`](Self::merge) says for `parts` and `rows` (`out_parts`
    /// `parts·rows·head_dim` 16-bit values, `lse_parts` `parts·rows` floats, `out`
    /// `rows·head_dim` values, `lse` `rows` floats), alive until the merge has run on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn merge_raw(
        &self,
        stream: &Arc<CudaStream>,
        parts: usize,
        rows: usize,
        out_parts: u64,
        lse_parts: u64,
        out: u64,
        lse: u64,
    ) -> Result<()> {
        let (parts_i, rows_i) = self.check(parts, rows)?;
        if rows == 0 {
            return Ok(());
        }
        if out_parts == 0 || lse_parts == 0 || out == 0 {
            return Err(RuntimeError::InvalidInput(
                "out_parts, lse_parts and out must not be null".into(),
            ));
        }
        let mut args = Args::new(stream);
        args.ptr(out_parts)
            .ptr(lse_parts)
            .int(parts_i)
            .int(rows_i)
            .ptr(out)
            .ptr(lse);
        // SAFETY: as above; the caller vouches for the pointers.
        unsafe { self.launch(args, rows) }
    }

    /// `parts` and `rows` as the kernel's ints, or why not.
    fn check(&self, parts: usize, rows: usize) -> Result<(i32, i32)> {
        match (i32::try_from(parts), i32::try_from(rows)) {
            (Ok(p), Ok(r)) if p > 0 => Ok((p, r)),
            _ => Err(RuntimeError::InvalidInput(format!(
                "a merge of {parts} parts of {rows} rows (at least one part; each count must fit \
                 an int)"
            ))),
        }
    }

    /// Launches the kernel over `rows` rows with `args`.
    ///
    /// # Safety
    /// `args` follow the entry point's parameters, with buffers holding `rows` rows.
    unsafe fn launch(&self, args: Args<'_>, rows: usize) -> Result<()> {
        let rows_per_cta = (self.generated.entry.block / 32) as usize;
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(rows_per_cta) as u32, 1, 1),
            block_dim: (self.generated.entry.block, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { args.launch(&self.function, cfg, false) }
            .map_err(|e| RuntimeError::launch(self.generated.entry.name.as_str(), e))
    }
}
