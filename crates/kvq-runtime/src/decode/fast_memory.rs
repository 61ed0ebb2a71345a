//! Whether a GPU's memory is fast for its SMs, which gives KIVI-4's kernels twelve warps an SM
//! (the fast-memory rule of [`kvq_codegen::rules`]).
//!
//! The block rules and the codegen default were measured on an H100 (25 GB/s an SM), where
//! KIVI-4's ring kernel runs best with eight warps an SM. An H200 has the same SMs and 36 GB/s an
//! SM: the same kernel reaches only 76% of its copy bandwidth there, and more warps an SM keep
//! more loads in flight (why twelve pay there and not on the H100 was not profiled).

use kvq_codegen::rules::{self, table::CONSTANTS, LaunchRules};
use kvq_codegen::KernelShape;
use kvq_spec::SchemeSpec;

/// Peak DRAM bandwidth a streaming multiprocessor (GB/s) from which memory counts as fast.
pub const FAST_MEMORY_GBPS_PER_SM: f64 = CONSTANTS.fast_memory_gbps_per_sm;

/// Whether a GPU of `peak_gbps` peak DRAM bandwidth over `sm_count` SMs counts as fast memory
/// ([`FAST_MEMORY_GBPS_PER_SM`]). A GPU that reports no memory clock (0 GB/s) does not.
///
/// ```
/// use kvq_runtime::decode::is_fast_memory;
/// assert!(!is_fast_memory(3352.0, 132)); // H100 SXM
/// assert!(is_fast_memory(4814.0, 132)); // H200
/// assert!(!is_fast_memory(2039.0, 114)); // H100 PCIe
/// ```
pub fn is_fast_memory(peak_gbps: f64, sm_count: usize) -> bool {
    rules::is_fast_memory(peak_gbps, sm_count)
}

/// Whether the fast-memory rule can change this scheme's launches at this kernel shape (KIVI-4's
/// family at head_dim 128, where it was measured).
pub fn fast_memory_applies(spec: &SchemeSpec, shape: &KernelShape) -> bool {
    let r = LaunchRules::for_kernel(spec, shape);
    std::iter::once(&r.default)
        .chain(r.rules.iter().map(|r| &r.block))
        .any(|b| !b.fast_memory.is_empty())
}
