//! The bandwidth ceiling of this GPU in this run: a device-to-device copy, counting the bytes it
//! reads and the bytes it writes.

use std::sync::Arc;

use kvq::runtime::cudarc::driver::{CudaSlice, CudaStream};
use kvq::runtime::{GpuTimer, RuntimeError};
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

/// Copies `bytes` (rounded up to 64 MiB) from one device buffer to another `runs` times (after
/// two warm-ups), timed with `timer`, and reports the median. The source holds a random pattern,
/// never zeros.
pub fn copy_bandwidth(
    stream: &Arc<CudaStream>,
    timer: &GpuTimer,
    bytes: u64,
    runs: usize,
) -> Result<CopyResult> {
    let total = (bytes as usize).div_ceil(PATTERN) * PATTERN;
    let driver = |what: &'static str| move |e| RuntimeError::driver(what, e);
    // SAFETY: fill_random writes every byte of `src` before it is read; `dst` is only written.
    let mut src: CudaSlice<u8> =
        unsafe { stream.alloc(total) }.map_err(driver("allocate the copy source"))?;
    let mut dst: CudaSlice<u8> =
        unsafe { stream.alloc(total) }.map_err(driver("allocate the copy destination"))?;
    fill_random(stream, &mut src)?;
    let timing = timer.time(stream, 2, runs.max(1), |s| {
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

/// Bytes of the random pattern [`fill_random`] repeats.
const PATTERN: usize = 64 << 20;

/// Fills `dst` with a random pattern (never zeros), repeated every 64 MiB.
pub fn fill_random(stream: &Arc<CudaStream>, dst: &mut CudaSlice<u8>) -> Result<()> {
    let driver = |what: &'static str| move |e| RuntimeError::driver(what, e);
    let len = dst.len();
    let pattern: Vec<u8> = {
        let mut rng = kvq::runtime::tune::synth::SynthRng::new(0x00C0_FFEE);
        (0..PATTERN.min(len))
            .map(|_| rng.next_u64() as u8)
            .collect()
    };
    let chunk = stream
        .clone_htod(&pattern)
        .map_err(driver("upload the random pattern"))?;
    for at in (0..len).step_by(PATTERN) {
        let n = PATTERN.min(len - at);
        stream
            .memcpy_dtod(&chunk.slice(..n), &mut dst.slice_mut(at..at + n))
            .map_err(driver("fill a buffer with the random pattern"))?;
    }
    Ok(())
}
