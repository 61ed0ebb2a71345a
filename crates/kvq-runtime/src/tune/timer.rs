//! GPU-side timing of short launches: the timed runs are queued behind a kernel that spins for a
//! while, so they execute back to back on the device and the events measure the kernels, not how
//! fast the host can enqueue them (three launches with a dozen arguments each can take longer to
//! submit than a 2-bit decode of a long sequence takes to run).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::device::synchronize_stream;
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::nvrtc::{CompileOptions, IncludeDirs, Source};
use crate::timing::{time_gpu, Timing};

const SPIN_NAME: &str = "kvq_tune_spin";

/// Header-free: waits on the nanosecond global timer.
const SPIN_SOURCE: &str = r#"// kvq tuner: holds the stream while timed work is queued behind it.
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

/// The spin kernel's source, for callers that want to compile it themselves.
pub fn spin_source() -> Source {
    Source::new(format!("{SPIN_NAME}.cu"), SPIN_SOURCE)
}

/// How long to hold the stream so that `runs` runs, each taking `per_run` to enqueue on the host,
/// are all queued before the first starts: three times the estimate, within 200 µs..250 ms.
pub fn spin_duration(per_run: Duration, runs: usize) -> Duration {
    let estimate =
        per_run.saturating_mul(3 * runs as u32 + 3) + Duration::from_micros(20 * runs as u64);
    estimate.clamp(MIN_SPIN, MAX_SPIN)
}

/// Times device work queued behind a spin kernel; see the module docs.
pub struct QueuedTimer {
    spin: CudaFunction,
}

impl QueuedTimer {
    /// Compiles (or loads from the JIT's caches) the spin kernel.
    pub fn new(jit: &Jit) -> Result<QueuedTimer> {
        let options = CompileOptions::default().include_dirs(IncludeDirs::None);
        let spin = jit.function(&spin_source(), SPIN_NAME, &options)?;
        Ok(QueuedTimer { spin })
    }

    /// Holds `stream` for `hold`.
    pub fn spin(&self, stream: &Arc<CudaStream>, hold: Duration) -> Result<()> {
        let ns = hold.as_nanos().min(u64::MAX as u128) as u64;
        let mut b = stream.launch_builder(&self.spin);
        b.arg(&ns);
        // SAFETY: the kernel takes one u64 by value and touches no memory.
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }
            .map_err(|e| RuntimeError::launch(SPIN_NAME, e))?;
        Ok(())
    }

    /// Runs `work` `warmup` times (untimed; measures how long one run takes to enqueue), then
    /// queues `runs` runs between event pairs behind a spin long enough to cover their
    /// submission, and returns each run's device time. `work` must only enqueue on `stream`.
    pub fn time<F>(
        &self,
        stream: &Arc<CudaStream>,
        warmup: usize,
        runs: usize,
        mut work: F,
    ) -> Result<Timing>
    where
        F: FnMut(&Arc<CudaStream>) -> Result<()>,
    {
        let started = Instant::now();
        for _ in 0..warmup {
            work(stream)?;
        }
        let per_run = if warmup == 0 {
            Duration::from_micros(50)
        } else {
            started.elapsed() / warmup as u32
        };
        synchronize_stream(stream, "warm-up runs")?;
        self.spin(stream, spin_duration(per_run, runs))?;
        time_gpu(stream, 0, runs, work)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spin_covers_submission_within_bounds() {
        assert_eq!(spin_duration(Duration::ZERO, 1), MIN_SPIN);
        let d = spin_duration(Duration::from_micros(30), 30);
        assert!(d >= Duration::from_micros(30 * 30 * 3), "{d:?}");
        assert_eq!(spin_duration(Duration::from_millis(50), 100), MAX_SPIN);
    }

    #[test]
    fn spin_kernel_compiles_when_nvrtc_is_present() {
        use crate::nvrtc::{compile, Output};
        use crate::Arch;
        let Some(_) = crate::testing::require_nvrtc("spin_kernel_compiles_when_nvrtc_is_present")
        else {
            return;
        };
        let options = CompileOptions::default().include_dirs(IncludeDirs::None);
        let cubin = compile(&spin_source(), Arch::SM_90A, Output::Cubin, &options).unwrap();
        assert!(!cubin.image.is_empty());
    }
}
