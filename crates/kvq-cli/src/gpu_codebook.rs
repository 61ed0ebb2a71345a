//! `kvq demo`'s GPU columns for codebook schemes (CommVQ): the layer coded by the GPU encoders and
//! decoded by the codebook kernel (its error against exact attention), and the decode's latency on
//! a long random sequence coded the same way, launched as the tuner says.

use kvq::codegen::KernelShape;
use kvq::reference::commvq::{self, CalibrationData, Codebooks, TrainOptions};
use kvq::reference::rope::Rope;
use kvq::reference::KvTensor;
use kvq::runtime::codebook::{
    input_words, CodebookCache, CodebookEncoder, CodebookKernel, CodebookScratch, EncodeInputs,
};
use kvq::runtime::cudarc::driver::CudaSlice;
use kvq::runtime::tune::synth::{random_queries, round_to_word, word_to_f32};
use kvq::runtime::tune::{TuneProblem, Tuner};
use kvq::runtime::RuntimeError;
use kvq::SchemeSpec;

use crate::gpu::{check_then_time, rotation_copies, Gpu, Latency};

/// Tokens of the latency workload's K/V its codebooks are trained on (decode time does not depend
/// on their quality).
const LATENCY_CALIBRATION: usize = 1024;

fn upload(gpu: &Gpu, w: &[u16]) -> Result<CudaSlice<u16>, RuntimeError> {
    gpu.device
        .default_stream()
        .clone_htod(w)
        .map_err(|e| RuntimeError::driver("upload K/V", e))
}

/// A cache of `batch` copies of one sequence (keys before and after RoPE, values), coded on the
/// GPU.
fn coded_cache(
    gpu: &Gpu,
    encoder: &CodebookEncoder,
    batch: usize,
    (k_pre, k_post, v): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
    tokens: usize,
    theta: f64,
) -> Result<CodebookCache, RuntimeError> {
    let stream = gpu.device.default_stream();
    let mut cache = encoder.new_cache(&stream, batch, tokens, theta)?;
    let inputs = EncodeInputs {
        k_pre_rope: k_pre,
        k_post_rope: k_post,
        v,
        tokens,
    };
    for slot in 0..batch {
        encoder.append(&stream, &mut cache, slot, &inputs)?;
    }
    Ok(cache)
}

/// The kernel's output for one sequence — `k_pre`, `k_post` (keys before and after RoPE) and `v`
/// coded on the GPU with `books` — and queries `q` (f32 `[q_heads][D]`), as f32.
pub fn decode_layer(
    gpu: &Gpu,
    spec: &SchemeSpec,
    shape: &KernelShape,
    books: &Codebooks,
    (k_pre, k_post, v): (&KvTensor, &KvTensor, &KvTensor),
    rope: Rope,
    q: &[f32],
) -> Result<Vec<f32>, RuntimeError> {
    let (h, d, len) = (k_pre.kv_heads, k_pre.head_dim, k_pre.tokens);
    let encoder = CodebookEncoder::load(&gpu.jit, spec, books, d, h, shape.dtype)?;
    let dev = |t: &KvTensor| upload(gpu, &input_words(t, shape.dtype));
    let (a, b, c) = (dev(k_pre)?, dev(k_post)?, dev(v)?);
    let cache = coded_cache(gpu, &encoder, 1, (&a, &b, &c), len, rope.theta)?;
    let kernel = CodebookKernel::load(&gpu.jit, spec, shape, h)?;
    let stream = gpu.device.default_stream();
    let q_words: Vec<u16> = q.iter().map(|&x| round_to_word(x, shape.dtype).0).collect();
    let q = upload(gpu, &q_words)?;
    let mut out = upload(gpu, &vec![0x7e00u16; q_words.len()])?;
    let mut scratch = CodebookScratch::new(&stream)?;
    kernel.attend(
        &stream,
        &cache,
        &q,
        &mut out,
        kernel.default_splits(1, len),
        &mut scratch,
    )?;
    let host: Vec<u16> = stream
        .clone_dtoh(&out)
        .map_err(|e| RuntimeError::driver("download the output", e))?;
    Ok(host.iter().map(|&w| word_to_f32(w, shape.dtype)).collect())
}

/// Latency of one decode of `batch` copies of the random sequence `(k, v)` (keys read as before
/// RoPE, and as after it for the FP16 rows: timing does not depend on which): codebooks trained
/// briefly on its first tokens, caches coded on the GPU in enough copies to rotate past L2, the
/// launch chosen by `tuner`'s policy, one output checked finite, then `runs` timed decodes.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    gpu: &Gpu,
    tuner: &mut Tuner<'_>,
    spec: &SchemeSpec,
    shape: &KernelShape,
    (k, v): (&KvTensor, &KvTensor),
    batch: usize,
    warmup: usize,
    runs: usize,
    seed: u64,
) -> Result<Latency, RuntimeError> {
    let (h, d, len) = (k.kv_heads, k.head_dim, k.tokens);
    let n = len.min(LATENCY_CALIBRATION);
    let (kc, vc) = (k.prefix(n), v.prefix(n));
    let data = CalibrationData {
        k_pre_rope: &kc,
        v: &vc,
        rope: Rope::default(),
    };
    let books = commvq::train_with(spec, &data, &TrainOptions::quick(seed))
        .map_err(|e| RuntimeError::InvalidInput(format!("codebooks for the latency run: {e}")))?;
    let encoder = CodebookEncoder::load(&gpu.jit, spec, &books, d, h, shape.dtype)?;
    let (kd, vd) = (
        upload(gpu, &input_words(k, shape.dtype))?,
        upload(gpu, &input_words(v, shape.dtype))?,
    );
    let theta = Rope::default().theta;
    let first = coded_cache(gpu, &encoder, batch, (&kd, &kd, &vd), len, theta)?;
    let copies = rotation_copies(gpu, first.cache_bytes())?;
    let mut batches = vec![first];
    for _ in 1..copies {
        batches.push(coded_cache(
            gpu,
            &encoder,
            batch,
            (&kd, &kd, &vd),
            len,
            theta,
        )?);
    }
    let problem = TuneProblem::new(*spec, *shape, h, batch, len);
    let (q_words, _) = random_queries(batch * problem.q_heads() * d, shape.dtype, seed)?;
    let q = upload(gpu, &q_words)?;
    let refs: Vec<&CodebookCache> = batches.iter().collect();
    let (launch, source) = tuner.choose_codebook(&problem, &refs, &q)?;
    let kernel = CodebookKernel::load_with(&gpu.jit, spec, shape, h, &launch.params)?;
    let stream = gpu.device.default_stream();
    let mut out = upload(gpu, &vec![0x7e00u16; q_words.len()])?;
    let mut scratch = CodebookScratch::new(&stream)?;
    let median_us = check_then_time(
        gpu,
        spec,
        &mut out,
        shape.dtype,
        batches.len(),
        (warmup, runs),
        |s, i, out| kernel.attend(s, &batches[i], &q, out, launch.splits, &mut scratch),
    )?;
    Ok(Latency {
        median_us,
        choice: launch.as_tune_choice(),
        source,
        max_rel_error: f64::NAN,
        copies: batches.len(),
    })
}
