//! [`copy_to_engine`]: host bytes kvq packed (a layer's codebooks, XQuant's projections) into a
//! buffer an engine allocated, in its stream's order.

use crate::error::{Result, RuntimeError};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// Copies `bytes` to the device address `dst`, ordered on `stream` (the host bytes are staged
/// before the call returns, so the caller may drop them); `what` names the data in an error.
///
/// # Safety
/// `dst` is device memory of `stream`'s context of at least `bytes.len()` bytes.
pub unsafe fn copy_to_engine(
    stream: &Arc<CudaStream>,
    dst: u64,
    bytes: &[u8],
    what: &str,
) -> Result<()> {
    unsafe { cudarc::driver::result::memcpy_htod_async(dst, bytes, stream.cu_stream()) }
        .map_err(|e| RuntimeError::driver(format!("copy {what} to the device"), e))
}
