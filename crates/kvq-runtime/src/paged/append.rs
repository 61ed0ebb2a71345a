//! The append step's launches (one new token for each listed sequence slot), on a cache kvq
//! allocated ([`PagedKvCache`](super::PagedKvCache)) or one in an engine's memory
//! ([`CacheWriter`](super::CacheWriter)): the append kernel writes the token into the FP16 regions, each quantized
//! tensor's ring quantizer packs the page the token completes, and the commit kernel adds the
//! token to the lengths. Every decision is made on the device from `seq_lens`, so the step has no
//! host synchronisation and the same launches every time (CUDA-graph capturable).

use std::sync::Arc;

use cudarc::driver::{CudaStream, LaunchConfig};

use super::kernels::{CacheFunctions, Loaded, Quantizers};
use crate::decode::CacheMut;
use crate::error::{Result, RuntimeError};
use crate::launch::{Args, Input};

/// What an append step reads and writes: the cache (module docs of [`layout`](crate::decode)),
/// the slot list and the new rows.
pub(crate) struct AppendArgs<'a> {
    pub cache: CacheMut<'a>,
    /// `[n]` sequence slots (−1: a padding row, skipped).
    pub slots: Input<'a, i32>,
    pub n: usize,
    /// `[n][stride][kv_heads][head_dim]` in the cache's input dtype: sequence `i`'s token at row
    /// `i·stride`.
    pub k_new: Input<'a, u16>,
    pub v_new: Input<'a, u16>,
    pub stride: usize,
}

fn launch_err(entry: &Loaded) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::launch(entry.entry.name.clone(), e)
}

/// Enqueues the append step.
///
/// # Safety
/// The buffers hold what [`AppendArgs`] says for its sizes; every listed slot's page-table row
/// maps the page its new token completes.
pub(crate) unsafe fn launch_append(
    stream: &Arc<CudaStream>,
    kernels: &CacheFunctions,
    mut a: AppendArgs<'_>,
) -> Result<()> {
    if a.n == 0 {
        return Ok(());
    }
    let too_big = |what: &str, v: usize| RuntimeError::InvalidInput(format!("{v} {what}"));
    let n = u32::try_from(a.n).map_err(|_| too_big("rows in an append", a.n))?;
    let n_i = n as i32;
    let stride =
        i32::try_from(a.stride).map_err(|_| too_big("rows between sequences", a.stride))?;
    let h = a.cache.kv_heads as u32;
    let max_pages = i32::try_from(a.cache.max_pages)
        .map_err(|_| too_big("page-table columns", a.cache.max_pages))?;
    let e = &kernels.append;
    let mut args = Args::new(stream);
    args.input(a.k_new)
        .input(a.v_new)
        .int(stride)
        .input(a.slots)
        .input(a.cache.seq_lens.as_input())
        .output(a.cache.k_pool.reborrow())
        .output(a.cache.v_pool.reborrow())
        .input(a.cache.page_table)
        .int(max_pages)
        .output(a.cache.k_sink.reborrow())
        .output(a.cache.v_sink.reborrow())
        .output(a.cache.k_tail.reborrow())
        .output(a.cache.v_tail.reborrow());
    let cfg = LaunchConfig {
        grid_dim: (n, h, 1),
        block_dim: (e.entry.block, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: arguments follow KernelEntry::params; the caller vouches for the buffers.
    unsafe { args.launch(&e.f, cfg, false) }.map_err(launch_err(e))?;
    for (quantizers, pool, tail) in [
        (kernels.k.as_ref(), &mut a.cache.k_pool, &a.cache.k_tail),
        (kernels.v.as_ref(), &mut a.cache.v_pool, &a.cache.v_tail),
    ] {
        let Some(Quantizers { from_ring: e, .. }) = quantizers else {
            continue;
        };
        let mut args = Args::new(stream);
        args.input(a.slots)
            .input(a.cache.seq_lens.as_input())
            .output(pool.reborrow())
            .input(a.cache.page_table)
            .int(max_pages)
            .input(tail.as_input());
        let cfg = LaunchConfig {
            grid_dim: (n, h, 1),
            block_dim: (e.entry.block, 1, 1),
            shared_mem_bytes: e.entry.dynamic_shared_bytes,
        };
        // SAFETY: as above.
        unsafe { args.launch(&e.f, cfg, false) }.map_err(launch_err(e))?;
    }
    let e = &kernels.commit;
    let mut args = Args::new(stream);
    args.input(a.slots)
        .int(n_i)
        .output(a.cache.seq_lens.reborrow());
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(128), 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above.
    unsafe { args.launch(&e.f, cfg, false) }.map_err(launch_err(e))
}
