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

/// A generated unit as NVRTC compiles it: its source, named `<entry>.cu`, with kvq's kernel headers
/// in memory (the unit includes them; nothing is read from disk).
pub(crate) fn unit_source(entry: &str, code: &str) -> crate::nvrtc::Source {
    kvq_codegen::kernel_headers().iter().fold(
        crate::nvrtc::Source::new(format!("{entry}.cu"), code),
        |s, (name, text)| s.with_header(*name, *text),
    )
}

/// A failed launch of `name`, as a [`RuntimeError`](crate::RuntimeError).
pub(crate) fn launch_err(
    name: &str,
) -> impl Fn(cudarc::driver::DriverError) -> crate::RuntimeError + '_ {
    move |e| crate::RuntimeError::launch(name, e)
}
