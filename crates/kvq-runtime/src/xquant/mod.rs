//! XQuant (`source = x(latent)` and `x(cross_layer)`) on the GPU. The latents live in the integer
//! store of docs/LAYOUT.md as `R / W` heads of `W` channels (§10); the decode ([`XQuantKernel`])
//! rebuilds K from them per tile on tensor cores and never rebuilds V (docs/CODEBOOKS.md §3.1).
//!
//! - [`XQuantPagedCache`]: a cache written on the device from the layer input (projection on
//!   tensor cores, then the integer store's append, prefill and page quantizers); for XQuant-CL
//!   also from the accumulator the engine carries across layers.
//! - [`XQuantDeviceCache`]: caches the CPU reference built, uploaded (both sources; XQuant-CL's
//!   carry their accumulator's latents, which the decode adds to the stored deltas).
//! - [`XQuantWeights`]: a layer's projections on the device; [`XQuantProjector`]: the projection.
//! - [`XQuantSteps`]: the same kernels on an engine's memory (latent store, packed projections
//!   laid out by [`XQuantWeightsLayout`], workspace), for kvq's C ABI.
//!
//! ```no_run
//! # fn demo(jit: &kvq_runtime::Jit, cache: &kvq_reference::xquant::XQuantCache,
//! #         q: &cudarc::driver::CudaSlice<u16>, out: &mut cudarc::driver::CudaSlice<u16>)
//! #         -> kvq_runtime::Result<()> {
//! use kvq_codegen::{Dtype, KernelShape, RebuildPrecision};
//! use kvq_runtime::xquant::{XQuantDeviceCache, XQuantKernel, XQuantScratch};
//! let p = cache.projections();
//! let shape = KernelShape::new(p.head_dim as u32, 4, Dtype::F16);
//! let kernel = XQuantKernel::load(jit, cache.spec(), &shape, p.kv_heads, p.d_model(),
//!                                 RebuildPrecision::F32)?;
//! let stream = jit.device().default_stream();
//! let gpu = XQuantDeviceCache::upload(&stream, std::slice::from_ref(cache))?;
//! let mut scratch = XQuantScratch::new(&stream)?;
//! kernel.attend(&stream, &gpu, q, out, 4, &mut scratch)?;
//! # Ok(()) }
//! ```

mod cross_layer;
mod device_cache;
mod kernel;
mod paged;
mod project;
mod steps;
mod synth;
mod tune;
mod weights;

pub use device_cache::XQuantDeviceCache;
pub use kernel::XQuantKernel;
pub use paged::{XQuantCacheConfig, XQuantPagedCache};
pub use project::XQuantProjector;
pub use steps::{XQuantLimits, XQuantPtrs, XQuantSteps, XQuantWorkspace};
pub use synth::{random_latent_cache, synthetic_cache};
pub use tune::{
    check_xquant_problem, rebuild_text, xquant_cache_bytes, xquant_choice, xquant_problem_key,
    xquant_split_candidates, XQuantTuneReport, XQuantTuned, XQUANT_MAX_SPLITS,
};
pub use weights::{XQuantWeightInputs, XQuantWeights, XQuantWeightsLayout};

/// The split partials the XQuant decode writes and its combine reads.
pub type XQuantScratch = crate::split_scratch::SplitScratch;
