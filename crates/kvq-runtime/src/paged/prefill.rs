//! The prefill step's launches (prompts packed back to back into empty sequence slots), on a cache
//! kvq allocated ([`PagedKvCache`](super::PagedKvCache)) or one in an engine's memory
//! ([`CacheWriter`](super::CacheWriter)): each prompt's FP16 part (sink, tail ring, FP16 tensors'
//! pages) is copied, each quantized tensor's whole pages are quantized in one launch for the
//! whole batch, and each slot's length is set. Pages are named by page-table entry, so the caller
//! needs no physical page numbers on the host.

use std::sync::Arc;

use cudarc::driver::{result, CudaStream, LaunchConfig};
use kvq_reference::regions::TokenRegions;
use kvq_spec::{SchemeSpec, TensorQuant};

use super::kernels::{CacheFunctions, Loaded, Quantizers};
use crate::decode::CacheMut;
use crate::error::{Result, RuntimeError};
use crate::launch::{Args, Input, Output};

/// Most CTAs a grid's y extent takes.
const MAX_GRID_Y: usize = 65_535;

/// What a prefill reads and writes: the cache's buffers, the packed prompts, and a device list
/// the job lists are uploaded into.
pub(crate) struct PrefillArgs<'a> {
    pub cache: CacheMut<'a>,
    /// `[Σ tokens][kv_heads][head_dim]` in the cache's input dtype, prompt `i` after prompts `< i`.
    pub k: Input<'a, u16>,
    pub v: Input<'a, u16>,
    /// `(slot, tokens)` of each prompt, in packing order.
    pub prompts: &'a [(usize, usize)],
    /// Device list of at least [`max_job_values`] i32 for these prompts.
    pub jobs: Output<'a, i32>,
}

/// `(row in the packed input, page-table entry)` of every whole page of `tensor` that a packed
/// prefill of `prompts` (`(slot, tokens)`) quantizes; empty when the tensor is not quantized.
pub(crate) fn prefill_jobs(
    spec: &SchemeSpec,
    tensor: &TensorQuant,
    prompts: &[(usize, usize)],
    max_pages: usize,
) -> Result<Vec<i32>> {
    let mut jobs = Vec::new();
    if !tensor.is_quantized() {
        return Ok(jobs);
    }
    let int = |v: usize| {
        i32::try_from(v).map_err(|_| RuntimeError::InvalidInput(format!("prefill index {v}")))
    };
    let mut first = 0usize;
    for &(slot, tokens) in prompts {
        let r = TokenRegions::new(
            tokens,
            spec.sink as usize,
            spec.local_of(tensor) as usize,
            spec.page as usize,
        );
        for j in 0..r.pages {
            jobs.extend([
                int(first + r.page_tokens(j).start)?,
                int(slot * max_pages + j)?,
            ]);
        }
        first += tokens;
    }
    Ok(jobs)
}

/// Values the job list of a prefill of `prompts` needs (the larger tensor's).
pub(crate) fn max_job_values(
    spec: &SchemeSpec,
    prompts: &[(usize, usize)],
    max_pages: usize,
) -> Result<usize> {
    Ok(prefill_jobs(spec, &spec.k, prompts, max_pages)?
        .len()
        .max(prefill_jobs(spec, &spec.v, prompts, max_pages)?.len()))
}

fn launch_err(entry: &Loaded) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::launch(entry.entry.name.clone(), e)
}

/// Copies `list` into the device list `dst` (stream-ordered).
fn upload(stream: &Arc<CudaStream>, dst: &mut Output<'_, i32>, list: &[i32]) -> Result<()> {
    let (ptr, guard) = dst.device_ptr(stream);
    // SAFETY: the caller sized `dst` for the list (PrefillArgs::jobs); a copy from pageable host
    // memory is staged before the call returns, so `list` may go afterwards.
    unsafe { result::memcpy_htod_async(ptr, list, stream.cu_stream()) }
        .map_err(|e| RuntimeError::driver("upload prefill jobs", e))?;
    drop(guard);
    Ok(())
}

/// Enqueues the prefill.
///
/// # Safety
/// The buffers hold what [`PrefillArgs`] says; every prompt's slot is empty and its page-table row
/// maps every page the prompt fills.
pub(crate) unsafe fn launch_prefill(
    stream: &Arc<CudaStream>,
    kernels: &CacheFunctions,
    spec: &SchemeSpec,
    mut a: PrefillArgs<'_>,
) -> Result<()> {
    let int = |v: usize, what: &str| {
        i32::try_from(v).map_err(|_| RuntimeError::InvalidInput(format!("{v} {what}")))
    };
    let max_pages = int(a.cache.max_pages, "page-table columns")?;
    let h = a.cache.kv_heads as u32;
    let row = a.cache.kv_heads * a.cache.head_dim;
    let mut first = 0usize;
    for &(slot, tokens) in a.prompts {
        if tokens == 0 {
            continue;
        }
        let (slot_i, tokens_i) = (int(slot, "as a slot")?, int(tokens, "prompt tokens")?);
        let e = &kernels.prefill_copy;
        let (k_base, k_guard) = a.k.device_ptr(stream);
        let (v_base, v_guard) = a.v.device_ptr(stream);
        let at = (first * row * 2) as u64;
        let mut args = Args::new(stream);
        args.ptr(k_base + at)
            .ptr(v_base + at)
            .int(tokens_i)
            .int(slot_i)
            .output(a.cache.k_pool.reborrow())
            .output(a.cache.v_pool.reborrow())
            .input(a.cache.page_table)
            .int(max_pages)
            .output(a.cache.k_sink.reborrow())
            .output(a.cache.v_sink.reborrow())
            .output(a.cache.k_tail.reborrow())
            .output(a.cache.v_tail.reborrow());
        let cfg = LaunchConfig {
            grid_dim: (tokens as u32, h, 1),
            block_dim: (e.entry.block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments follow KernelEntry::params; the addresses are this prompt's rows.
        unsafe { args.launch(&e.f, cfg, false) }.map_err(launch_err(e))?;
        drop((k_guard, v_guard));
        first += tokens;
    }
    for (quantizers, tensor, pool, x) in [
        (kernels.k.as_ref(), &spec.k, &mut a.cache.k_pool, a.k),
        (kernels.v.as_ref(), &spec.v, &mut a.cache.v_pool, a.v),
    ] {
        let list = prefill_jobs(spec, tensor, a.prompts, a.cache.max_pages)?;
        if list.is_empty() {
            continue;
        }
        upload(stream, &mut a.jobs, &list)?;
        // SAFETY: the list names pages of the page table's rows of these prompts.
        unsafe {
            launch_from_input(
                stream,
                quantizers,
                pool.reborrow(),
                x,
                a.jobs.as_input(),
                a.cache.page_table,
                list.len() / 2,
                h,
            )?
        };
    }
    let (lens, guard) = a.cache.seq_lens.device_ptr(stream);
    for &(slot, tokens) in a.prompts {
        let tokens = [int(tokens, "prompt tokens")?];
        // SAFETY: `slot` is a slot of the cache, so its length is inside `seq_lens`; the copy
        // from pageable memory is staged before the call returns.
        unsafe { result::memcpy_htod_async(lens + 4 * slot as u64, &tokens, stream.cu_stream()) }
            .map_err(|e| RuntimeError::driver("write a sequence length", e))?;
    }
    drop(guard);
    Ok(())
}

/// Launches a tensor's prefill page quantizer over `pages` jobs of `jobs` (no-op for FP16
/// tensors): grid (kv_heads, jobs), in as many launches as the grid's y extent needs.
///
/// # Safety
/// `jobs` holds `pages` (input row, page-table entry) pairs whose rows lie in `x` and whose
/// entries map pages of `pool`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_from_input(
    stream: &Arc<CudaStream>,
    quantizers: Option<&Quantizers>,
    mut pool: Output<'_, u8>,
    x: Input<'_, u16>,
    jobs: Input<'_, i32>,
    page_table: Input<'_, i32>,
    pages: usize,
    kv_heads: u32,
) -> Result<()> {
    let Some(Quantizers { from_input: e, .. }) = quantizers else {
        return Ok(());
    };
    let (jobs_base, guard) = jobs.device_ptr(stream);
    for first in (0..pages).step_by(MAX_GRID_Y) {
        let count = (pages - first).min(MAX_GRID_Y);
        let mut args = Args::new(stream);
        args.input(x)
            .ptr(jobs_base + (2 * first * 4) as u64)
            .input(page_table)
            .output(pool.reborrow());
        let cfg = LaunchConfig {
            grid_dim: (kv_heads, count as u32, 1),
            block_dim: (e.entry.block, 1, 1),
            shared_mem_bytes: e.entry.dynamic_shared_bytes,
        };
        // SAFETY: arguments follow KernelEntry::params; the caller vouches for the jobs.
        unsafe { args.launch(&e.f, cfg, false) }.map_err(launch_err(e))?;
    }
    drop(guard);
    Ok(())
}
