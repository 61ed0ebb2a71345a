//! What an XQuant-CL cache adds to the writes of `x(latent)`
//! (`kernels/include/kvq/xquant/cross_layer.cuh`): the delta against the accumulator the engine
//! carries, the accumulator's latents kept per token (the decode adds them to the stored deltas),
//! and the next layer's accumulator through the layer's lift matrix.
//!
//! [`CrossLayerKernels`] launches them on any memory (kvq's allocations or an engine's);
//! [`CrossLayerWrites`] adds the buffers [`super::XQuantPagedCache`] owns.

use super::weights::invalid;
use crate::decode::upload;
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{launch_err, unit_source, Args, Input, Output};
use crate::nvrtc::CompileOptions;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use kvq_codegen::{xquant_cross_layer_kernel, Dtype, XQuantCrossLayerKernel};
use kvq_reference::xquant::Projections;
use std::sync::Arc;

/// Where the accumulator's latent rows of a write's tokens go among the per-token rows
/// (`slot · rows_a_slot + position`).
pub(super) enum BaseRows<'a> {
    /// An append: token i at the next position of slot `slots[i]` (−1: padding, skipped), read
    /// from `seq_lens` before the store's append counts the token.
    Append {
        slots: Input<'a, i32>,
        seq_lens: Input<'a, i32>,
    },
    /// A prefill: consecutive rows from this one.
    From(usize),
}

/// [`BaseRows`] as [`CrossLayerWrites`] takes them: an append's slots on the host (it uploads
/// them), the store's `seq_lens`.
pub(super) enum NewRows<'a> {
    Append {
        slots: &'a [i32],
        seq_lens: &'a CudaSlice<i32>,
    },
    From(usize),
}

/// XQuant-CL's write kernels for one layer input dtype, `d_model` and latent width, loaded.
pub(super) struct CrossLayerKernels {
    generated: XQuantCrossLayerKernel,
    delta_fn: CudaFunction,
    base_fn: CudaFunction,
    lift_fn: CudaFunction,
    reduce_fn: CudaFunction,
    sm_count: u32,
}

impl CrossLayerKernels {
    /// Generates, compiles (through the JIT's caches) and loads the kernels.
    pub(super) fn load(jit: &Jit, dtype: Dtype, d_model: usize, rank: usize) -> Result<Self> {
        let d = u32::try_from(d_model).map_err(|_| invalid(format!("d_model {d_model}")))?;
        let generated = xquant_cross_layer_kernel(dtype, d, rank)?;
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
        Ok(Self {
            generated,
            delta_fn,
            base_fn,
            lift_fn,
            reduce_fn,
            sm_count: jit.device().props().sm_count,
        })
    }

    /// Bytes of the partition sums a lift of `n` tokens takes (0: none).
    pub(super) fn lift_partial_bytes(&self, n: usize) -> usize {
        self.generated.lift_partial_bytes(n, self.sm_count)
    }

    /// Enqueues `delta = x − x_hat` for `n` rows of d_model.
    ///
    /// # Safety
    /// Each buffer holds `n` rows of d_model values in the kernels' dtype, alive until the launch
    /// has run.
    pub(super) unsafe fn delta(
        &self,
        stream: &Arc<CudaStream>,
        (x, x_hat): (Input<'_, u16>, Input<'_, u16>),
        n: usize,
        delta: Output<'_, u16>,
    ) -> Result<()> {
        let g = &self.generated;
        let mut args = Args::new(stream);
        args.input(x).input(x_hat).int(rows_i32(n)?).output(delta);
        let cfg = elementwise(n * g.d_model as usize, g.delta.block);
        // SAFETY: the delta entry's params; the caller vouches for the rows.
        unsafe { args.launch(&self.delta_fn, cfg, false) }.map_err(launch_err(&g.delta.name))
    }

    /// Enqueues the copy of `n` tokens' accumulator latent rows (`lat`: `[n][rank]` f16 each)
    /// into the per-token rows `base` (`rows_a_slot` rows a slot) at `rows`.
    ///
    /// # Safety
    /// `lat` holds `n` rows; every row `rows` names lies inside `base` (an append's slots are −1
    /// or below the slots `base` holds, `seq_lens` theirs); all alive until the launch has run.
    pub(super) unsafe fn store_base(
        &self,
        stream: &Arc<CudaStream>,
        (lat_k, lat_v): (Input<'_, u16>, Input<'_, u16>),
        rows: BaseRows<'_>,
        (rows_a_slot, n): (usize, usize),
        (base_k, base_v): (Output<'_, u16>, Output<'_, u16>),
    ) -> Result<()> {
        let g = &self.generated;
        let per_slot = i32::try_from(rows_a_slot)
            .map_err(|_| invalid(format!("{rows_a_slot} accumulator rows a slot")))?;
        let mut args = Args::new(stream);
        args.input(lat_k).input(lat_v);
        let row0 = match rows {
            BaseRows::Append { slots, seq_lens } => {
                args.input(slots).input(seq_lens);
                0
            }
            BaseRows::From(row0) => {
                args.null().null();
                i32::try_from(row0).map_err(|_| invalid(format!("accumulator row {row0}")))?
            }
        };
        args.int(per_slot)
            .int(row0)
            .int(rows_i32(n)?)
            .output(base_k)
            .output(base_v);
        let cfg = elementwise(n * g.rank, g.base.block);
        // SAFETY: the base entry's params; the caller vouches for the rows.
        unsafe { args.launch(&self.base_fn, cfg, false) }.map_err(launch_err(&g.base.name))
    }

    /// Enqueues `x_hat += [lat_k | lat_v] · lift` for `n` tokens, in place (through `partial`
    /// and the reduce where the launch splits).
    ///
    /// # Safety
    /// `x_hat` holds `n` rows of d_model, the latents `n` rows of rank, `lift`
    /// `[2·rank][d_model]` f32, `partial` [`lift_partial_bytes`](Self::lift_partial_bytes)`(n)`
    /// bytes where that is not 0; all alive until the launches have run.
    pub(super) unsafe fn lift(
        &self,
        stream: &Arc<CudaStream>,
        mut x_hat: Output<'_, u16>,
        (lat_k, lat_v): (Input<'_, u16>, Input<'_, u16>),
        lift: Input<'_, f32>,
        n: usize,
        mut partial: Output<'_, f32>,
    ) -> Result<()> {
        let g = &self.generated;
        let rows = rows_i32(n)?;
        let split = self.lift_partial_bytes(n) > 0;
        if split && matches!(partial, Output::Raw(0)) {
            return Err(invalid(format!(
                "a lift of {n} tokens sums partitions: its partial buffer is NULL"
            )));
        }
        // Read and written in place: one pointer in both parameters, its stream-order guard held
        // across the launches.
        let (x_in, _guard) = x_hat.device_ptr(stream);
        let mut args = Args::new(stream);
        args.ptr(x_in)
            .input(lat_k)
            .input(lat_v)
            .input(lift)
            .int(rows)
            .ptr(x_in);
        if split {
            args.output(partial.reborrow());
        } else {
            args.null();
        }
        let cfg = LaunchConfig {
            grid_dim: g.lift_grid(n, self.sm_count),
            block_dim: (g.lift.block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the lift entry's params; each x_hat value is read and written by one thread;
        // the caller vouches for the sizes.
        unsafe { args.launch(&self.lift_fn, cfg, false) }.map_err(launch_err(&g.lift.name))?;
        if !split {
            return Ok(());
        }
        let mut args = Args::new(stream);
        args.ptr(x_in).input(partial.as_input()).int(rows).ptr(x_in);
        let cfg = elementwise_exact(n * g.d_model as usize, g.lift_reduce.block);
        // SAFETY: the reduce's params; the split lift just wrote these n rows' sums.
        unsafe { args.launch(&self.reduce_fn, cfg, false) }.map_err(launch_err(&g.lift_reduce.name))
    }
}

/// XQuant-CL's write kernels with the buffers a [`super::XQuantPagedCache`] owns: the layer's
/// lift matrix, the accumulator's latents of every cached token and the steps' scratch.
pub(super) struct CrossLayerWrites {
    kernels: CrossLayerKernels,
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
    /// An append's slots, `[≥ n]` i32.
    slots: Option<CudaSlice<i32>>,
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
        let kernels = CrossLayerKernels::load(jit, dtype, d_model, rank)?;
        let rows = max_seqs
            .checked_mul(max_tokens)
            .filter(|&r| i32::try_from(r).is_ok())
            .ok_or_else(|| {
                invalid(format!(
                    "{max_seqs} sequences of {max_tokens} tokens: the accumulator's rows are \
                     indexed in 32 bits"
                ))
            })?;
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
            kernels,
            partial: None,
            delta: None,
            acc_rows: None,
            slots: None,
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
        let len = n * self.kernels.generated.d_model as usize;
        if self.delta.as_ref().map_or(true, |b| b.len() != len) {
            let buf = stream
                .alloc_zeros::<u16>(len)
                .map_err(|e| RuntimeError::driver("allocate the deltas", e))?;
            self.delta = Some(buf);
        }
        let Some(delta) = self.delta.as_mut() else {
            return Err(invalid("no delta rows".into()));
        };
        // SAFETY: x, x_hat checked by the caller to n rows, delta allocated to n rows.
        unsafe {
            self.kernels.delta(
                stream,
                (Input::Slice(x), Input::Slice(x_hat)),
                n,
                Output::Slice(delta),
            )
        }?;
        Ok(delta)
    }

    /// Row buffers for the accumulator's latents of `n` tokens (`[≥ n][rank]` f16 each).
    pub(super) fn acc_rows(
        &mut self,
        stream: &Arc<CudaStream>,
        n: usize,
    ) -> Result<&mut (CudaSlice<u16>, CudaSlice<u16>)> {
        let need = n * self.kernels.generated.rank;
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
    /// into the per-token rows: an append's (`slots`, its tokens' next positions read from the
    /// store's `seq_lens` before its append counts them) or a prefill's from `row0`.
    pub(super) fn store_base(
        &mut self,
        stream: &Arc<CudaStream>,
        rows: NewRows<'_>,
        n: usize,
    ) -> Result<()> {
        let rows = match rows {
            NewRows::Append { slots, seq_lens } => {
                if self.slots.as_ref().map_or(true, |s| s.len() < slots.len()) {
                    let buf = stream
                        .alloc_zeros::<i32>(slots.len().max(1))
                        .map_err(|e| RuntimeError::driver("allocate the append's slots", e))?;
                    self.slots = Some(buf);
                }
                let Some(buf) = self.slots.as_mut() else {
                    return Err(invalid("no slot list".into()));
                };
                stream
                    .memcpy_htod(slots, &mut buf.slice_mut(..slots.len()))
                    .map_err(|e| RuntimeError::driver("upload the append's slots", e))?;
                BaseRows::Append {
                    slots: Input::Slice(buf),
                    seq_lens: Input::Slice(seq_lens),
                }
            }
            NewRows::From(row0) => BaseRows::From(row0),
        };
        let Some((k, v)) = self.acc_rows.as_ref() else {
            return Err(invalid(
                "the accumulator's latents were not projected".into(),
            ));
        };
        // SAFETY: n rows of the accumulator's latents; every slot is the cache's and its
        // position is checked by the kernel against max_tokens (a prefill's rows were taken
        // from the cache's book by the caller).
        unsafe {
            self.kernels.store_base(
                stream,
                (Input::Slice(k), Input::Slice(v)),
                rows,
                (self.max_tokens, n),
                (
                    Output::Slice(&mut self.base_k),
                    Output::Slice(&mut self.base_v),
                ),
            )
        }
    }

    /// Enqueues `x_hat += [lat_k | lat_v] · lift` for `n` tokens, in place.
    pub(super) fn lift(
        &mut self,
        stream: &Arc<CudaStream>,
        x_hat: &mut CudaSlice<u16>,
        (lat_k, lat_v): (&CudaSlice<u16>, &CudaSlice<u16>),
        n: usize,
    ) -> Result<()> {
        let partial_len = self.kernels.lift_partial_bytes(n) / 4;
        reserve_sums(
            stream,
            &mut self.partial,
            partial_len,
            "the lift's partition sums",
        )?;
        let partial = match (&mut self.partial, partial_len > 0) {
            (Some(p), true) => Output::Slice(p),
            _ => Output::Raw(0),
        };
        // SAFETY: x_hat checked by the caller to n rows, the latents at least n rows, the lift
        // matrix [2·rank][d_model], the partition sums reserved for n rows.
        unsafe {
            self.kernels.lift(
                stream,
                Output::Slice(x_hat),
                (Input::Slice(lat_k), Input::Slice(lat_v)),
                Input::Slice(&self.lift),
                n,
                partial,
            )
        }
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
