//! [`XQuantProjector`]: the cache writes' projection of new tokens' layer input to f16 latent rows
//! on tensor cores (`kernels/include/kvq/xquant/project.cuh`).

use super::weights::{invalid, XQuantWeights};
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{allow_dynamic_shared, launch_err, unit_source, Args};
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
        let g = &self.generated;
        let Some((down_hi, down_lo, dtype)) = &weights.down else {
            return Err(invalid(
                "these XQuant weights were uploaded for the decode only (no down factors)".into(),
            ));
        };
        if *dtype != g.dtype || weights.d_model != g.d_model as usize || weights.rank != g.rank {
            return Err(invalid(format!(
                "weights for {dtype} input, d_model {}, latents of {}; the projector is for {}, \
                 {}, {}",
                weights.d_model, weights.rank, g.dtype, g.d_model, g.rank
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let rows = i32::try_from(n).map_err(|_| invalid(format!("{n} rows")))?;
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
        let launch = g.launch(n, self.sm_count);
        let entry = g.entry(launch.tile);
        let function = if launch.tile == ProjectTile::WIDE {
            &self.wide
        } else {
            &self.narrow
        };
        let partial_len = g.partitions as usize * n * 2 * g.rank;
        if launch.split()
            && self
                .partial
                .as_ref()
                .map_or(true, |p| p.len() < partial_len)
        {
            let buf = stream
                .alloc_zeros::<f32>(partial_len)
                .map_err(|e| RuntimeError::driver("allocate the projection's partition sums", e))?;
            self.partial = Some(buf);
        }
        let cfg = LaunchConfig {
            grid_dim: launch.grid,
            block_dim: (entry.block, 1, 1),
            shared_mem_bytes: entry.dynamic_shared_bytes,
        };
        let mut args = Args::new(stream);
        args.buffer(x)
            .int(rows)
            .buffer(down_hi)
            .buffer(down_lo)
            .buffer_mut(lat_k)
            .buffer_mut(lat_v);
        match (&mut self.partial, launch.split()) {
            (Some(p), true) => args.buffer_mut(p),
            _ => args.null(),
        };
        // SAFETY: the arguments follow the entry's params; x holds n rows of d_model, the
        // latent buffers at least n rows of rank, down [2·rank][d_model] in both halves, and a
        // split launch's partition sums [partitions][n][2·rank].
        unsafe { args.launch(function, cfg, false) }.map_err(launch_err(&entry.name))?;
        let (true, Some(partial)) = (launch.split(), &self.partial) else {
            return Ok(());
        };
        let cfg = LaunchConfig {
            grid_dim: (g.reduce_grid(n), 1, 1),
            block_dim: (g.reduce.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = Args::new(stream);
        args.buffer(partial)
            .int(rows)
            .buffer_mut(lat_k)
            .buffer_mut(lat_v);
        // SAFETY: the reduce's params; the split launch just wrote these n rows' sums.
        unsafe { args.launch(&self.reduce, cfg, false) }.map_err(launch_err(&g.reduce.name))
    }
}
