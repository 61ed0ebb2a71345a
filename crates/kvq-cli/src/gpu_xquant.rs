//! `kvq demo`'s GPU columns for XQuant schemes (`source = x(latent)`, `x(cross_layer)`): the
//! workload's layer cached by the CPU reference as the CPU column caches it
//! ([`evaluate::xquant_cache`]) and decoded by the fused XQuant kernel, K rebuilt on tensor cores
//! (its error against exact attention), and the decode's latency on random latents of the latency
//! workload's length (XQuant-CL: random accumulator latents too) at the split count the tuner's
//! policy chooses (`kvq demo --tune` tunes it).

use kvq::codegen::KernelShape;
use kvq::evaluate::{self, Workload};
use kvq::runtime::cudarc::driver::CudaSlice;
use kvq::runtime::tune::synth::{random_queries, round_to_word, word_to_f32};
use kvq::runtime::tune::{TuneProblem, Tuner};
use kvq::runtime::xquant::{
    synthetic_cache, xquant_cache_bytes, xquant_choice, XQuantDeviceCache, XQuantKernel,
    XQuantScratch,
};
use kvq::runtime::RuntimeError;
use kvq::SchemeSpec;

use crate::gpu::{check_then_time, rotation_copies, Gpu, Latency};

fn reference(what: &str, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::InvalidInput(format!("{what}: {e}"))
}

fn upload(gpu: &Gpu, w: &[u16]) -> Result<CudaSlice<u16>, RuntimeError> {
    gpu.device
        .default_stream()
        .clone_htod(w)
        .map_err(|e| RuntimeError::driver("upload queries", e))
}

/// The kernel's output (f32) for the workload's layer and queries, at the default splits.
pub fn decode_layer(
    gpu: &Gpu,
    spec: &SchemeSpec,
    shape: &KernelShape,
    w: &Workload,
) -> Result<Vec<f32>, RuntimeError> {
    let data = w.data();
    let p = w
        .projections()
        .map_err(|e| reference("the layer's projections", e))?;
    let cache = evaluate::xquant_cache(spec, w).map_err(|e| reference("the latent cache", e))?;
    let kernel = XQuantKernel::load(
        &gpu.jit,
        spec,
        shape,
        p.kv_heads,
        p.d_model(),
        Default::default(),
    )?;
    let stream = gpu.device.default_stream();
    let device = XQuantDeviceCache::upload(&stream, std::slice::from_ref(&cache))?;
    let q_words: Vec<u16> = data
        .q
        .data
        .iter()
        .map(|&x| round_to_word(x, shape.dtype).0)
        .collect();
    let q = upload(gpu, &q_words)?;
    let mut out = upload(gpu, &vec![0x7e00u16; q_words.len()])?;
    let mut scratch = XQuantScratch::new(&stream)?;
    let splits = kernel.default_splits(1, cache.tokens());
    kernel.attend(&stream, &device, &q, &mut out, splits, &mut scratch)?;
    let host: Vec<u16> = stream
        .clone_dtoh(&out)
        .map_err(|e| RuntimeError::driver("download the output", e))?;
    Ok(host.iter().map(|&w| word_to_f32(w, shape.dtype)).collect())
}

/// Latency of one decode of `batch` sequences of `tokens` random latents
/// ([`synthetic_cache`]: synthetic projections of a layer whose input is `kv_heads · head_dim`
/// wide, the latents' width for any wider input; XQuant-CL with random accumulator latents too),
/// enough copies of the batch to rotate past L2, the split count `tuner`'s policy chooses, one
/// output checked finite, then `runs` timed decodes.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    gpu: &Gpu,
    tuner: &mut Tuner<'_>,
    spec: &SchemeSpec,
    shape: &KernelShape,
    kv_heads: usize,
    tokens: usize,
    batch: usize,
    (warmup, runs): (usize, usize),
    seed: u64,
) -> Result<Latency, RuntimeError> {
    let d = shape.head_dim as usize;
    let d_model = kv_heads * d;
    let batch = batch.max(1);
    let one = synthetic_cache(spec, (kv_heads, d, d_model), tokens, seed)?;
    let stream = gpu.device.default_stream();
    let sequences = vec![one; batch];
    let first = XQuantDeviceCache::upload(&stream, &sequences)?;
    let copies = rotation_copies(gpu, xquant_cache_bytes(&first) as usize)?;
    let mut batches = vec![first];
    for _ in 1..copies {
        batches.push(XQuantDeviceCache::upload(&stream, &sequences)?);
    }
    drop(sequences);
    let kernel = XQuantKernel::load(&gpu.jit, spec, shape, kv_heads, d_model, Default::default())?;
    let problem = TuneProblem::new(*spec, *shape, kv_heads, batch, tokens);
    let (q_words, _) = random_queries(batch * problem.q_heads() * d, shape.dtype, seed)?;
    let q = upload(gpu, &q_words)?;
    let refs: Vec<&XQuantDeviceCache> = batches.iter().collect();
    let (splits, source) = tuner.choose_xquant(&problem, &kernel, &refs, &q)?;
    let mut out = upload(gpu, &vec![0x7e00u16; q_words.len()])?;
    let mut scratch = XQuantScratch::new(&stream)?;
    let median_us = check_then_time(
        gpu,
        spec,
        &mut out,
        shape.dtype,
        batches.len(),
        (warmup, runs),
        |s, i, out| kernel.attend(s, &batches[i], &q, out, splits, &mut scratch),
    )?;
    Ok(Latency {
        median_us,
        choice: xquant_choice(&kernel, splits),
        source,
        max_rel_error: f64::NAN,
        copies: batches.len(),
    })
}
