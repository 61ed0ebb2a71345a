//! [`XQuantProjector`]: the cache writes' projection of new tokens' layer input to f16 latent rows
//! on tensor cores (`kernels/include/kvq/xquant/project.cuh`).

use super::cross_layer::reserve_sums;
use super::weights::{invalid, XQuantWeightInputs, XQuantWeights};
use crate::error::Result;
use crate::jit::Jit;
use crate::launch::{allow_dynamic_shared, launch_err, unit_source, Args, Input, Output};
use crate::nvrtc::CompileOptions;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use kvq_codegen::{xquant_project_kernel, Dtype, ProjectTile, XQuantProjectKernel};
use std::sync::Arc;

/// The projection kernels (a narrow tile for a decode step's few tokens, a wide one for prefills)
/// for one layer input dtype, `d_model` and latent width, compiled and loaded. Both tiles sum each
/// latent in the same order: a token's latents do not depend on its batch.
pub struct XQuantProjector {
    generated: XQuantProjectKernel,
    narrow: CudaFunction,
    wide: CudaFunction,
    reduce: CudaFunction,
    sm_count: u32,
    /// A split launch's partition sums, grown as needed.
    partial: Option<CudaSlice<f32>>,
}

impl XQuantProjector {
    /// Generates, compiles (through the JIT's caches) and loads the projection.
    pub fn load(jit: &Jit, dtype: Dtype, d_model: usize, rank: usize) -> Result<Self> {
        let d = u32::try_from(d_model).map_err(|_| invalid(format!("d_model {d_model}")))?;
        let generated = xquant_project_kernel(dtype, d, rank)?;
        let source = unit_source(&generated.narrow.name, &generated.source);
        let names = [
            generated.narrow.name.as_str(),
            generated.wide.name.as_str(),
            generated.reduce.name.as_str(),
        ];
        // One function a name, in order (kvq-jit's `functions`).
        let [narrow, wide, reduce]: [CudaFunction; 3] = jit
            .functions(&source, &names, &CompileOptions::default())?
            .try_into()
            .map_err(|_| invalid("kernel list shorter than requested".into()))?;
        allow_dynamic_shared(&narrow, &generated.narrow)?;
        allow_dynamic_shared(&wide, &generated.wide)?;
        Ok(Self {
            generated,
            narrow,
            wide,
            reduce,
            sm_count: jit.device().props().sm_count,
            partial: None,
        })
    }

    /// The generated source and launch metadata.
    pub fn generated(&self) -> &XQuantProjectKernel {
        &self.generated
    }

    /// Enqueues `lat_k`, `lat_v` (`[n][rank]` f16 each, rows past `n` untouched) =
    /// `X·down_k`, `X·down_v` of `x` (`[n][d_model]` in the projector's dtype), each latent
    /// rounded to nearest f16.
    pub fn project(
        &mut self,
        stream: &Arc<CudaStream>,
        weights: &XQuantWeights,
        x: &CudaSlice<u16>,
        n: usize,
        lat_k: &mut CudaSlice<u16>,
        lat_v: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let inputs = weights.inputs();
        self.check(&inputs)?;
        if n == 0 {
            return Ok(());
        }
        let need_x = n * weights.d_model;
        let need_l = n * weights.rank;
        if x.len() != need_x || lat_k.len() < need_l || lat_v.len() < need_l {
            return Err(invalid(format!(
                "x must hold [n {n}][d_model {}] = {need_x} values (got {}), the latent rows at \
                 least [n][{}] = {need_l} (got {} and {})",
                weights.d_model,
                x.len(),
                weights.rank,
                lat_k.len(),
                lat_v.len()
            )));
        }
        let partial_len = self.partial_bytes(n) / 4;
        reserve_sums(
            stream,
            &mut self.partial,
            partial_len,
            "the projection's partition sums",
        )?;
        let kernels = Kernels {
            generated: &self.generated,
            narrow: &self.narrow,
            wide: &self.wide,
            reduce: &self.reduce,
            sm_count: self.sm_count,
        };
        let partial = match (&mut self.partial, partial_len > 0) {
            (Some(p), true) => Output::Slice(p),
            _ => Output::Raw(0),
        };
        let rows = (Output::Slice(lat_k), Output::Slice(lat_v));
        // SAFETY: slices of the sizes checked above; the partition sums reserved for n rows.
        unsafe { launch(&kernels, stream, &inputs, Input::Slice(x), n, rows, partial) }
    }

    /// Bytes of the partition sums a projection of `n` tokens takes (0: none, one launch).
    pub fn partial_bytes(&self, n: usize) -> usize {
        let g = &self.generated;
        if n == 0 || !g.launch(n, self.sm_count).split() {
            return 0;
        }
        4 * g.partitions as usize * n * 2 * g.rank
    }

    /// [`project`](Self::project) on an engine's memory: `x` `[n][d_model]`, `lat_k`, `lat_v`
    /// `[n][rank]` f16, `partial` [`partial_bytes`](Self::partial_bytes)`(n)` bytes (0 where that
    /// is 0), the down factors those of `weights`. No host synchronisation: capturable in a CUDA
    /// graph.
    ///
    /// # Safety
    /// Every address is device memory of `stream`'s context of those sizes, alive until the
    /// launches have run.
    pub unsafe fn project_raw(
        &self,
        stream: &Arc<CudaStream>,
        weights: &XQuantWeightInputs<'_>,
        (x, n): (u64, usize),
        (lat_k, lat_v): (u64, u64),
        partial: u64,
    ) -> Result<()> {
        self.check(weights)?;
        if n == 0 {
            return Ok(());
        }
        if self.partial_bytes(n) > 0 && partial == 0 {
            return Err(invalid(format!(
                "a projection of {n} tokens sums partitions: its partial buffer is NULL"
            )));
        }
        let rows = (Output::Raw(lat_k), Output::Raw(lat_v));
        // SAFETY: forwarded.
        unsafe {
            launch(
                &self.kernels(),
                stream,
                weights,
                Input::Raw(x),
                n,
                rows,
                Output::Raw(partial),
            )
        }
    }

    /// Refuses weights of another shape or without down factors of this projector's dtype.
    fn check(&self, weights: &XQuantWeightInputs<'_>) -> Result<()> {
        let g = &self.generated;
        let Some((_, _, dtype)) = weights.down else {
            return Err(invalid(
                "these XQuant weights were uploaded for the decode only (no down factors)".into(),
            ));
        };
        if dtype != g.dtype || weights.d_model != g.d_model as usize || weights.rank != g.rank {
            return Err(invalid(format!(
                "weights for {dtype} input, d_model {}, latents of {}; the projector is for {}, \
                 {}, {}",
                weights.d_model, weights.rank, g.dtype, g.d_model, g.rank
            )));
        }
        Ok(())
    }

    fn kernels(&self) -> Kernels<'_> {
        Kernels {
            generated: &self.generated,
            narrow: &self.narrow,
            wide: &self.wide,
            reduce: &self.reduce,
            sm_count: self.sm_count,
        }
    }
}

/// The projector's kernels, borrowed for one projection.
struct Kernels<'a> {
    generated: &'a XQuantProjectKernel,
    narrow: &'a CudaFunction,
    wide: &'a CudaFunction,
    reduce: &'a CudaFunction,
    sm_count: u32,
}

/// Enqueues the projection of `n` rows of `x` into `lat_k`, `lat_v`, through `partial` where the
/// launch splits.
///
/// # Safety
/// `x` holds `n` rows of d_model, the latent buffers at least `n` rows of rank, `partial`
/// the partition sums of `n` rows where the launch splits, the weights' down factors
/// `[2·rank][d_model]` in both halves.
unsafe fn launch(
    k: &Kernels<'_>,
    stream: &Arc<CudaStream>,
    weights: &XQuantWeightInputs<'_>,
    x: Input<'_, u16>,
    n: usize,
    (mut lat_k, mut lat_v): (Output<'_, u16>, Output<'_, u16>),
    partial: Output<'_, f32>,
) -> Result<()> {
    let g = k.generated;
    let Some((down_hi, down_lo, _)) = weights.down else {
        return Err(invalid("no down factors".into()));
    };
    let rows = i32::try_from(n).map_err(|_| invalid(format!("{n} rows")))?;
    let launch = g.launch(n, k.sm_count);
    let entry = g.entry(launch.tile);
    let function = if launch.tile == ProjectTile::WIDE {
        k.wide
    } else {
        k.narrow
    };
    let cfg = LaunchConfig {
        grid_dim: launch.grid,
        block_dim: (entry.block, 1, 1),
        shared_mem_bytes: entry.dynamic_shared_bytes,
    };
    let mut partial = partial;
    let mut args = Args::new(stream);
    args.input(x)
        .int(rows)
        .input(down_hi)
        .input(down_lo)
        .output(lat_k.reborrow())
        .output(lat_v.reborrow());
    if launch.split() {
        args.output(partial.reborrow());
    } else {
        args.null();
    }
    // SAFETY: the arguments follow the entry's params; the caller vouches for the sizes.
    unsafe { args.launch(function, cfg, false) }.map_err(launch_err(&entry.name))?;
    if !launch.split() {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (g.reduce_grid(n), 1, 1),
        block_dim: (g.reduce.block, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = Args::new(stream);
    args.input(partial.as_input())
        .int(rows)
        .output(lat_k)
        .output(lat_v);
    // SAFETY: the reduce's params; the split launch just wrote these n rows' sums.
    unsafe { args.launch(k.reduce, cfg, false) }.map_err(launch_err(&g.reduce.name))
}
