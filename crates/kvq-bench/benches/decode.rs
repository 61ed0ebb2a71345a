//! Criterion benches of fused decode for a few representative shapes, timed on the GPU with CUDA
//! events through `iter_custom` (criterion's wall clock would time the host's enqueueing).
//!
//! Each sample is [`GpuTimer::total`]: the stream held by the spin kernel, `iters` decodes on
//! rotating copies of the batch queued between two events, the device time between them. Without
//! a GPU (or NVRTC) the benches print why and measure nothing.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use kvq::codegen::KernelShape;
use kvq::runtime::tune::{
    batch_device_bytes, default_launch, plan_copies, RotatingBatch, TuneProblem,
};
use kvq::runtime::{nvrtc, DecodeScratch, Device, GpuTimer, Jit, RuntimeError};
use kvq_bench::grid::{parse_schemes, BenchConfig};
use kvq_bench::workload::{prepare, PreparedCache, QueryRows};

/// (scheme, batch, context) pairs: a memory-bound long context at B=1, and a wider short batch.
const SHAPES: &[(&str, usize, usize)] = &[
    ("fp16", 1, 32_768),
    ("kivi2", 1, 32_768),
    ("fp16", 16, 4096),
    ("kivi2", 16, 4096),
];

fn decode(c: &mut Criterion) {
    if let Err(e) = bench_all(c) {
        eprintln!("skipping the decode benches: {e}");
    }
}

fn bench_all(c: &mut Criterion) -> Result<(), RuntimeError> {
    let device = Device::open(0)?;
    nvrtc::version()?;
    let jit = Jit::new(&device)?;
    let stream = device.default_stream();
    let timer = GpuTimer::new(&jit)?;
    let mut config = BenchConfig::standard();
    config.check = false;
    config.schemes =
        parse_schemes("kivi2").map_err(|e| RuntimeError::InvalidInput(e.to_string()))?;
    let shape = KernelShape::new(config.head_dim, config.gqa().map_err(usage)?, config.dtype);
    let queries = QueryRows::new(
        16,
        config.q_heads,
        config.head_dim as usize,
        config.dtype,
        1,
    )
    .map_err(usage)?;
    let mut group = c.benchmark_group("decode");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for &(name, batch, len) in SHAPES {
        let prepared = prepare(&config, len, &queries, &[]).map_err(usage)?;
        let Some(prep) = prepared.iter().find(|p| p.scheme.name == name) else {
            continue;
        };
        // Integer schemes only: the shapes above name none of the codebook ones.
        let PreparedCache::Int(cache) = &prep.cache else {
            continue;
        };
        let sequences = vec![&**cache; batch];
        let per_copy = batch_device_bytes(&sequences, config.q_heads);
        let copies = plan_copies(per_copy, device.props().l2_bytes, 8 << 30)?;
        let mut rotation =
            RotatingBatch::upload(&stream, &sequences, queries.bits_for(batch), copies)?;
        let problem = TuneProblem::new(prep.scheme.spec, shape, config.kv_heads, batch, len);
        let (choice, kernel) = default_launch(&jit, &problem)?;
        let mut scratch = DecodeScratch::with_pieces(
            &stream,
            batch,
            config.q_heads,
            config.head_dim as usize,
            choice.splits,
            choice.pieces,
        )?;
        let id = format!("{name}/B{batch}/L{}K", len / 1024);
        let mut failure = None;
        group.bench_function(id, |b| {
            b.iter_custom(|iters| {
                match timer.total(&stream, iters, |s| {
                    rotation.attend_next(s, &kernel, &mut scratch)
                }) {
                    Ok(d) => d,
                    Err(e) => {
                        failure.get_or_insert(e);
                        Duration::ZERO
                    }
                }
            })
        });
        if let Some(e) = failure {
            return Err(e);
        }
    }
    group.finish();
    Ok(())
}

fn usage<E: std::fmt::Display>(e: E) -> RuntimeError {
    RuntimeError::InvalidInput(e.to_string())
}

criterion_group!(benches, decode);
criterion_main!(benches);
