//! Codebook schemes (CommVQ) on the GPU: the fused decode over a paged cache in the device layout
//! of `kvq_reference::commvq::device` ([`CodebookKernel`]), a batch's cache held in device memory
//! ([`CodebookCache`]), and the encoders that fill it from new keys and values
//! ([`CodebookEncoder`]), bit for bit what the CPU reference codes. For an engine's own memory:
//! the buffers' sizes ([`CodebookSizes`], with the one buffer of a layer's codebooks,
//! [`CodebookBufferLayout`]) and the same kernels on its pointers ([`CodebookSteps`]: prompts,
//! graph-capturable one-token appends, the decode), as kvq-capi serves them.
//!
//! ```no_run
//! # fn demo(jit: &kvq_runtime::Jit, spec: &kvq_spec::SchemeSpec,
//! #         cache: &kvq_reference::commvq::CommVqCache) -> kvq_runtime::Result<()> {
//! use kvq_codegen::{Dtype, KernelShape};
//! use kvq_runtime::codebook::{CodebookCache, CodebookKernel};
//! let kernel = CodebookKernel::load(jit, spec, &KernelShape::new(128, 4, Dtype::F16), cache.kv_heads())?;
//! let stream = jit.device().default_stream();
//! let gpu = CodebookCache::upload(&stream, kernel.layout(), std::slice::from_ref(cache), cache.rope().theta)?;
//! # Ok(()) }
//! ```

mod buffers;
mod cache;
mod decode;
mod encode;
mod steps;
mod tune;

pub use buffers::{CodebookBufferLayout, CodebookSizes, CODEBOOK_SECTIONS};
pub use cache::{CacheArrays, CodebookCache};
pub use decode::{CodebookKernel, CodebookScratch};
pub use encode::{input_words, status_error, CodebookEncoder, EncodeInputs};
pub use steps::{take_slot_errors, CodebookPtrs, CodebookSteps, StepInputs};
pub use tune::{codebook_problem_key, default_codebook_launch, CodebookLaunch, CodebookTuneReport};
