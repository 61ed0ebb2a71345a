//! [`XQuantProjector`]: the cache writes' projection of new tokens' layer input to f16 latent rows
//! on tensor cores (`kernels/include/kvq/xquant/project.cuh`).

use super::weights::{invalid, XQuantWeights};
use crate::error::Result;
use crate::jit::Jit;
use crate::launch::{launch_err, unit_source, Args};
use crate::nvrtc::CompileOptions;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use kvq_codegen::{xquant_project_kernel, Dtype, XQuantProjectKernel};
use std::sync::Arc;

/// The projection kernel for one layer input dtype, `d_model` and latent width, compiled and
/// loaded.
pub struct XQuantProjector {
    generated: XQuantProjectKernel,
    function: CudaFunction,
}

impl XQuantProjector {
    /// Generates, compiles (through the JIT's caches) and loads the projection.
    pub fn load(jit: &Jit, dtype: Dtype, d_model: usize, rank: usize) -> Result<Self> {
        let d = u32::try_from(d_model).map_err(|_| invalid(format!("d_model {d_model}")))?;
        let generated = xquant_project_kernel(dtype, d, rank)?;
        let source = unit_source(&generated.entry.name, &generated.source);
        let function = jit
            .functions(
                &source,
                &[generated.entry.name.as_str()],
                &CompileOptions::default(),
            )?
            .into_iter()
            .next()
            .ok_or_else(|| invalid("kernel list shorter than requested".into()))?;
        Ok(Self {
            generated,
            function,
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
        &self,
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
        let (gx, gy) = g.grid(n);
        let cfg = LaunchConfig {
            grid_dim: (gx, gy, 1),
            block_dim: (g.entry.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = Args::new(stream);
        args.buffer(x)
            .int(rows)
            .buffer(down_hi)
            .buffer(down_lo)
            .buffer_mut(lat_k)
            .buffer_mut(lat_v);
        // SAFETY: the arguments follow the entry's params; x holds n rows of d_model, the
        // latent buffers at least n rows of rank, down [2·rank][d_model] in both halves.
        unsafe { args.launch(&self.function, cfg, false) }.map_err(launch_err(&g.entry.name))
    }
}
