//! The bandwidth ceiling of this GPU in this run: a device-to-device copy, counting the bytes it
//! reads and the bytes it writes.

use std::sync::Arc;

use kvq::runtime::cudarc::driver::{CudaSlice, CudaStream};
use kvq::runtime::{time_gpu, RuntimeError};
use serde::{Deserialize, Serialize};

use crate::error::Result;

/// A measured copy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CopyResult {
    /// Bytes copied per run (read once and written once).
    pub bytes: u64,
    /// Median time of one copy, µs.
    pub median_us: f64,
    /// `2 × bytes / median`, GB/s (10⁹ bytes).
    pub gbps: f64,
}

/// Copies `bytes` from one device buffer to another `runs` times (after two warm-ups) and
/// reports the median. The source holds a random pattern, never zeros.
pub fn copy_bandwidth(stream: &Arc<CudaStream>, bytes: u64, runs: usize) -> Result<CopyResult> {
    const CHUNK: usize = 64 << 20;
    let total = (bytes as usize).div_ceil(CHUNK) * CHUNK;
    let driver = |what: &'static str| move |e| RuntimeError::driver(what, e);
    let pattern: Vec<u8> = {
        let mut rng = kvq::runtime::tune::synth::SynthRng::new(0x00C0_FFEE);
        (0..CHUNK).map(|_| rng.next_u64() as u8).collect()
    };
    let chunk = stream
        .clone_htod(&pattern)
        .map_err(driver("upload the copy pattern"))?;
    // SAFETY: every byte of `src` is written by the copies below before it is read; `dst` is
    // only written.
    let mut src: CudaSlice<u8> =
        unsafe { stream.alloc(total) }.map_err(driver("allocate the copy source"))?;
    let mut dst: CudaSlice<u8> =
        unsafe { stream.alloc(total) }.map_err(driver("allocate the copy destination"))?;
    for at in (0..total).step_by(CHUNK) {
        stream
            .memcpy_dtod(&chunk, &mut src.slice_mut(at..at + CHUNK))
            .map_err(driver("fill the copy source"))?;
    }
    let timing = time_gpu(stream, 2, runs.max(1), |s| {
        s.memcpy_dtod(&src, &mut dst)
            .map_err(|e| RuntimeError::driver("device-to-device copy", e))
    })?;
    let median_us = timing.median_us();
    Ok(CopyResult {
        bytes: total as u64,
        median_us,
        gbps: 2.0 * total as f64 / (median_us * 1e-6) / 1e9,
    })
}
