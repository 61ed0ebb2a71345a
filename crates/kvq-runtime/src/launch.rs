//! Programmatic dependent launch (compute capability 9.0 on): a kernel launched this way may be
//! scheduled while the kernel before it in the stream is still running, and waits for that
//! kernel's results in its own code (`griddepcontrol.wait`). The decode step uses it for the
//! combine kernel, whose launch and prologue then hide behind the decode grid's last CTAs.
//!
//! cudarc's launch builder takes no launch attributes, so this goes through `cuLaunchKernelEx`.

use std::ffi::c_void;
use std::ptr;
use std::sync::OnceLock;

use cudarc::driver::{sys, CudaFunction, CudaStream, DriverError, LaunchConfig};

/// Whether the loaded driver has `cuLaunchKernelEx` (CUDA 12.0 on). cudarc resolves driver
/// functions when first called and panics on a missing one, so callers ask first.
pub(crate) fn driver_has_launch_ex() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: only looks the symbol up; the driver library is loaded (a kernel was loaded
        // through it before anything asks this).
        unsafe {
            sys::is_culib_present()
                && sys::culib()
                    .get::<unsafe extern "C" fn()>(b"cuLaunchKernelEx\0")
                    .is_ok()
        }
    })
}

/// Launches `func` on `stream` allowed to overlap the previous kernel of the stream.
///
/// # Safety
/// `params` holds one pointer per kernel parameter, in order, each to a value of that parameter's
/// type that lives through the call. Before reading anything the previous kernel writes, every
/// CTA of `func` must execute `griddepcontrol.wait` (which returns once that kernel has finished
/// and its writes are visible).
pub(crate) unsafe fn launch_overlapping_previous(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    params: &mut [*mut c_void],
) -> Result<(), DriverError> {
    stream.context().bind_to_thread()?;
    // SAFETY: an all-zero attribute value is valid (a union of plain integers and structs of them).
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attribute = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attribute,
        numAttrs: 1,
    };
    // SAFETY: the configuration and attribute live through the call; the caller vouches for
    // `params` and the kernel's wait.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            params.as_mut_ptr(),
            ptr::null_mut(),
        )
    }
    .result()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asking_for_launch_ex_never_panics() {
        // Without a driver library (CI) the answer is no; with one, whatever it has.
        // SAFETY: only checks whether the library loads.
        if !unsafe { sys::is_culib_present() } {
            assert!(!driver_has_launch_ex());
        } else {
            let _ = driver_has_launch_ex();
        }
    }
}
