//! `kvq demo`: every built-in scheme on synthetic K/V with outliers, in one table — memory, error
//! against exact attention, and (with a GPU) fused-decode latency against the FP16 kernel.
//!
//! Two workloads, because they answer different questions:
//! - **error**: a seeded synthetic layer from `kvq_reference::synth` (outlier channels, attention
//!   sinks, RoPE, queries aligned with keys) evaluated by `kvq::evaluate` on the CPU reference, and,
//!   with a GPU, decoded by the generated kernel and compared with the same exact attention;
//! - **latency**: random heavy-tailed K/V at a long context from the reference's fast generator
//!   (`synth::random_kv` with `Tails::Laplace`, cheap at 32K tokens × 8 heads), every GPU
//!   scheme's cache built from the same values, timed as the tuner does.

use std::io::Write;
use std::time::Instant;

use kvq::codegen::{has_codebook_kernel, has_xquant_kernel, Dtype, KernelShape, TuneParams};
use kvq::evaluate::{self, Evaluation, Memory, Workload};
use kvq::reference::attention;
use kvq::reference::int::IntCache;
use kvq::reference::synth::{self, SynthConfig, Tails};
use kvq::runtime::tune::{ChoiceSource, TunePolicy, Tuner};
use kvq::runtime::RuntimeError;

use crate::error::{CliError, Result};
use crate::gpu::{self, Gpu, Latency};
use crate::gpu_codebook;
use crate::gpu_xquant;
use crate::scheme::Resolved;
use crate::table::{Align, Table};

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub schemes: Vec<Resolved>,
    /// Cached tokens of the synthetic layer the error is measured on.
    pub tokens: usize,
    /// Held-out tokens of that layer CommVQ trains its codebooks on.
    pub calibration: usize,
    /// Context of the latency workload and of the memory columns.
    pub context: usize,
    pub batch: usize,
    pub kv_heads: usize,
    pub gqa: u32,
    pub head_dim: u32,
    pub dtype: Dtype,
    /// Skip the GPU even when one is usable.
    pub cpu_only: bool,
    /// Tune shapes without a stored result (policy `full`) instead of using the heuristic.
    pub tune: bool,
    pub warmup: usize,
    pub runs: usize,
    pub device: usize,
    pub seed: u64,
}

/// One scheme's results.
struct Row {
    scheme: Resolved,
    memory: Memory,
    cpu: std::result::Result<Evaluation, String>,
    gpu_error: Option<std::result::Result<f64, String>>,
    latency: Option<std::result::Result<Latency, String>>,
}

fn progress(line: &str) {
    eprintln!("[kvq demo] {line}");
}

/// Runs the demo, writing the table to `out` (progress goes to stderr).
pub fn run(opts: &DemoOptions, out: &mut dyn Write) -> Result<()> {
    let started = Instant::now();
    let gpu = if opts.cpu_only {
        writeln_out(
            out,
            "GPU not used (--cpu): the table below comes from the CPU reference, without latency columns.",
        )?;
        None
    } else {
        match gpu::open(opts.device) {
            Ok(g) => Some(g),
            Err(e) => {
                writeln_out(out, &gpu::fallback_line(&e))?;
                None
            }
        }
    };
    if let Some(g) = &gpu {
        writeln_out(out, &format!("{}", g.device.props()))?;
    }

    // Error workload: the seeded synthetic layer, evaluated on the CPU reference.
    let cfg = SynthConfig {
        tokens: opts.tokens,
        ..SynthConfig::default()
    };
    progress(&format!(
        "synthetic layer: {} tokens + {} held out, {} KV heads × {}, GQA {}",
        cfg.tokens, opts.calibration, cfg.kv_heads, cfg.head_dim, cfg.gqa
    ));
    let w = Workload::generate(&cfg, opts.calibration)?;
    let mut rows = Vec::new();
    for s in &opts.schemes {
        let t = Instant::now();
        let memory = evaluate::memory(
            &s.spec,
            opts.head_dim,
            opts.kv_heads as u32,
            opts.context as u64,
        )?;
        let cpu = evaluate::evaluate(&s.spec, &w).map_err(|e| e.to_string());
        progress(&format!(
            "{}: CPU reference in {:.2} s",
            s.label(),
            t.elapsed().as_secs_f64()
        ));
        rows.push(Row {
            scheme: s.clone(),
            memory,
            cpu,
            gpu_error: None,
            latency: None,
        });
    }

    let mut jit_line = None;
    if let Some(g) = &gpu {
        gpu_columns(g, opts, &w, &cfg, &mut rows)?;
        jit_line = Some(format!("JIT: {}", g.jit.stats()));
    }
    render(opts, &cfg, gpu.is_some(), &rows, out)?;
    if let Some(line) = jit_line {
        writeln_out(out, &line)?;
    }
    writeln_out(
        out,
        &format!(
            "Ran in {:.1} s ({} build).",
            started.elapsed().as_secs_f64(),
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
        ),
    )?;
    Ok(())
}

fn writeln_out(out: &mut dyn Write, line: &str) -> Result<()> {
    writeln!(out, "{line}").map_err(|source| CliError::Write {
        path: "<stdout>".into(),
        source,
    })
}

/// Fills the GPU columns: the kernel's error on the synthetic layer, and latency at the context.
fn gpu_columns(
    g: &Gpu,
    opts: &DemoOptions,
    w: &Workload,
    cfg: &SynthConfig,
    rows: &mut [Row],
) -> Result<()> {
    let data = w.data();
    let err_shape = KernelShape::new(cfg.head_dim as u32, cfg.gqa as u32, opts.dtype);
    let (q_bits, _) = gpu::to_device_words(&data.q.data, opts.dtype);
    for r in rows
        .iter_mut()
        .filter(|r| !r.scheme.has_gpu_kernel() && has_codebook_kernel(&r.scheme.spec))
    {
        // The layer coded by the GPU encoders with the codebooks the CPU column trained.
        let spec = r.scheme.spec;
        let result = w
            .codebooks(&spec)
            .map_err(|e| e.to_string())
            .and_then(|books| {
                gpu_codebook::decode_layer(
                    g,
                    &spec,
                    &err_shape,
                    &books,
                    (&data.k_pre_rope, &data.k, &data.v),
                    data.rope,
                    &data.q.data,
                )
                .map(|o| attention::relative_error(&o, w.exact_output()))
                .map_err(|e| e.to_string())
            });
        r.gpu_error = Some(result);
    }
    for r in rows
        .iter_mut()
        .filter(|r| has_xquant_kernel(&r.scheme.spec))
    {
        // The layer's input through its projections, cached by the CPU reference.
        let result = gpu_xquant::decode_layer(g, &r.scheme.spec, &err_shape, w)
            .map(|o| attention::relative_error(&o, w.exact_output()))
            .map_err(|e| e.to_string());
        r.gpu_error = Some(result);
    }
    for r in rows.iter_mut().filter(|r| r.scheme.has_gpu_kernel()) {
        let result = IntCache::build(&r.scheme.spec, &data.k, &data.v)
            .map_err(|e| e.to_string())
            .and_then(|cache| {
                let params = TuneParams::default_for(&r.scheme.spec, &err_shape);
                gpu::decode_once(g, &err_shape, &params, &[&cache], &q_bits)
                    .map(|o| attention::relative_error(&o, w.exact_output()))
                    .map_err(|e| e.to_string())
            });
        r.gpu_error = Some(result);
    }

    // Latency: one random heavy-tailed sequence, every GPU scheme's cache built from it in parallel.
    let shape = KernelShape::new(opts.head_dim, opts.gqa, opts.dtype);
    let gpu_rows: Vec<usize> = (0..rows.len())
        .filter(|&i| rows[i].scheme.has_gpu_kernel())
        .collect();
    let codebook_rows: Vec<usize> = (0..rows.len())
        .filter(|&i| has_codebook_kernel(&rows[i].scheme.spec))
        .collect();
    let xquant_rows: Vec<usize> = (0..rows.len())
        .filter(|&i| has_xquant_kernel(&rows[i].scheme.spec))
        .collect();
    if gpu_rows.is_empty() && codebook_rows.is_empty() && xquant_rows.is_empty() {
        return Ok(());
    }
    progress(&format!(
        "latency workload: {} × {} tokens, {} KV heads × {}, GQA {}, {}",
        opts.batch, opts.context, opts.kv_heads, opts.head_dim, opts.gqa, opts.dtype
    ));
    let t = Instant::now();
    let (k, v) = synth::random_kv(
        opts.kv_heads,
        opts.context,
        opts.head_dim as usize,
        opts.seed,
        Tails::Laplace,
    )
    .map_err(RuntimeError::Memory)?;
    let specs: Vec<_> = gpu_rows.iter().map(|&i| rows[i].scheme.spec).collect();
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .max(1);
    let caches: Vec<std::result::Result<IntCache, String>> = std::thread::scope(|s| {
        let mut out = Vec::new();
        for chunk in specs.chunks(specs.len().div_ceil(threads)) {
            let (k, v) = (&k, &v);
            out.push(s.spawn(move || {
                chunk
                    .iter()
                    .map(|spec| IntCache::build(spec, k, v).map_err(|e| e.to_string()))
                    .collect::<Vec<_>>()
            }));
        }
        out.into_iter()
            .flat_map(|h| {
                h.join()
                    .unwrap_or_else(|_| vec![Err("cache build thread panicked".to_string())])
            })
            .collect()
    });
    drop((k, v));
    progress(&format!(
        "built {} caches in {:.1} s",
        caches.len(),
        t.elapsed().as_secs_f64()
    ));
    let mut tuner = Tuner::new(&g.jit)?;
    if opts.tune {
        tuner.set_policy(TunePolicy::Full);
    }
    for (&i, cache) in gpu_rows.iter().zip(&caches) {
        let label = rows[i].scheme.label();
        let result = match cache {
            Ok(c) => {
                let batch = vec![c; opts.batch.max(1)];
                gpu::measure(
                    g,
                    &mut tuner,
                    &shape,
                    &batch,
                    opts.warmup,
                    opts.runs,
                    opts.seed,
                )
                .map_err(|e: RuntimeError| e.to_string())
            }
            Err(e) => Err(e.clone()),
        };
        report_latency(&label, &result);
        rows[i].latency = Some(result);
    }
    // Codebook schemes: their caches are coded on the GPU from the same random K/V.
    if !codebook_rows.is_empty() {
        let (k, v) = synth::random_kv(
            opts.kv_heads,
            opts.context,
            opts.head_dim as usize,
            opts.seed,
            Tails::Laplace,
        )
        .map_err(RuntimeError::Memory)?;
        for &i in &codebook_rows {
            let label = rows[i].scheme.label();
            let spec = rows[i].scheme.spec;
            let result = gpu_codebook::measure(
                g,
                &mut tuner,
                &spec,
                &shape,
                (&k, &v),
                opts.batch.max(1),
                opts.warmup,
                opts.runs,
                opts.seed,
            )
            .map_err(|e| e.to_string());
            report_latency(&label, &result);
            rows[i].latency = Some(result);
        }
    }
    // XQuant latent schemes: random latents of the same length (the decode's time does not depend
    // on their values).
    for &i in &xquant_rows {
        let label = rows[i].scheme.label();
        let result = gpu_xquant::measure(
            g,
            &mut tuner,
            &rows[i].scheme.spec,
            &shape,
            opts.kv_heads,
            opts.context,
            opts.batch.max(1),
            (opts.warmup, opts.runs),
            opts.seed,
        )
        .map_err(|e| e.to_string());
        report_latency(&label, &result);
        rows[i].latency = Some(result);
    }
    Ok(())
}

fn report_latency(label: &str, result: &std::result::Result<Latency, String>) {
    match result {
        Ok(l) => progress(&format!(
            "{label}: {:.1} µs ({}, {:?})",
            l.median_us, l.choice, l.source
        )),
        Err(e) => progress(&format!("{label}: {e}")),
    }
}

fn render(
    opts: &DemoOptions,
    cfg: &SynthConfig,
    gpu: bool,
    rows: &[Row],
    out: &mut dyn Write,
) -> Result<()> {
    let ctx = kvq_bench::grid::format_tokens(opts.context);
    let bits_h = format!("bits/elem @{ctx}");
    let mut columns: Vec<(&str, Align)> = vec![
        ("scheme", Align::Left),
        (bits_h.as_str(), Align::Right),
        ("saved vs FP16", Align::Right),
        ("attn err", Align::Right),
        ("softmax MSE", Align::Right),
    ];
    if gpu {
        columns.extend([
            ("attn err (GPU)", Align::Right),
            ("latency µs", Align::Right),
            ("× FP16", Align::Right),
            ("launch", Align::Left),
        ]);
    }
    columns.push(("runs on", Align::Left));
    let mut table = Table::new(&columns);
    let fp16_us = rows
        .iter()
        .filter(|r| r.scheme.name == Some("fp16"))
        .find_map(|r| r.latency.as_ref().and_then(|l| l.as_ref().ok()))
        .map(|l| l.median_us);
    let mut problems = Vec::new();
    for r in rows {
        let label = r.scheme.label();
        let mut cells = vec![
            label.clone(),
            format!("{:.3}", r.memory.bits_per_element()),
            format!("{:.1}%", 100.0 * r.memory.saved_vs_fp16()),
        ];
        match &r.cpu {
            Ok(e) => {
                cells.push(format!("{:.4}", e.output_error));
                cells.push(format!("{:.2e}", e.softmax_mse));
            }
            Err(why) => {
                cells.push("–".into());
                cells.push("–".into());
                problems.push(format!("{label}: CPU reference: {why}"));
            }
        }
        if gpu {
            match &r.gpu_error {
                Some(Ok(e)) => cells.push(format!("{e:.4}")),
                Some(Err(why)) => {
                    cells.push("failed".into());
                    problems.push(format!("{label}: GPU decode: {why}"));
                }
                None => cells.push("–".into()),
            }
            match &r.latency {
                Some(Ok(l)) => {
                    cells.push(format!("{:.1}", l.median_us));
                    cells.push(fp16_us.map_or("–".into(), |f| format!("{:.2}", f / l.median_us)));
                    let source = match l.source {
                        ChoiceSource::Heuristic => "default",
                        ChoiceSource::Stored => "tuned",
                        ChoiceSource::Tuned => "tuned now",
                    };
                    cells.push(format!(
                        "{}×{} split {} ({source})",
                        l.choice.params.threads, l.choice.params.tile_tokens, l.choice.splits
                    ));
                }
                Some(Err(why)) => {
                    cells.extend(["failed".into(), "–".into(), "–".into()]);
                    problems.push(format!("{label}: GPU latency: {why}"));
                }
                None => cells.extend(["–".into(), "–".into(), "–".into()]),
            }
        }
        cells.push(
            if r.scheme.decodes_on_gpu() {
                if gpu {
                    "GPU kernel"
                } else {
                    "GPU kernel (CPU reference here)"
                }
            } else {
                "CPU reference only (no GPU kernel yet)"
            }
            .into(),
        );
        table.row(cells);
    }
    let lines = [
        String::new(),
        format!(
            "bits/elem, saved: one sequence of {ctx} tokens, {} KV heads × head_dim {}: payload + \
             metadata + FP16 windows as allocated (CommVQ's shared codebooks not included).",
            opts.kv_heads, opts.head_dim
        ),
        format!(
            "attn err: ‖o − o*‖/‖o*‖ of one decode step against exact FP32 attention on a seeded \
             synthetic layer ({} tokens, {} KV heads × {}, GQA {}, outlier channels and sinks); \
             softmax MSE on the same step (CPU reference{}).",
            cfg.tokens,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.gqa,
            if opts.calibration > 0 {
                format!(", CommVQ trained on {} held-out tokens", opts.calibration)
            } else {
                String::new()
            }
        ),
    ];
    for l in lines {
        writeln_out(out, &l)?;
    }
    if gpu {
        writeln_out(
            out,
            &format!(
                "GPU: attn err (GPU) is the generated kernel's {} output on the same step; latency is \
                 the median of {} fused decodes (CUDA events) of {} × {ctx} tokens of random \
                 heavy-tailed K/V, {} KV heads, GQA {}; × FP16 = FP16 kernel's latency / this one's; \
                 launch = threads×tile split-K (default, or tuned from tune.json).",
                opts.dtype, opts.runs, opts.batch, opts.kv_heads, opts.gqa
            ),
        )?;
    }
    writeln_out(out, "")?;
    write!(out, "{}", table.render()).map_err(|source| CliError::Write {
        path: "<stdout>".into(),
        source,
    })?;
    if !problems.is_empty() {
        writeln_out(out, "")?;
        for p in problems {
            writeln_out(out, &format!("note: {p}"))?;
        }
    }
    writeln_out(out, "")?;
    Ok(())
}
