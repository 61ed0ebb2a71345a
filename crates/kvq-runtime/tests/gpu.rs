//! On a GPU: compile, load and launch through the JIT, with outputs poisoned before each launch
//! and checked after; the in-process and disk caches; typed launch and lookup errors; event
//! timing. Runs under its own harness: without a GPU (or NVRTC) each test shows as ignored, with the
//! reason; KVQ_REQUIRE_GPU=1 makes that a failure.

mod gated;

use std::sync::Arc;

use kvq_runtime::cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use kvq_runtime::nvrtc::{CompileOptions, IncludeDirs, Source};
use kvq_runtime::{Device, DiskCache, GpuTimer, Jit, JitError, Origin, Output, RuntimeError};

/// Every test of this file, by name.
const TESTS: &[(&str, fn())] = &[
    (
        "jit_compiles_loads_and_launches_with_poisoned_outputs",
        jit_compiles_loads_and_launches_with_poisoned_outputs,
    ),
    (
        "concurrent_requests_compile_once",
        concurrent_requests_compile_once,
    ),
    (
        "event_timing_measures_a_copy_bound_kernel",
        event_timing_measures_a_copy_bound_kernel,
    ),
    ("device_errors_are_typed", device_errors_are_typed),
];

fn main() {
    gated::run_gpu_tests(TESTS)
}

const KERNELS: &str = r#"// kvq-runtime GPU test kernels (header-free)
extern "C" __global__ void fill(float* out, float value, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}

extern "C" __global__ void axpy(float a, const float* __restrict__ x, float* __restrict__ y,
                                unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

fn options() -> CompileOptions {
    CompileOptions::default().include_dirs(IncludeDirs::None)
}

fn temp_cache(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvq-gpu-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn upload(stream: &Arc<CudaStream>, host: &[f32]) -> CudaSlice<f32> {
    stream.clone_htod(host).expect("upload")
}

fn download(stream: &Arc<CudaStream>, dev: &CudaSlice<f32>) -> Vec<f32> {
    stream.clone_dtoh(dev).expect("download")
}

fn launch_fill(
    stream: &Arc<CudaStream>,
    fill: &kvq_runtime::cudarc::driver::CudaFunction,
    out: &mut CudaSlice<f32>,
    value: f32,
    n: u32,
    block: u32,
) -> Result<(), RuntimeError> {
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(block), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(fill);
    launch.arg(out).arg(&value).arg(&n);
    // SAFETY: arguments match `fill(float*, float, unsigned)`; `out` holds at least n floats.
    unsafe { launch.launch(cfg) }
        .map(|_| ())
        .map_err(|e| RuntimeError::launch("fill", e))
}

fn jit_compiles_loads_and_launches_with_poisoned_outputs() {
    let device = Device::open(0).expect("GPU");
    println!("{}", device.props());
    assert_eq!(
        device.arch(),
        kvq_runtime::Arch::for_compute_capability(
            device.props().compute_capability.0,
            device.props().compute_capability.1,
        )
    );
    let dir = temp_cache("launch");
    let jit = Jit::with_disk_cache(&device, Some(DiskCache::open(&dir).unwrap()));
    let source = Source::new("kernels.cu", KERNELS);
    let f = jit
        .functions(&source, &["fill", "axpy"], &options())
        .unwrap();
    let (fill, axpy) = (&f[0], &f[1]);
    assert_eq!(jit.stats().compiled, 1);

    let stream = device.default_stream();
    let n: u32 = 100_003; // odd: exercises the bounds check of the last block
    let poison = vec![f32::NAN; n as usize + 1];

    // fill n-1 of n+1 elements: the tail must stay poisoned.
    let mut y = upload(&stream, &poison);
    launch_fill(&stream, fill, &mut y, 2.0, n - 1, 256).unwrap();
    kvq_runtime::device::synchronize_stream(&stream, "fill").unwrap();
    let host = download(&stream, &y);
    assert!(host[..n as usize - 1].iter().all(|&v| v == 2.0));
    assert!(host[n as usize - 1].is_nan() && host[n as usize].is_nan());

    // y = 3 x + 2 over poisoned y.
    let x_host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let x = upload(&stream, &x_host);
    let mut y = upload(&stream, &poison);
    launch_fill(&stream, fill, &mut y, 2.0, n, 128).unwrap();
    let mut launch = stream.launch_builder(axpy);
    launch.arg(&3.0f32).arg(&x).arg(&mut y).arg(&n);
    // SAFETY: arguments match `axpy(float, const float*, float*, unsigned)`.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }
        .map_err(|e| RuntimeError::launch("axpy", e))
        .unwrap();
    kvq_runtime::device::synchronize_stream(&stream, "axpy").unwrap();
    let host = download(&stream, &y);
    for i in 0..n as usize {
        assert_eq!(host[i], 3.0 * x_host[i] + 2.0, "y[{i}]");
    }
    assert!(host[n as usize].is_nan(), "axpy wrote past n");

    // The second request costs nothing: same module, no compile.
    let m1 = jit.module(&source, &options()).unwrap();
    let m2 = jit.module(&source, &options()).unwrap();
    assert!(Arc::ptr_eq(&m1, &m2));
    assert_eq!(m1.origin(), Origin::Compiled);
    let s = jit.stats();
    assert_eq!((s.compiled, s.disk_hits), (1, 0));
    assert!(s.memory_hits >= 2);

    // Typed errors: unknown kernel; impossible block size.
    let err = m1.function("nope").unwrap_err();
    assert!(matches!(err, JitError::FunctionNotFound { .. }), "{err}");
    let mut y = upload(&stream, &poison);
    let err = launch_fill(&stream, fill, &mut y, 1.0, n, 4096).unwrap_err();
    assert!(
        matches!(err, RuntimeError::Jit(JitError::Launch { .. })),
        "{err}"
    );
    println!("launch error: {err}");
    device.synchronize("after the failed launch").unwrap();

    // A new Jit on the same folder (a second process start) compiles nothing.
    let warm = Jit::with_disk_cache(&device, Some(DiskCache::open(&dir).unwrap()));
    let start = std::time::Instant::now();
    let fill2 = warm.function(&source, "fill", &options()).unwrap();
    let warm_ms = start.elapsed().as_secs_f64() * 1e3;
    println!("warm start: {} in {warm_ms:.2} ms", warm.stats());
    assert_eq!((warm.stats().compiled, warm.stats().disk_hits), (0, 1));
    let mut y = upload(&stream, &poison);
    launch_fill(&stream, &fill2, &mut y, 5.0, n, 256).unwrap();
    assert!(download(&stream, &y)[..n as usize]
        .iter()
        .all(|&v| v == 5.0));

    // PTX output loads too (driver JIT).
    let ptx_jit = Jit::with_disk_cache(&device, None).with_output(Output::Ptx);
    let fill3 = ptx_jit.function(&source, "fill", &options()).unwrap();
    let mut y = upload(&stream, &poison);
    launch_fill(&stream, &fill3, &mut y, 7.0, n, 256).unwrap();
    assert!(download(&stream, &y)[..n as usize]
        .iter()
        .all(|&v| v == 7.0));

    let _ = std::fs::remove_dir_all(&dir);
}

fn concurrent_requests_compile_once() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::with_disk_cache(&device, None);
    let source = Source::new("threads.cu", KERNELS.replace("fill", "fill_threads"));
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| jit.function(&source, "fill_threads", &options()).unwrap());
        }
    });
    let stats = jit.stats();
    assert_eq!(stats.compiled, 1, "{stats}");
    assert_eq!(stats.memory_hits, 7, "{stats}");
}

fn event_timing_measures_a_copy_bound_kernel() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::with_disk_cache(&device, None);
    let fill = jit
        .function(&Source::new("kernels.cu", KERNELS), "fill", &options())
        .unwrap();
    let stream = device.new_stream().unwrap();
    let n: u32 = 64 << 20; // 256 MiB of f32: larger than any L2
    let mut buf = stream.alloc_zeros::<f32>(n as usize).unwrap();
    let timer = GpuTimer::new(&jit).unwrap();
    let timing = timer
        .time(&stream, 3, 20, |s| {
            launch_fill(s, &fill, &mut buf, 1.0, n, 256)
        })
        .unwrap();
    assert_eq!(timing.samples_us.len(), 20);
    assert!(timing.samples_us.iter().all(|&t| t > 0.0 && t.is_finite()));
    let gbps = n as f64 * 4.0 / (timing.median_us() * 1e-6) / 1e9;
    println!(
        "fill of {} MiB: median {:.1} us (min {:.1}, max {:.1}) = {gbps:.0} GB/s written; peak DRAM {:.0} GB/s",
        (n as u64 * 4) >> 20,
        timing.median_us(),
        timing.min_us(),
        timing.max_us(),
        device.props().peak_memory_bandwidth_gbps()
    );
    assert!(gbps > 50.0, "implausibly slow: {gbps} GB/s");
    assert!(
        gbps < 2.0 * device.props().peak_memory_bandwidth_gbps(),
        "{gbps} GB/s"
    );
}

fn device_errors_are_typed() {
    let _device = Device::open(0).expect("GPU");
    let count = kvq_runtime::device_count().unwrap();
    let err = Device::open(count + 3).unwrap_err();
    assert!(matches!(err, JitError::NoGpu { .. }), "{err}");
    assert!(
        err.to_string().contains("out of range") || err.to_string().contains("ordinal"),
        "{err}"
    );
    println!("{err}");
    let driver = kvq_runtime::driver_version().unwrap();
    assert!(driver.major >= 12, "{driver}");
}
