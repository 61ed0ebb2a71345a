//! kvq's runtime: the decode and cache kernels of a scheme, launched; the paged KV cache; the
//! autotuner.
//!
//! kvq-codegen renders CUDA specialised for a scheme and shape; [`kvq_jit`] (re-exported here
//! module by module) compiles it with NVRTC, caches it on disk, loads it and times it; this crate
//! decides how to launch it and launches it:
//!
//! * [`decode`]: [`DecodeKernel`] (a scheme's fused decode kernels for one shape),
//!   [`DecodeScratch`], [`GpuCache`] / [`CacheView`] (caches uploaded in the reference layout).
//! * [`paged`]: [`PagedKvCache`], a paged cache with the GPU quantizers.
//! * [`codebook`]: codebook schemes (CommVQ): [`codebook::CodebookKernel`],
//!   [`codebook::CodebookCache`] (uploaded from the CPU reference, or filled on the GPU by
//!   [`codebook::CodebookEncoder`]).
//! * [`tune`]: the autotuner ([`Tuner`], `KVQ_TUNE`) and its JSON store of results per GPU.
//! * [`error`]: [`RuntimeError`], which wraps [`JitError`] (`RuntimeError::Jit`) and adds what
//!   only launches and the paged cache can get wrong.
//! * From kvq-jit: [`device`], [`arch`], [`nvrtc`], [`include`](mod@include), [`diagnostics`], [`disk_cache`],
//!   [`module`], [`jit`], [`libs`], [`timing`] ([`GpuTimer`], the one GPU timer) and [`version`].
//! * [`testing`]: what kvq's tests need of the machine (GPU, NVRTC, a C compiler), reported as a
//!   visible skip where it is missing; with the `testing` feature, `testing::harness` runs them.
//!
//! ```no_run
//! use kvq_runtime::nvrtc::{CompileOptions, Source};
//! use kvq_runtime::{Device, GpuTimer, Jit, RuntimeError};
//!
//! # fn main() -> Result<(), RuntimeError> {
//! let device = Device::open(0)?;
//! let jit = Jit::new(&device)?; // disk cache from KVQ_CACHE_DIR or ~/.cache/kvq
//! let source = Source::new(
//!     "fill.cu",
//!     r#"extern "C" __global__ void fill(float* out, float value, unsigned n) {
//!         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
//!         if (i < n) out[i] = value;
//!     }"#,
//! );
//! let fill = jit.function(&source, "fill", &CompileOptions::default())?;
//! let stream = device.default_stream();
//! let n = 1 << 26;
//! let mut out = stream
//!     .alloc_zeros::<f32>(n as usize)
//!     .map_err(|e| RuntimeError::driver("alloc", e))?;
//! let timer = GpuTimer::new(&jit)?;
//! let timing = timer.time(&stream, 3, 20, |s| {
//!     use cudarc::driver::{LaunchConfig, PushKernelArg};
//!     let mut launch = s.launch_builder(&fill);
//!     launch.arg(&mut out).arg(&1.5f32).arg(&n);
//!     // SAFETY: the arguments match the kernel's signature and `out` holds n floats.
//!     unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }
//!         .map_err(|e| RuntimeError::launch("fill", e))?;
//!     Ok::<(), RuntimeError>(())
//! })?;
//! println!("median {:.1} µs; {}", timing.median_us(), jit.stats());
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod codebook;
pub mod decode;
mod engine_copy;
pub mod error;
mod launch;
pub mod paged;
pub mod split_scratch;
#[doc(hidden)]
pub mod testing;
pub mod tune;
pub mod xquant;

/// The JIT layer under this crate, and its modules where this crate's users have always found
/// them (`kvq_runtime::nvrtc`, `kvq_runtime::device`, …).
pub use kvq_jit;
pub use kvq_jit::{
    arch, device, diagnostics, disk_cache, include, jit, libs, module, nvrtc, timing, version,
};

/// The cudarc this crate is built on (launch kernels and move data with it).
pub use kvq_jit::cudarc;

pub use arch::{Arch, ArchVariant, InvalidArch};
pub use decode::{
    default_pieces, default_splits, min_warp_tokens, CachePtrs, CacheView, DecodeKernel,
    DecodeOptions, DecodeScratch, GpuCache, LoadOptions, MergeKernel, Pieces,
};
pub use device::{device_count, driver_version, Device, DeviceProps, DriverVersion};
pub use disk_cache::{cache_root, CacheKey, CacheStats, DiskCache, Origin};
pub use engine_copy::copy_to_engine;
pub use error::{CompileFailure, JitError, MissingHeader, Result, RuntimeError};
pub use jit::{Jit, JitStats};
pub use module::Module;
pub use nvrtc::{CompileOptions, Compiled, NvrtcVersion, Output, Source};
pub use paged::{
    CacheConfig, CacheSizes, CacheWriter, MemoryReport, PagedKvCache, QuantizeTiming, SeqId,
    SequenceSnapshot,
};
pub use timing::{GpuTimer, Timing};
pub use tune::{TuneChoice, TunePolicy, TuneProblem, TuneStore, Tuner};
