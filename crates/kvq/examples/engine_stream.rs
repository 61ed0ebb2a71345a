//! kvq inside another Rust engine: the engine owns a cudarc context and a stream, and kvq's paged
//! cache and decode kernel run on that stream with the engine's buffers, no copies. A batch of two
//! sequences is prefilled and decoded for a few steps with KIVI-2, and the outputs are checked to be
//! finite (crates/kvq-capi's GPU tests check the same launches bit for bit against the paged
//! cache the kvq crate's tests hold to the CPU reference).
//!
//! `cargo run --release -p kvq --example engine_stream` (needs a GPU).

use std::error::Error;
use std::process::ExitCode;

use kvq::codegen::{Dtype, KernelShape};
use kvq::runtime::cudarc::driver::CudaContext;
use kvq::runtime::tune::synth::{random_queries, word_to_f32};
use kvq::runtime::tune::{default_launch, TuneProblem};
use kvq::runtime::{CacheConfig, DecodeScratch, Device, Jit, PagedKvCache};

const KV_HEADS: usize = 8;
const GQA: usize = 4;
const HEAD_DIM: usize = 128;
const PROMPT: usize = 1000;
const STEPS: usize = 8;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn Error>> {
    // The engine's side: its own cudarc context (the device's primary one) and stream.
    let engine_ctx = CudaContext::new(0)?;
    let stream = engine_ctx.new_stream()?;
    // kvq's side: the same GPU opened for its JIT (the same primary context underneath).
    let device = Device::open(0)?;
    let jit = Jit::new(&device)?;
    let spec = kvq::schemes::by_name("kivi2").ok_or("no kivi2")?.spec;
    let (batch, q_heads, row) = (2, KV_HEADS * GQA, KV_HEADS * HEAD_DIM);
    let cfg = CacheConfig {
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        max_seqs: batch,
        pool_pages: 64,
        max_tokens: 4096,
        input_dtype: Dtype::F16,
    };
    let mut cache = PagedKvCache::new(&jit, stream.clone(), &spec, cfg)?;
    let ids = [cache.add_sequence()?, cache.add_sequence()?];
    // The engine's K/V of two prompts, packed back to back, already on its stream.
    let (k, _) = random_queries(batch * PROMPT * row, Dtype::F16, 1)?;
    let (v, _) = random_queries(batch * PROMPT * row, Dtype::F16, 2)?;
    let (k, v) = (stream.clone_htod(&k)?, stream.clone_htod(&v)?);
    cache.prefill_packed(&[(ids[0], PROMPT), (ids[1], PROMPT)], &k, &v, Dtype::F16)?;
    // The untuned default launch for this batch and length.
    let shape = KernelShape::new(HEAD_DIM as u32, GQA as u32, Dtype::F16);
    let problem = TuneProblem::new(spec, shape, KV_HEADS, batch, PROMPT + STEPS);
    let (choice, kernel) = default_launch(&jit, &problem)?;
    let mut scratch = DecodeScratch::with_pieces(
        &stream,
        batch,
        q_heads,
        HEAD_DIM,
        choice.splits,
        choice.pieces,
    )?;
    let mut out = stream.alloc_zeros::<u16>(batch * q_heads * HEAD_DIM)?;
    for step in 0..STEPS as u64 {
        let (kn, _) = random_queries(batch * row, Dtype::F16, 10 + step)?;
        let (vn, _) = random_queries(batch * row, Dtype::F16, 20 + step)?;
        let (q, _) = random_queries(batch * q_heads * HEAD_DIM, Dtype::F16, 30 + step)?;
        cache.append(
            &ids,
            &stream.clone_htod(&kn)?,
            &stream.clone_htod(&vn)?,
            Dtype::F16,
        )?;
        cache.attend(&kernel, &stream.clone_htod(&q)?, &mut out, &mut scratch)?;
    }
    let words: Vec<u16> = stream.clone_dtoh(&out)?;
    let values: Vec<f32> = words.iter().map(|&w| word_to_f32(w, Dtype::F16)).collect();
    if !values.iter().all(|x| x.is_finite()) {
        return Err("a non-finite output".into());
    }
    let rms = (values.iter().map(|x| x * x).sum::<f32>() / values.len() as f32).sqrt();
    println!(
        "kivi2 on the engine's stream: {batch} sequences × ({PROMPT} + {STEPS}) tokens, \
         {q_heads} q / {KV_HEADS} KV heads, splits {}; outputs finite, rms {rms:.4}",
        choice.splits
    );
    println!(
        "{:.2} bits per cached element, ok",
        cache.memory()?.bits_per_element
    );
    Ok(())
}
