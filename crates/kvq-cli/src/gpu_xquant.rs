//! `kvq demo`'s GPU columns for XQuant schemes (`source = x(latent)`, `x(cross_layer)`): the
//! workload's layer cached by the CPU reference as the CPU column caches it
//! ([`evaluate::xquant_cache`]) and decoded by the fused XQuant kernel, K rebuilt on tensor cores
//! (its error against exact attention), and the decode's latency on random latents of the latency
//! workload's length (XQuant-CL: random accumulator latents too).

use kvq::codegen::{KernelShape, TuneParams};
use kvq::evaluate::{self, Workload};
use kvq::reference::synth::{generate, SynthConfig, SynthRng};
use kvq::reference::xquant::{Projections, XQuantCache};
use kvq::runtime::cudarc::driver::CudaSlice;
use kvq::runtime::decode::Pieces;
use kvq::runtime::tune::synth::{random_queries, round_to_word, word_to_f32};
use kvq::runtime::tune::{ChoiceSource, TuneChoice};
use kvq::runtime::xquant::{XQuantDeviceCache, XQuantKernel, XQuantScratch};
use kvq::runtime::RuntimeError;
use kvq::{CacheSource, SchemeSpec, XSource};

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

/// Uniform values in [-2, 2) (the decode's time does not depend on them).
fn random_latents(n: usize, rng: &mut SynthRng) -> Vec<f32> {
    (0..n).map(|_| 2.0 * rng.symmetric()).collect()
}

/// Latency of one decode of `batch` sequences of `tokens` random latents: projections from a
/// synthetic layer whose input is `kv_heads · head_dim` wide (the latents' width for any wider
/// input: the decode never reads the input's width), enough copies of the batch to rotate past
/// L2, the default splits, one output checked finite, then `runs` timed decodes.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    gpu: &Gpu,
    spec: &SchemeSpec,
    shape: &KernelShape,
    kv_heads: usize,
    tokens: usize,
    batch: usize,
    warmup: usize,
    runs: usize,
    seed: u64,
) -> Result<Latency, RuntimeError> {
    let d = shape.head_dim as usize;
    let d_model = kv_heads * d;
    let layer = generate(&SynthConfig {
        tokens: 16,
        kv_heads,
        gqa: shape.gqa as usize,
        head_dim: d,
        d_model,
        seed,
        ..Default::default()
    });
    let p = Projections::from_weights(&layer.layer.w_k, &layer.layer.w_v, d_model, kv_heads, d)
        .map_err(|e| reference("projections for the latency run", e))?;
    let mut state = SynthRng::new(seed);
    let (lk, lv) = (
        random_latents(tokens * p.k.rank, &mut state),
        random_latents(tokens * p.v.rank, &mut state),
    );
    let one = match spec.source {
        CacheSource::X(XSource::CrossLayer) => {
            // The accumulator's latents: more random values, added by the decode to each.
            let (bk, bv) = (
                random_latents(tokens * p.k.rank, &mut state),
                random_latents(tokens * p.v.rank, &mut state),
            );
            XQuantCache::from_cross_layer_latents(spec, (&lk, &lv), (&bk, &bv), &p, layer.rope)
        }
        _ => XQuantCache::from_latents(spec, &lk, &lv, &p, layer.rope),
    }
    .map_err(|e| reference("the latency run's latent cache", e))?;
    drop((lk, lv));
    let stream = gpu.device.default_stream();
    let sequences = vec![one; batch.max(1)];
    let first = XQuantDeviceCache::upload(&stream, &sequences)?;
    let copies = rotation_copies(gpu, first.latent_bytes())?;
    let mut batches = vec![first];
    for _ in 1..copies {
        batches.push(XQuantDeviceCache::upload(&stream, &sequences)?);
    }
    drop(sequences);
    let kernel = XQuantKernel::load(&gpu.jit, spec, shape, kv_heads, d_model, Default::default())?;
    let q_heads = kv_heads * shape.gqa as usize;
    let (q_words, _) = random_queries(batch.max(1) * q_heads * d, shape.dtype, seed)?;
    let q = upload(gpu, &q_words)?;
    let mut out = upload(gpu, &vec![0x7e00u16; q_words.len()])?;
    let mut scratch = XQuantScratch::new(&stream)?;
    let splits = kernel.default_splits(batch.max(1), tokens);
    let median_us = check_then_time(
        gpu,
        spec,
        &mut out,
        shape.dtype,
        batches.len(),
        (warmup, runs),
        |s, i, out| kernel.attend(s, &batches[i], &q, out, splits, &mut scratch),
    )?;
    let generated = kernel.generated();
    Ok(Latency {
        median_us,
        choice: TuneChoice {
            params: TuneParams {
                threads: generated.decode.block,
                tile_tokens: kvq::codegen::xquant_tile(shape.head_dim),
                min_warps_per_sm: 0,
                pack_heads: false,
                short_staging: false,
                store_scores: false,
            },
            splits,
            pieces: Pieces::NONE,
        },
        source: ChoiceSource::Heuristic,
        max_rel_error: f64::NAN,
        copies: batches.len(),
    })
}
