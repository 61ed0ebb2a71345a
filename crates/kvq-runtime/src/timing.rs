//! GPU timing with CUDA events, for benchmarks and the autotuner.
//!
//! [`time_gpu`] runs the work a few times untimed (warm-up), then `runs` times, each between a
//! pair of events recorded on the stream, with no host synchronisation in between; it then
//! waits once and reads every pair. Events are created with `CU_EVENT_DEFAULT`: cudarc's
//! `new_event(None)` makes `CU_EVENT_DISABLE_TIMING` events, which cannot be timed.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use serde::{Deserialize, Serialize};

use crate::error::{Result, RuntimeError};

/// Times of the individual runs, in microseconds, in run order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// One entry per timed run.
    pub samples_us: Vec<f64>,
}

impl Timing {
    fn sorted(&self) -> Vec<f64> {
        let mut s = self.samples_us.clone();
        s.sort_by(f64::total_cmp);
        s
    }

    /// The median (mean of the middle two for an even count); 0 when empty.
    pub fn median_us(&self) -> f64 {
        let s = self.sorted();
        match s.len() {
            0 => 0.0,
            n if n % 2 == 1 => s[n / 2],
            n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
        }
    }

    /// The fastest run.
    pub fn min_us(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(0.0)
    }

    /// The slowest run.
    pub fn max_us(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(0.0)
    }

    /// The mean.
    pub fn mean_us(&self) -> f64 {
        if self.samples_us.is_empty() {
            0.0
        } else {
            self.samples_us.iter().sum::<f64>() / self.samples_us.len() as f64
        }
    }
}

/// A timing-capable event (`CU_EVENT_DEFAULT`) in `stream`'s context.
pub fn timing_event(stream: &Arc<CudaStream>) -> Result<CudaEvent> {
    stream
        .context()
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| RuntimeError::driver("cuEventCreate(CU_EVENT_DEFAULT)", e))
}

/// Milliseconds between two recorded events, after waiting for `end`.
pub fn elapsed_ms(start: &CudaEvent, end: &CudaEvent) -> Result<f32> {
    // cudarc's CUDA 13 bindings call cuEventElapsedTime_v2 (drivers from CUDA 12.8 on) and panic
    // on a driver without it; the driver check covers it (`libs::DRIVER_ENTRY_POINTS`).
    crate::libs::ensure_driver()?;
    start
        .elapsed_ms(end)
        .map_err(|e| RuntimeError::async_failure("the timed work", e))
}

/// Runs `work` `warmup` times, then `runs` times between timing events on `stream`; returns
/// each run's time. `work` must only enqueue on `stream` (no host synchronisation), so that runs
/// are timed back to back.
pub fn time_gpu<F>(
    stream: &Arc<CudaStream>,
    warmup: usize,
    runs: usize,
    mut work: F,
) -> Result<Timing>
where
    F: FnMut(&Arc<CudaStream>) -> Result<()>,
{
    if runs == 0 {
        return Err(RuntimeError::InvalidInput(
            "time_gpu needs at least one timed run".into(),
        ));
    }
    for _ in 0..warmup {
        work(stream)?;
    }
    let mut pairs = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = timing_event(stream)?;
        let end = timing_event(stream)?;
        start
            .record(stream)
            .map_err(|e| RuntimeError::driver("cuEventRecord", e))?;
        work(stream)?;
        end.record(stream)
            .map_err(|e| RuntimeError::driver("cuEventRecord", e))?;
        pairs.push((start, end));
    }
    let samples_us = pairs
        .iter()
        .map(|(s, e)| elapsed_ms(s, e).map(|ms| ms as f64 * 1e3))
        .collect::<Result<Vec<_>>>()?;
    Ok(Timing { samples_us })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics() {
        let t = Timing {
            samples_us: vec![5.0, 1.0, 3.0, 100.0],
        };
        assert_eq!(t.median_us(), 4.0);
        assert_eq!(t.min_us(), 1.0);
        assert_eq!(t.max_us(), 100.0);
        assert_eq!(t.mean_us(), 27.25);
        let t = Timing {
            samples_us: vec![2.0, 9.0, 1.0],
        };
        assert_eq!(t.median_us(), 2.0);
        assert_eq!(Timing { samples_us: vec![] }.median_us(), 0.0);
    }
}
