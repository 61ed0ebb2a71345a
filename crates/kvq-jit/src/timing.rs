//! kvq's one GPU timer: CUDA events around each run, medians of the runs, and (by default) the
//! timed runs queued behind a kernel that holds the stream.
//!
//! [`GpuTimer::time`] runs the work a few times untimed (warm-up), waits for it, then enqueues
//! `runs` runs, each between a pair of events recorded on the stream, with no host
//! synchronisation in between; it then waits once and reads every pair. A timer made with
//! [`GpuTimer::new`] first launches a spin kernel that holds the stream long enough for all the
//! runs to be submitted, so they execute back to back on the device and the events measure the
//! kernels, not how fast the host can enqueue them (three launches with a dozen arguments each
//! can take longer to submit than a 2-bit decode of a long sequence takes to run). The autotuner,
//! `kvq bench`, `kvq demo` and the criterion benches all time this way, so their numbers agree.
//! [`GpuTimer::back_to_back`] skips the hold, for work that runs far longer than it takes to
//! submit (a copy of gigabytes) where no JIT is at hand.
//!
//! Events are created with `CU_EVENT_DEFAULT`: cudarc's `new_event(None)` makes
//! `CU_EVENT_DISABLE_TIMING` events, which cannot be timed. Rotating the inputs so that they do
//! not sit in L2 is the caller's part (the runtime's `tune::rotate`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use serde::{Deserialize, Serialize};

use crate::device::synchronize_stream;
use crate::error::{JitError, Result};
use crate::jit::Jit;
use crate::nvrtc::{CompileOptions, IncludeDirs, Source};

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

const SPIN_NAME: &str = "kvq_tune_spin";

/// Header-free: waits on the nanosecond global timer.
const SPIN_SOURCE: &str = r#"// kvq timer: holds the stream while timed work is queued behind it.
extern "C" __global__ void kvq_tune_spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"#;

/// Shortest and longest hold of the spin kernel.
const MIN_SPIN: Duration = Duration::from_micros(200);
const MAX_SPIN: Duration = Duration::from_millis(250);

/// Submission time assumed for one run when no warm-up run measured it.
const UNMEASURED_RUN: Duration = Duration::from_micros(50);

/// The spin kernel's source, for callers that compile it themselves (and the tests).
pub fn spin_source() -> Source {
    Source::new(format!("{SPIN_NAME}.cu"), SPIN_SOURCE)
}

/// How long to hold the stream so that `runs` runs, each taking `per_run` to enqueue on the host,
/// are all queued before the first starts: three times the estimate plus 20 µs a run, within
/// 200 µs..250 ms.
pub fn spin_duration(per_run: Duration, runs: usize) -> Duration {
    let runs32 = u32::try_from(runs).unwrap_or(u32::MAX);
    let estimate = per_run.saturating_mul(runs32.saturating_mul(3).saturating_add(3))
        + Duration::from_micros(20).saturating_mul(runs32);
    estimate.clamp(MIN_SPIN, MAX_SPIN)
}

/// A timing-capable event (`CU_EVENT_DEFAULT`) in `stream`'s context.
fn timing_event(stream: &Arc<CudaStream>) -> Result<CudaEvent> {
    stream
        .context()
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| JitError::driver("cuEventCreate(CU_EVENT_DEFAULT)", e))
}

fn record(event: &CudaEvent, stream: &Arc<CudaStream>) -> Result<()> {
    event
        .record(stream)
        .map_err(|e| JitError::driver("cuEventRecord", e))
}

/// Milliseconds between two recorded events, after waiting for `end`.
fn elapsed_ms(start: &CudaEvent, end: &CudaEvent) -> Result<f32> {
    // cudarc's CUDA 13 bindings call cuEventElapsedTime_v2 (drivers from CUDA 12.8 on) and panic
    // on a driver without it; the driver check covers it (`libs::DRIVER_ENTRY_POINTS`).
    crate::libs::ensure_driver()?;
    start
        .elapsed_ms(end)
        .map_err(|e| JitError::async_failure("the timed work", e))
}

/// Times device work with CUDA events; see the module docs. Cheap to share: it holds only the
/// spin kernel.
pub struct GpuTimer {
    spin: Option<CudaFunction>,
}

impl std::fmt::Debug for GpuTimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTimer")
            .field("queued", &self.spin.is_some())
            .finish()
    }
}

impl GpuTimer {
    /// A timer that queues the timed runs behind the spin kernel, compiled (or loaded from the
    /// JIT's caches) for `jit`'s GPU.
    pub fn new(jit: &Jit) -> Result<GpuTimer> {
        let options = CompileOptions::default().include_dirs(IncludeDirs::None);
        let spin = jit.function(&spin_source(), SPIN_NAME, &options)?;
        Ok(GpuTimer { spin: Some(spin) })
    }

    /// A timer that enqueues the timed runs as they come, without the hold: only for work that
    /// takes far longer to run than to submit (large copies), where the host keeps ahead anyway.
    pub fn back_to_back() -> GpuTimer {
        GpuTimer { spin: None }
    }

    /// Whether timed runs are queued behind the spin kernel.
    pub fn is_queued(&self) -> bool {
        self.spin.is_some()
    }

    /// Holds `stream` for `hold` with the spin kernel (nothing for a back-to-back timer).
    fn hold(&self, stream: &Arc<CudaStream>, hold: Duration) -> Result<()> {
        let Some(spin) = &self.spin else {
            return Ok(());
        };
        let ns = u64::try_from(hold.as_nanos()).unwrap_or(u64::MAX);
        let mut b = stream.launch_builder(spin);
        b.arg(&ns);
        // SAFETY: the kernel takes one u64 by value and touches no memory.
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }
            .map_err(|e| JitError::launch(SPIN_NAME, e))?;
        Ok(())
    }

    /// Runs `work` `warmup` times untimed (which also measures how long one run takes to
    /// enqueue), waits for them, then enqueues `runs` runs between event pairs (behind a hold
    /// long enough to cover their submission) and returns each run's device time. `work` must
    /// only enqueue on `stream`: no host synchronisation.
    pub fn time<F, E>(
        &self,
        stream: &Arc<CudaStream>,
        warmup: usize,
        runs: usize,
        mut work: F,
    ) -> Result<Timing, E>
    where
        F: FnMut(&Arc<CudaStream>) -> Result<(), E>,
        E: From<JitError>,
    {
        if runs == 0 {
            return Err(
                JitError::InvalidInput("a timing needs at least one timed run".into()).into(),
            );
        }
        let started = Instant::now();
        for _ in 0..warmup {
            work(stream)?;
        }
        let per_run = match u32::try_from(warmup) {
            Ok(n) if n > 0 => started.elapsed() / n,
            _ => UNMEASURED_RUN,
        };
        synchronize_stream(stream, "warm-up runs")?;
        self.hold(stream, spin_duration(per_run, runs))?;
        let mut pairs = Vec::with_capacity(runs);
        for _ in 0..runs {
            let (start, end) = (timing_event(stream)?, timing_event(stream)?);
            record(&start, stream)?;
            work(stream)?;
            record(&end, stream)?;
            pairs.push((start, end));
        }
        let samples_us = pairs
            .iter()
            .map(|(s, e)| elapsed_ms(s, e).map(|ms| f64::from(ms) * 1e3))
            .collect::<Result<Vec<_>>>()?;
        Ok(Timing { samples_us })
    }

    /// The device time of `iters` runs of `work` between one pair of events, behind a hold as in
    /// [`GpuTimer::time`] (no warm-up): what a harness that times a batch of iterations itself,
    /// such as criterion's `iter_custom`, needs.
    pub fn total<F, E>(
        &self,
        stream: &Arc<CudaStream>,
        iters: u64,
        mut work: F,
    ) -> Result<Duration, E>
    where
        F: FnMut(&Arc<CudaStream>) -> Result<(), E>,
        E: From<JitError>,
    {
        let (start, end) = (timing_event(stream)?, timing_event(stream)?);
        let runs = usize::try_from(iters).unwrap_or(usize::MAX);
        self.hold(stream, spin_duration(Duration::ZERO, runs))?;
        record(&start, stream)?;
        for _ in 0..iters {
            work(stream)?;
        }
        record(&end, stream)?;
        let ms = elapsed_ms(&start, &end)?;
        Ok(Duration::from_secs_f64(f64::from(ms) * 1e-3))
    }
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

    #[test]
    fn spin_covers_submission_within_bounds() {
        assert_eq!(spin_duration(Duration::ZERO, 1), MIN_SPIN);
        let d = spin_duration(Duration::from_micros(30), 30);
        assert!(d >= Duration::from_micros(30 * 30 * 3), "{d:?}");
        assert_eq!(spin_duration(Duration::from_millis(50), 100), MAX_SPIN);
        assert_eq!(spin_duration(Duration::from_secs(1), usize::MAX), MAX_SPIN);
        // Twenty microseconds a run when the submission time is unknown.
        assert_eq!(
            spin_duration(Duration::ZERO, 1000),
            Duration::from_micros(20_000)
        );
    }
}
