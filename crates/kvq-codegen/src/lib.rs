//! Scheme + kernel shape + tuning parameters in, CUDA C++ source and launch metadata out.
//!
//! No I/O and no GPU: everything here runs (and is tested) on a CPU. The kernels' algorithms are
//! CUDA headers in the workspace's `kernels/include/kvq/` ([`KERNEL_HEADERS`]); templates in
//! `templates/` render thin units that include them. Both are embedded at compile time. A unit
//! compiles with [`KERNEL_HEADERS`] as its only headers (no CUDA toolkit header: its own half/bf16
//! conversions through PTX), so the driver and libnvrtc suffice.
//!
//! ```
//! use kvq_codegen::{decode_kernels, Dtype, KernelShape, TuneParams};
//! let spec = kvq_spec::SchemeSpec::parse("k = int(2, channel), v = int(2, token), local = 128").unwrap();
//! let shape = KernelShape::new(128, 4, Dtype::F16);
//! let kernels = decode_kernels(&spec, &shape, &TuneParams::default_for(&spec, &shape)).unwrap();
//! assert!(kernels.source.contains(&kernels.decode.name));
//! ```

mod cache;
mod codebook;
mod context;
mod decode;
mod error;
mod head_groups;
mod headers;
mod merge;
mod quantizer;
pub mod rules;
mod shape;
mod templates;
mod tune;
mod xquant;
mod xquant_cross_layer;
mod xquant_project;

pub use cache::{cache_kernels, cache_kernels_with, CacheKernels, PageQuantizers};
pub use codebook::{
    codebook_candidates, codebook_encode_kernels, codebook_kernels, codebook_kernels_with,
    has_codebook_kernel, CodebookEncodeKernels, CodebookKernels, CodebookParams,
    CodebookStepKernels, CODEBOOK_SMEM_THREADS, CODEBOOK_SMEM_TILE, CODEBOOK_STATUS_WORDS,
    CODEBOOK_THREADS, CODEBOOK_TILE, ENCODE_TOKENS, ENCODE_WARPS, STORE_THREADS,
};
pub use decode::{
    decode_groups, decode_head_groups, decode_kernels, decode_piece_rule, decode_runs_pieces,
    decode_slow_path, has_decode_kernel, rule_head_dim, short_staging_changes,
    store_scores_changes, DecodeKernels, KernelEntry, PieceRule, SlowPath, GENERIC_MAX_GQA,
    MAX_GQA,
};
pub use error::CodegenError;
pub use head_groups::{HeadGroups, MMA_HEAD_COLUMNS};
pub use headers::{kernel_headers, KERNEL_HEADERS};
pub use merge::{merge_kernel, MergeKernel, MERGE_THREADS};
pub use quantizer::{QuantizerForm, QuantizerForms};
pub use shape::{Dtype, KernelShape};
pub use tune::TuneParams;
pub use xquant::{
    has_xquant_kernel, latent_spec, rebuild_k_order, xquant_kernels, xquant_rank, xquant_tile,
    RebuildMma, RebuildPrecision, XQuantKernels, XQUANT_THREADS,
};
pub use xquant_cross_layer::{xquant_cross_layer_kernel, XQuantCrossLayerKernel};
pub use xquant_project::{xquant_project_kernel, ProjectTile, XQuantProjectKernel};
