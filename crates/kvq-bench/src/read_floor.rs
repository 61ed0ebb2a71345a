//! The least time one kernel launch takes to read a given number of bytes on this GPU, in this
//! run: the floor a decode step is held against where its bytes are few.
//!
//! The copy figure is measured over gigabytes, so it leaves out what every launch pays whatever
//! it reads: the launch itself, the first round trip to memory, the ramp until every SM streams,
//! and the drain. At B=16 those are a few percent of a step; at B=1 L=32K a 2-bit step reads
//! about 19 MB, a few microseconds at the copy bandwidth, and the fixed part is as large as the
//! rest. A plain streaming read of the same bytes, launched and timed the same way (queued behind
//! the spin kernel, between CUDA events, rotating over as many copies as the step did), shows
//! what any single kernel could do there.

use std::sync::Arc;

use kvq::runtime::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use kvq::runtime::nvrtc::IncludeDirs;
use kvq::runtime::{CompileOptions, GpuTimer, Jit, RuntimeError, Source};

use crate::copy::fill_random;
use crate::error::Result;

const NAME: &str = "kvq_read_floor";

/// Header-free. Each thread keeps four 16-byte loads in flight (grid-stride, unrolled by hand so
/// that the loads issue before their uses), XORs what it read, and writes only if the sum hits a
/// constant, so the loads cannot be dropped and almost nothing is written. Its launch bound is
/// [`THREADS`], defined in front of it by [`read_floor_source`].
const SOURCE: &str = r#"// kvq bench: a streaming read of n 16-byte words, the floor of one launch.
extern "C" __global__ void __launch_bounds__(KVQ_READ_THREADS) kvq_read_floor(
    const uint4* __restrict__ src, unsigned long long n, unsigned* __restrict__ sink)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0u;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride);
        const uint4 c = __ldcs(src + i + 2 * stride), d = __ldcs(src + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const uint4 a = __ldcs(src + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x2545f491u) sink[blockIdx.x] = acc;
}
"#;

/// Threads of a read CTA and CTAs an SM: 64 warps an SM, the most an H100 holds.
const THREADS: u32 = 256;
const CTAS_PER_SM: u32 = 8;

/// Copies start at multiples of this many bytes.
const ALIGN: u64 = 256;

/// The read kernel's source, for callers that compile it themselves (and the tests).
pub fn read_floor_source() -> Source {
    Source::new(
        format!("{NAME}.cu"),
        format!("#define KVQ_READ_THREADS {THREADS}\n{SOURCE}"),
    )
}

/// The compiled read kernel and its grid.
pub struct ReadFloor {
    kernel: CudaFunction,
    ctas: u32,
}

impl ReadFloor {
    /// Compiles (or loads from the JIT's caches) the read kernel for `jit`'s GPU.
    pub fn new(jit: &Jit) -> Result<ReadFloor> {
        let options = CompileOptions::default().include_dirs(IncludeDirs::None);
        let kernel = jit.function(&read_floor_source(), NAME, &options)?;
        let ctas = jit.device().props().sm_count.max(1) * CTAS_PER_SM;
        Ok(ReadFloor { kernel, ctas })
    }

    /// Median µs of one launch reading `bytes` (rounded up to 16), rotating over `copies`
    /// separate copies as the step it is compared with did; `warmup` untimed launches first.
    pub fn median_us(
        &self,
        stream: &Arc<CudaStream>,
        timer: &GpuTimer,
        bytes: u64,
        copies: usize,
        warmup: usize,
        runs: usize,
    ) -> Result<f64> {
        let copies = copies.max(1);
        let words = bytes.div_ceil(16).max(1);
        let pitch = (words * 16).div_ceil(ALIGN) * ALIGN;
        let total = pitch as usize * copies;
        let driver = |what: &'static str| move |e| RuntimeError::driver(what, e);
        // SAFETY: fill_random writes every byte before any read.
        let mut src: CudaSlice<u8> =
            unsafe { stream.alloc(total) }.map_err(driver("allocate the read floor's copies"))?;
        fill_random(stream, &mut src)?;
        let mut sink: CudaSlice<u32> = stream
            .alloc_zeros(self.ctas as usize)
            .map_err(driver("allocate the read floor's sink"))?;
        let config = LaunchConfig {
            grid_dim: (self.ctas, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut next = 0usize;
        let timing = timer.time(stream, warmup, runs.max(1), |s| {
            let at = next * pitch as usize;
            next = (next + 1) % copies;
            let view = src.slice(at..at + pitch as usize);
            let mut b = s.launch_builder(&self.kernel);
            b.arg(&view).arg(&words).arg(&mut sink);
            // SAFETY: the kernel reads `words` 16-byte words of `view` (pitch ≥ 16·words) and
            // writes at most one u32 per CTA of `sink`, which holds one per CTA.
            unsafe { b.launch(config) }
                .map(drop)
                .map_err(|e| RuntimeError::launch(NAME, e))
        })?;
        Ok(timing.median_us())
    }
}
