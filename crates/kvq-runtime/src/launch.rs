//! Launch helpers of this crate's kernels: kvq-jit's argument lists with programmatic dependent
//! launch ([`Args`]), and the shared-memory opt-in a generated entry point declares.

use cudarc::driver::CudaFunction;
use kvq_codegen::KernelEntry;

pub(crate) use kvq_jit::launch::{Args, Input, Output};

use crate::error::Result;

/// Lets `f` take the dynamic shared memory its generated `entry` declares
/// ([`kvq_jit::module::allow_dynamic_shared`]).
pub(crate) fn allow_dynamic_shared(f: &CudaFunction, entry: &KernelEntry) -> Result<()> {
    kvq_jit::module::allow_dynamic_shared(f, &entry.name, entry.dynamic_shared_bytes)?;
    Ok(())
}
