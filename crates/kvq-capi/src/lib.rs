//! kvq's C ABI, for engines that own their memory, page tables and streams (C, C++, or any
//! language with a C FFI). `include/kvq.h` is generated from this crate by cbindgen; a test fails
//! when the committed header differs from what the sources generate.
//!
//! A **plan** is a scheme (a built-in's name or scheme text) and a shape with its limits, checked
//! once, which says exactly which device buffers the engine allocates and how large each is.
//! Making a plan needs no GPU. A scheme without a GPU kernel, or a shape the fast kernels do not
//! serve, is refused with a status and a message, never served by a slow kernel.
//!
//! The calls then run on the engine's stream and memory (docs/ENGINE.md): `kvq_prefill` (prompts
//! into empty sequence slots), `kvq_append` (a new token a sequence), `kvq_attend` (one query
//! token a sequence: output and LSE) and `kvq_merge` (partial results of context parallelism).
//! Sequences live in *slots* (rows of the per-sequence buffers and of the block table); each
//! step names its rows' slots in device memory, so batches change without moving state, and
//! `kvq_append`/`kvq_attend` are CUDA-graph capturable. `kvq_plan_load` compiles every kernel
//! ahead of time.
//!
//! Conventions: every call returns a [`KvqStatus`]; on failure
//! [`kvq_last_error_message`] holds the calling thread's message. No call unwinds or aborts: a
//! panic inside kvq becomes [`KvqStatus::Internal`]. Plans are immutable and may be shared
//! between threads.
//!
//! The same plan from Rust:
//!
//! ```
//! use kvq_capi::{KvqPlan, KvqPlanLimits, KVQ_DTYPE_F16};
//!
//! let limits = KvqPlanLimits {
//!     head_dim: 128,
//!     q_heads: 32,
//!     kv_heads: 8,
//!     dtype: KVQ_DTYPE_F16,
//!     max_seqs: 16,
//!     max_seq_len: 32768,
//!     pool_pages: 16 * 256,
//!     max_q_len: 1,
//!     rope_theta: 0.0,
//!     d_model: 0,
//! };
//! let plan = KvqPlan::new("kivi2", &limits).unwrap();
//! let info = plan.info();
//! assert_eq!(info.page_tokens, 128);
//! // KIVI-2 stores a 128-token page of 8 KV heads of 128 channels in about a quarter of FP16.
//! assert!(info.page_bytes < 2 * 128 * 8 * 128 * 2 / 4 + 2 * 128 * 8 * 8);
//! ```

mod codebooks;
mod gpu;
mod merge;
mod plan;
mod status;
mod steps;
mod xquant;

pub use codebooks::{kvq_cache_check, kvq_codebooks_load, kvq_codebooks_load_bytes};
pub use gpu::{
    codebook_plan_kernels, gpu, kvq_plan_load, kvq_plan_workspace_bytes, plan_kernels,
    CodebookPlanKernels, Gpu, PlanKernels,
};
/// The element types a plan's kernels take (`KvqPlan::dtype`).
pub use kvq::codegen::Dtype;
pub use merge::kvq_merge;
pub use plan::{
    builtin_schemes, kvq_plan_buffer, kvq_plan_buffer_count, kvq_plan_create, kvq_plan_destroy,
    kvq_plan_info, kvq_plan_scheme, KvqBuffer, KvqPlan, KvqPlanInfo, KvqPlanLimits, XQuantSizes,
    KVQ_BUFFER_ALIGNMENT, KVQ_DTYPE_BF16, KVQ_DTYPE_F16,
};
pub use status::{call, kvq_last_error_message, kvq_status_name, Failure, KvqStatus};
pub use steps::{
    kvq_append, kvq_append_prerope, kvq_attend, kvq_prefill, kvq_prefill_prerope, KvqCache,
};
pub use xquant::{
    kvq_xquant_append, kvq_xquant_append_cross_layer, kvq_xquant_prefill,
    kvq_xquant_prefill_cross_layer, kvq_xquant_weights_load, kvq_xquant_weights_load_bytes,
};

/// kvq's version, e.g. `"0.1.0"` (static storage).
#[no_mangle]
pub extern "C" fn kvq_version() -> *const std::ffi::c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
