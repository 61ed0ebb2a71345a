//! [`CrossLayerWrites`]: what an XQuant-CL cache adds to the writes of `x(latent)`
//! (`kernels/include/kvq/xquant/cross_layer.cuh`): the delta against the accumulator the engine
//! carries, the accumulator's latents kept per token (the decode adds them to the stored deltas),
//! and the next layer's accumulator through the layer's lift matrix.

use super::weights::invalid;
use crate::decode::upload;
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{launch_err, unit_source, Args, Output};
use crate::nvrtc::CompileOptions;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use kvq_codegen::{xquant_cross_layer_kernel, Dtype, XQuantCrossLayerKernel};
use kvq_reference::xquant::Projections;
use std::sync::Arc;

/// Where the accumulator's latent rows of a write's tokens go in the per-token rows
/// (`slot · max_tokens + position`).
pub(super) enum BaseRows {
    /// One row a token (an append across sequences).
    At(Vec<i32>),
    /// Consecutive rows from this one (a prefill).
    From(i32),
}

/// XQuant-CL's write kernels, the layer's lift matrix and the accumulator's latents of every
/// cached token.
pub(super) struct CrossLayerWrites {
    generated: XQuantCrossLayerKernel,
    delta_fn: CudaFunction,
    base_fn: CudaFunction,
    lift_fn: CudaFunction,
    reduce_fn: CudaFunction,
    sm_count: u32,
    /// A split lift's partition sums, grown as needed.
    partial: Option<CudaSlice<f32>>,
    /// `[2·rank][d_model]` f32: row j is the X-space delta of a unit latent j (K's, then V's).
    lift: CudaSlice<f32>,
    /// `X̂_{i−1}·down_k`, `X̂_{i−1}·down_v` of every token, f16 `[max_seqs][max_tokens][rank]`.
    pub(super) base_k: CudaSlice<u16>,
    pub(super) base_v: CudaSlice<u16>,
    pub(super) max_tokens: usize,
    /// The step's deltas `[n][d_model]` (exactly n rows: the projection's input).
    delta: Option<CudaSlice<u16>>,
    /// The accumulator's f16 latent rows of the step, `[≥ n][rank]` each.
    acc_rows: Option<(CudaSlice<u16>, CudaSlice<u16>)>,
}

impl CrossLayerWrites {
    /// Compiles (or loads) the kernels, uploads the lift matrix (`Projections::lift_matrix`, a
    /// solve on the host in the smaller of d_model and 2R) and allocates the per-token
    /// accumulator latents.
    pub(super) fn new(
        jit: &Jit,
        stream: &Arc<CudaStream>,
        projections: &Projections,
        dtype: Dtype,
        (max_seqs, max_tokens): (usize, usize),
    ) -> Result<Self> {
        let (d_model, rank) = (projections.d_model(), projections.k.rank);
        let d = u32::try_from(d_model).map_err(|_| invalid(format!("d_model {d_model}")))?;
        let generated = xquant_cross_layer_kernel(dtype, d, rank)?;
        let rows = max_seqs
            .checked_mul(max_tokens)
            .filter(|&r| i32::try_from(r).is_ok())
            .ok_or_else(|| {
                invalid(format!(
                    "{max_seqs} sequences of {max_tokens} tokens: the accumulator's rows are \
                     indexed in 32 bits"
                ))
            })?;
        let source = unit_source(&generated.lift.name, &generated.source);
        let names = [
            generated.delta.name.as_str(),
            generated.base.name.as_str(),
            generated.lift.name.as_str(),
            generated.lift_reduce.name.as_str(),
        ];
        let [delta_fn, base_fn, lift_fn, reduce_fn]: [CudaFunction; 4] = jit
            .functions(&source, &names, &CompileOptions::default())?
            .try_into()
            .map_err(|_| invalid("kernel list shorter than requested".into()))?;
        let lift = projections.lift_matrix()?;
        let alloc = |what: &str| {
            stream
                .alloc_zeros::<u16>((rows * rank).max(1))
                .map_err(|e| RuntimeError::driver(format!("allocate {what}"), e))
        };
        Ok(Self {
            lift: upload(stream, &lift, 0.0, "the lift matrix")?,
            base_k: alloc("the accumulator's K latents")?,
            base_v: alloc("the accumulator's V latents")?,
            max_tokens,
            generated,
            delta_fn,
            base_fn,
            lift_fn,
            reduce_fn,
            sm_count: jit.device().props().sm_count,
            partial: None,
            delta: None,
            acc_rows: None,
        })
    }

    /// Device bytes of the per-token accumulator latents and the lift matrix.
    pub(super) fn device_bytes(&self) -> usize {
        2 * (self.base_k.len() + self.base_v.len()) + 4 * self.lift.len()
    }

    /// Enqueues `δ = x − x_hat` (`[n][d_model]` each) and returns it.
    pub(super) fn delta(
        &mut self,
        stream: &Arc<CudaStream>,
        x: &CudaSlice<u16>,
        x_hat: &CudaSlice<u16>,
        n: usize,
    ) -> Result<&CudaSlice<u16>> {
        let len = n * self.generated.d_model as usize;
        if self.delta.as_ref().map_or(true, |b| b.len() != len) {
            let buf = stream
                .alloc_zeros::<u16>(len)
                .map_err(|e| RuntimeError::driver("allocate the deltas", e))?;
            self.delta = Some(buf);
        }
        let Some(delta) = self.delta.as_mut() else {
            return Err(invalid("no delta rows".into()));
        };
        let g = &self.generated;
        let mut args = Args::new(stream);
        args.buffer(x)
            .buffer(x_hat)
            .int(rows_i32(n)?)
            .buffer_mut(delta);
        let cfg = elementwise(len, g.delta.block);
        // SAFETY: the delta entry's params; x, x_hat checked by the caller to n rows, delta n rows.
        unsafe { args.launch(&self.delta_fn, cfg, false) }.map_err(launch_err(&g.delta.name))?;
        Ok(delta)
    }

    /// Row buffers for the accumulator's latents of `n` tokens (`[≥ n][rank]` f16 each).
    pub(super) fn acc_rows(
        &mut self,
        stream: &Arc<CudaStream>,
        n: usize,
    ) -> Result<&mut (CudaSlice<u16>, CudaSlice<u16>)> {
        let need = n * self.generated.rank;
        if self.acc_rows.as_ref().map_or(true, |(k, _)| k.len() < need) {
            let alloc = || {
                stream
                    .alloc_zeros::<u16>(need)
                    .map_err(|e| RuntimeError::driver("allocate the accumulator's latent rows", e))
            };
            self.acc_rows = Some((alloc()?, alloc()?));
        }
        self.acc_rows
            .as_mut()
            .ok_or_else(|| invalid("no accumulator rows".into()))
    }

    /// Enqueues the accumulator's latent rows (in [`acc_rows`](Self::acc_rows)) of `n` tokens
    /// into the per-token rows `rows`.
    pub(super) fn store_base(
        &mut self,
        stream: &Arc<CudaStream>,
        rows: &BaseRows,
        n: usize,
    ) -> Result<()> {
        let listed = match rows {
            BaseRows::At(list) => Some(
                stream
                    .clone_htod(list)
                    .map_err(|e| RuntimeError::driver("upload the accumulator's rows", e))?,
            ),
            BaseRows::From(_) => None,
        };
        let row0 = match rows {
            BaseRows::At(_) => 0,
            BaseRows::From(r) => *r,
        };
        let Some((k, v)) = self.acc_rows.as_ref() else {
            return Err(invalid(
                "the accumulator's latents were not projected".into(),
            ));
        };
        let g = &self.generated;
        let mut args = Args::new(stream);
        args.buffer(k).buffer(v);
        match &listed {
            Some(l) => args.buffer(l),
            None => args.null(),
        };
        args.int(row0)
            .int(rows_i32(n)?)
            .buffer_mut(&mut self.base_k)
            .buffer_mut(&mut self.base_v);
        let cfg = elementwise(n * g.rank, g.base.block);
        // SAFETY: the base entry's params; n rows of the accumulator's latents, every listed row
        // (or row0 + n) inside the per-token rows (the callers took them from the cache's book).
        unsafe { args.launch(&self.base_fn, cfg, false) }.map_err(launch_err(&g.base.name))
    }

    /// Enqueues `x_hat += [lat_k | lat_v] · lift` for `n` tokens, in place (through the
    /// partition sums and their reduce where the launch splits).
    pub(super) fn lift(
        &mut self,
        stream: &Arc<CudaStream>,
        x_hat: &mut CudaSlice<u16>,
        (lat_k, lat_v): (&CudaSlice<u16>, &CudaSlice<u16>),
        n: usize,
    ) -> Result<()> {
        let g = &self.generated;
        let partial_len = g.lift_partial_bytes(n, self.sm_count) / 4;
        reserve_sums(
            stream,
            &mut self.partial,
            partial_len,
            "the lift's partition sums",
        )?;
        let rows = rows_i32(n)?;
        // Read and written in place: one pointer in both parameters, its stream-order guard held
        // across the launches.
        let mut x_hat = Output::Slice(x_hat);
        let (x_in, _guard) = x_hat.device_ptr(stream);
        let mut args = Args::new(stream);
        args.ptr(x_in)
            .buffer(lat_k)
            .buffer(lat_v)
            .buffer(&self.lift)
            .int(rows)
            .ptr(x_in);
        let grid = g.lift_grid(n, self.sm_count);
        let split = match (&mut self.partial, partial_len > 0) {
            (Some(p), true) => {
                args.buffer_mut(p);
                true
            }
            _ => {
                args.null();
                false
            }
        };
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (g.lift.block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the lift entry's params; x_hat n rows of d_model (read and written in place,
        // each value by one thread), the latents n rows of rank, lift [2·rank][d_model], the
        // partition sums sized for this grid where it splits.
        unsafe { args.launch(&self.lift_fn, cfg, false) }.map_err(launch_err(&g.lift.name))?;
        let (true, Some(partial)) = (split, self.partial.as_ref()) else {
            return Ok(());
        };
        let mut args = Args::new(stream);
        args.ptr(x_in).buffer(partial).int(rows).ptr(x_in);
        let cfg = elementwise_exact(n * g.d_model as usize, g.lift_reduce.block);
        // SAFETY: the reduce's params; the split lift just wrote these n rows' sums.
        unsafe { args.launch(&self.reduce_fn, cfg, false) }.map_err(launch_err(&g.lift_reduce.name))
    }
}

/// Grows `buf` to at least `len` f32 values (none needed: 0), reused across calls.
pub(super) fn reserve_sums(
    stream: &Arc<CudaStream>,
    buf: &mut Option<CudaSlice<f32>>,
    len: usize,
    what: &str,
) -> Result<()> {
    if len > 0 && buf.as_ref().map_or(true, |b| b.len() < len) {
        let grown = stream
            .alloc_zeros::<f32>(len)
            .map_err(|e| RuntimeError::driver(format!("allocate {what}"), e))?;
        *buf = Some(grown);
    }
    Ok(())
}

fn rows_i32(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| invalid(format!("{n} rows")))
}

/// One thread a value (the reduce does not stride).
fn elementwise_exact(elements: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (elements.div_ceil(block as usize).max(1) as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn elementwise(elements: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (XQuantCrossLayerKernel::elementwise_grid(elements), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}
