//! The GPU work shared by `kvq demo` and `kvq eval`: open the device, run one decode of a batch of
//! reference caches, and time a scheme's decode the way the tuner and the benchmarks do (rotating
//! copies bigger than L2, runs queued behind a spin kernel, output checked against the reference
//! first).

use kvq::codegen::{KernelShape, TuneParams};
use kvq::reference::int::IntCache;
use kvq::runtime::cudarc::driver::{CudaSlice, CudaStream};
use kvq::runtime::device::synchronize_stream;
use kvq::runtime::tune::check::default_rows;
use kvq::runtime::tune::synth::{random_queries, word_to_f32};
use kvq::runtime::tune::{
    batch_device_bytes, plan_copies, ChoiceSource, ReferenceCheck, RotatingBatch, TuneChoice,
    TuneProblem, Tuner,
};
use kvq::runtime::{
    nvrtc, DecodeKernel, DecodeScratch, Device, GpuCache, GpuTimer, Jit, RuntimeError,
};
use std::sync::Arc;

/// An opened GPU with its JIT.
pub struct Gpu {
    pub device: Device,
    pub jit: Jit,
}

/// Opens GPU `ordinal` and checks that NVRTC loads (every kernel is compiled at run time).
pub fn open(ordinal: usize) -> Result<Gpu, RuntimeError> {
    let device = Device::open(ordinal)?;
    nvrtc::version()?;
    let jit = Jit::new(&device)?;
    Ok(Gpu { device, jit })
}

/// The one line `kvq demo` prints when it falls back to the CPU reference: what is
/// missing, short (the full message, with every library name tried and how to install it, is
/// `kvq info`'s).
pub fn fallback_line(e: &RuntimeError) -> String {
    format!(
        "No usable GPU ({}): CPU reference only; `kvq info` says why.",
        e.summary()
    )
}

/// Runs one decode of `caches` (a batch of one scheme) with queries `q_bits` (device words,
/// `[batch][q_heads][head_dim]`) and the heuristic split count, and returns the output as f32. The
/// output starts poisoned (NaN), so an unwritten value cannot pass for a result.
pub fn decode_once(
    gpu: &Gpu,
    shape: &KernelShape,
    params: &TuneParams,
    caches: &[&IntCache],
    q_bits: &[u16],
) -> Result<Vec<f32>, RuntimeError> {
    let first = caches
        .first()
        .ok_or_else(|| RuntimeError::InvalidInput("an empty batch".into()))?;
    let kernel = DecodeKernel::load_with(
        &gpu.jit,
        first.spec(),
        shape,
        params,
        kvq::runtime::LoadOptions::ALLOW_SLOW_PATH,
    )?;
    warn_slow_path(&kernel);
    let stream = gpu.device.default_stream();
    let cache = GpuCache::upload(&stream, caches)?;
    let q_heads = cache.kv_heads() * shape.gqa as usize;
    let splits = kernel.default_splits(
        caches.len(),
        cache.kv_heads(),
        caches.iter().map(|c| c.tokens()).max().unwrap_or(1),
        gpu.device.props().sm_count as usize,
    )?;
    let q = stream
        .clone_htod(q_bits)
        .map_err(|e| RuntimeError::driver("upload queries", e))?;
    let mut out = stream
        .clone_htod(&vec![0xFFFFu16; q_bits.len()])
        .map_err(|e| RuntimeError::driver("allocate outputs", e))?;
    let max_len = caches.iter().map(|c| c.tokens()).max().unwrap_or(1);
    let mut scratch = DecodeScratch::with_pieces(
        &stream,
        caches.len(),
        q_heads,
        shape.head_dim as usize,
        splits,
        kernel.default_pieces(max_len, splits),
    )?;
    kernel.attend(&stream, cache.view(), &q, &mut out, &mut scratch)?;
    let host = stream
        .clone_dtoh(&out)
        .map_err(|e| RuntimeError::async_failure("decode", e))?;
    synchronize_stream(&stream, "decode")?;
    Ok(host
        .into_iter()
        .map(|w| word_to_f32(w, shape.dtype))
        .collect())
}

/// A timed, checked decode configuration.
#[derive(Debug, Clone)]
pub struct Latency {
    pub median_us: f64,
    pub choice: TuneChoice,
    pub source: ChoiceSource,
    /// Largest relative error of the checked rows against the CPU reference.
    pub max_rel_error: f64,
    /// Copies of the batch rotated through.
    pub copies: usize,
}

/// Chooses the launch (stored tuning result, else the heuristic, or tuning now under policy
/// `full`), checks one output against the CPU reference, then times `runs` decodes.
pub fn measure(
    gpu: &Gpu,
    tuner: &mut Tuner<'_>,
    shape: &KernelShape,
    caches: &[&IntCache],
    warmup: usize,
    runs: usize,
    seed: u64,
) -> Result<Latency, RuntimeError> {
    let first = caches
        .first()
        .ok_or_else(|| RuntimeError::InvalidInput("an empty batch".into()))?;
    let spec = *first.spec();
    let kv_heads = first.k().kv_heads();
    let max_len = caches.iter().map(|c| c.tokens()).max().unwrap_or(1);
    let problem = TuneProblem::new(spec, *shape, kv_heads, caches.len(), max_len);
    let selection = tuner.choose(&problem)?;
    let choice = selection.choice;
    let kernel = DecodeKernel::load_with(
        &gpu.jit,
        &spec,
        shape,
        &choice.params,
        kvq::runtime::LoadOptions::ALLOW_SLOW_PATH,
    )?;
    warn_slow_path(&kernel);
    let stream = gpu.device.default_stream();
    let q_heads = problem.q_heads();
    let d = shape.head_dim as usize;
    let (q_bits, q_vals) = random_queries(caches.len() * q_heads * d, shape.dtype, seed)?;
    let check = ReferenceCheck::new(
        caches,
        &q_vals,
        q_heads,
        shape.dtype,
        &default_rows(caches.len()),
    )?;
    let (free, _) = gpu
        .device
        .context()
        .mem_get_info()
        .map_err(|e| RuntimeError::driver("cuMemGetInfo", e))?;
    let budget = (free as u64 / 2).min(16 << 30);
    let copies = plan_copies(
        batch_device_bytes(caches, q_heads),
        gpu.device.props().l2_bytes,
        budget,
    )?;
    let mut batch = RotatingBatch::upload(&stream, caches, &q_bits, copies)?;
    let mut scratch = DecodeScratch::with_pieces(
        &stream,
        caches.len(),
        q_heads,
        d,
        choice.splits,
        choice.pieces,
    )?;
    let out = batch.run_checked(0, &stream, &kernel, &mut scratch)?;
    let max_rel_error = check.verify(&out).map_err(|why| {
        RuntimeError::InvalidInput(format!(
            "`{spec}`: the GPU output disagrees with the CPU reference ({why}); not timed"
        ))
    })?;
    let timer = GpuTimer::new(&gpu.jit)?;
    let timing = timer.time(&stream, warmup, runs.max(1), |s| {
        batch.attend_next(s, &kernel, &mut scratch)
    })?;
    Ok(Latency {
        median_us: timing.median_us(),
        choice,
        source: selection.source,
        max_rel_error,
        copies: batch.copies(),
    })
}

/// `(bits, f32 values)` of `values` rounded to the kernel's dtype.
/// Copies of a batch of `bytes` to rotate through so the timed decodes read past L2, within half
/// the free device memory (at most 16 GiB).
pub fn rotation_copies(gpu: &Gpu, bytes: usize) -> Result<usize, RuntimeError> {
    let (free, _) = gpu
        .device
        .context()
        .mem_get_info()
        .map_err(|e| RuntimeError::driver("cuMemGetInfo", e))?;
    plan_copies(
        bytes as u64,
        gpu.device.props().l2_bytes,
        (free as u64 / 2).min(16 << 30),
    )
}

/// Runs `attend(stream, copy 0, out)` once and refuses an output with NaN or infinite values
/// (named by `spec`), then times `runs` launches (after `warmup`) rotating over `copies` copies of
/// the batch; the median in µs. Shared by the decodes not timed through [`measure`].
pub fn check_then_time(
    gpu: &Gpu,
    spec: &kvq::SchemeSpec,
    out: &mut CudaSlice<u16>,
    dtype: kvq::codegen::Dtype,
    copies: usize,
    (warmup, runs): (usize, usize),
    mut attend: impl FnMut(&Arc<CudaStream>, usize, &mut CudaSlice<u16>) -> Result<(), RuntimeError>,
) -> Result<f64, RuntimeError> {
    let stream = gpu.device.default_stream();
    attend(&stream, 0, out)?;
    let host: Vec<u16> = stream
        .clone_dtoh(out)
        .map_err(|e| RuntimeError::driver("download the output", e))?;
    if !host.iter().all(|&w| word_to_f32(w, dtype).is_finite()) {
        return Err(RuntimeError::InvalidInput(format!(
            "`{spec}`: the GPU output holds NaN or infinite values; not timed"
        )));
    }
    let timer = GpuTimer::new(&gpu.jit)?;
    let mut next = 0;
    let timing = timer.time(&stream, warmup, runs.max(1), |s| {
        next = (next + 1) % copies.max(1);
        attend(s, next, out)
    })?;
    Ok(timing.median_us())
}

pub fn to_device_words(values: &[f32], dtype: kvq::codegen::Dtype) -> (Vec<u16>, Vec<f32>) {
    values
        .iter()
        .map(|&x| kvq::runtime::tune::synth::round_to_word(x, dtype))
        .unzip()
}

/// The command line runs every shape it is given, and says on stderr when the generic CUDA-core
/// kernel serves it (the tensor-core kernel cannot: `kvq_codegen::SlowPath`).
fn warn_slow_path(kernel: &DecodeKernel) {
    let generated = kernel.generated();
    if let Some(reason) = generated.slow_path {
        eprintln!(
            "warning: {} at head_dim {} takes the generic CUDA-core decode kernel ({reason}), \
             several times slower than the tensor-core kernel",
            generated.scheme, generated.shape.head_dim
        );
    }
}

#[cfg(test)]
mod tests {
    use super::fallback_line;
    use kvq::runtime::{JitError, RuntimeError};

    #[test]
    fn the_fallback_line_is_short_for_every_environment_error() {
        let tried: Vec<String> = (0..15).map(|i| format!("libnvrtc64_{i}0_0.so")).collect();
        let errors: [RuntimeError; 5] = [
            JitError::DriverNotFound {
                primary: "libcuda.so.1".into(),
                tried: tried.clone(),
            }
            .into(),
            JitError::NvrtcNotFound {
                primary: "libnvrtc.so.13".into(),
                tried,
            }
            .into(),
            JitError::NoGpu {
                ordinal: 3,
                count: 2,
            }
            .into(),
            JitError::LibraryIncomplete {
                what: "CUDA driver library",
                library:
                    "libcuda.so.1 (/a/very/long/path/to/a/folder/of/fake/libraries/libcuda.so.1)"
                        .into(),
                symbol: "cuInit".into(),
                others: 40,
                advice: "x".repeat(300),
            }
            .into(),
            RuntimeError::InvalidInput("y ".repeat(200)),
        ];
        for e in &errors {
            let line = fallback_line(e);
            assert!(line.chars().count() <= 120, "{} chars: {line}", line.len());
            assert!(!line.contains('\n'), "{line}");
        }
        assert!(fallback_line(&errors[0]).contains("libcuda.so.1 not found"));
    }
}
