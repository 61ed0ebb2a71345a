//! kvq's JIT layer: CUDA source → NVRTC → disk cache → module → kernel, plus GPU timing.
//!
//! kvq-codegen renders CUDA C++ specialised for a scheme and shape; this crate turns that text
//! into kernels the caller launches with cudarc. It knows nothing of schemes: kvq-runtime builds
//! the decode and cache launches, the paged cache and the tuner on top of it.
//!
//! ```text
//! Source (name, code, in-memory headers) + CompileOptions
//!   │  CompileOptions::resolve(arch): --std=c++17 --gpu-architecture=sm_90a [--use_fast_math]
//!   │  [--generate-line-info] [-D…] [--include-path=… from KVQ_CUDA_INCLUDE / CUDA_HOME / /usr/local/cuda]
//!   ▼
//! CacheKey = SHA-256(source, resolved options, arch, output kind, NVRTC version)
//!   │  Jit: loaded in this process already? ── yes ──▶ Module (no work)
//!   ▼  no
//! DiskCache ($KVQ_CACHE_DIR or ~/.cache/kvq, modules/<key>.cubin): valid entry? ── yes ─┐
//!   ▼  no (absent or corrupt)                                                            │
//! nvrtc::compile → PTX / CUBIN (needs libnvrtc, not a GPU) → written atomically to disk  │
//!   ▼ ◀───────────────────────────────────────────────────────────────────────────────────┘
//! Module::load (cuModuleLoadData on the Device's context) → Module::function(name) → CudaFunction
//! ```
//!
//! * [`device`]: [`Device::open`] and [`DeviceProps`] (name, compute capability, SMs, L2,
//!   memory, driver version); [`Arch`] (`sm_80`, `sm_90a`, …).
//! * [`nvrtc`]: compile to PTX or CUBIN for an explicit [`Arch`]; NVRTC version and targets.
//! * [`disk_cache`]: the compiled-module cache and its hit/miss counters.
//! * [`jit`] / [`module`]: [`Jit`] (per device, thread-safe, in-process cache) and [`Module`].
//! * [`timing`]: [`GpuTimer`], the one GPU timer (CUDA events, runs queued behind a spin kernel)
//!   and [`Timing`] (medians).
//! * [`launch`]: launches with programmatic dependent launch (`cuLaunchKernelEx`).
//! * [`version`]: [`DriverVersion`] and [`NvrtcVersion`].
//! * [`error`]: [`JitError`]; messages name what is missing and how to provide it.
//!
//! The modules form layers with no import circles: `version`, `arch`, `diagnostics`, `include`
//! and `launch` import nothing of this crate; `error` names their types; `libs` checks the
//! libraries; `device` and `nvrtc` sit on `libs`; `disk_cache` on `nvrtc`; `module` and `jit` on
//! those; `timing` on `jit`.
//!
//! cudarc loads `libcuda` and `libnvrtc` at run time and panics when one, or any entry point
//! it calls, is missing; this crate checks first ([`libs`]: the library, every entry point kvq
//! reaches, the versions) and returns [`JitError::DriverNotFound`] /
//! [`JitError::NvrtcNotFound`], [`JitError::LibraryIncomplete`],
//! [`JitError::DriverTooOld`] or [`JitError::NvrtcVersionMismatch`] instead, so
//! everything builds and runs on machines without CUDA or with a broken install.
//!
//! # Compiling without a GPU
//!
//! Compilation needs only libnvrtc. This example compiles a kernel for Hopper; on a machine
//! without NVRTC it shows the error a user gets instead.
//!
//! ```
//! use kvq_jit::nvrtc::{self, CompileOptions, Output, Source};
//! use kvq_jit::{Arch, JitError};
//!
//! let source = Source::new(
//!     "axpy.cu",
//!     r#"extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {
//!         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
//!         if (i < n) y[i] = a * x[i] + y[i];
//!     }"#,
//! );
//! match nvrtc::compile(&source, Arch::SM_90A, Output::Cubin, &CompileOptions::default()) {
//!     Ok(cubin) => println!("{} bytes of sm_90a code from NVRTC {}", cubin.image.len(), cubin.nvrtc),
//!     Err(e @ JitError::NvrtcNotFound { .. }) => println!("cannot compile here: {e}"),
//!     Err(e) => panic!("{e}"),
//! }
//! ```
//!
//! # Running a kernel
//!
//! ```no_run
//! use cudarc::driver::{LaunchConfig, PushKernelArg};
//! use kvq_jit::nvrtc::{CompileOptions, Source};
//! use kvq_jit::{Device, Jit, JitError};
//!
//! # fn main() -> Result<(), JitError> {
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
//! let n = 1000u32;
//! let mut out = stream
//!     .alloc_zeros::<f32>(n as usize)
//!     .map_err(|e| JitError::driver("alloc", e))?;
//! let mut launch = stream.launch_builder(&fill);
//! launch.arg(&mut out).arg(&1.5f32).arg(&n);
//! // SAFETY: the arguments match the kernel's signature and `out` holds n floats.
//! unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }
//!     .map_err(|e| JitError::launch("fill", e))?;
//! kvq_jit::device::synchronize_stream(&stream, "fill")?;
//! println!("{}", jit.stats()); // "compiled 1 module (0 cache hits)", or on a warm start "compiled 0 modules (1 cache hit)"
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod arch;
pub mod device;
pub mod diagnostics;
pub mod disk_cache;
pub mod error;
pub mod include;
pub mod jit;
pub mod launch;
pub mod libs;
pub mod module;
pub mod nvrtc;
pub mod timing;
pub mod version;

/// The cudarc this crate is built on (launch kernels and move data with it).
pub use cudarc;

pub use arch::{Arch, ArchVariant, InvalidArch};
pub use device::{device_count, driver_version, Device, DeviceProps};
pub use disk_cache::{cache_root, CacheKey, CacheStats, DiskCache, Origin};
pub use error::{CompileFailure, JitError, MissingHeader, Result};
pub use jit::{Jit, JitStats};
pub use module::Module;
pub use nvrtc::{CompileOptions, Compiled, Output, Source};
pub use timing::{GpuTimer, Timing};
pub use version::{DriverVersion, NvrtcVersion};
