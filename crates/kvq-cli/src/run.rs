//! Runs a parsed command: each subcommand turns its flags into the library call it fronts and
//! prints the result; every failure comes back as a [`CliError`].

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use kvq::codegen::{has_codebook_kernel, has_xquant_kernel, KernelShape, RebuildPrecision};
use kvq::evaluate;
use kvq::runtime::codebook::{codebook_problem_key, CodebookLaunch};
use kvq::runtime::decode::{DecodeOptions, PiecesOverride};
use kvq::runtime::tune::{TuneOptions, TuneProblem, Tuner};
use kvq::runtime::{Arch, InvalidArch};
use kvq::schemes::BUILTIN;
use kvq_bench::grid::{format_tokens, parse_schemes, parse_token_list, parse_usize_list};
use kvq_bench::BenchConfig;

use crate::cli::{
    BenchArgs, Cli, Command, DemoArgs, EvalArgs, GenArgs, InfoArgs, SchemesArgs, TuneArgs,
};
use crate::demo::{self, DemoOptions};
use crate::error::{CliError, Result};
use crate::eval::{self, EvalOptions};
use crate::gen::{self, GenRequest, XQuantRequest};
use crate::gpu;
use crate::info;
use crate::sample::SampleSpec;
use crate::scheme::{self, resolve, resolve_list, Resolved};
use crate::table::{Align, Table};
use crate::tune_xquant;

fn print(out: &mut dyn Write, text: &str) -> Result<()> {
    out.write_all(text.as_bytes())
        .and_then(|_| out.flush())
        .map_err(|source| CliError::Write {
            path: PathBuf::from("<stdout>"),
            source,
        })
}

/// Runs `cli`, writing results to `out` (progress and warnings go to stderr).
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<()> {
    match cli.command {
        Command::Demo(a) => demo_cmd(a, out),
        Command::Schemes(a) => schemes_cmd(a, out),
        Command::Gen(a) => gen_cmd(a, out),
        Command::Tune(a) => tune_cmd(a, out),
        Command::Bench(a) => bench_cmd(a, out),
        Command::Info(a) => info_cmd(a, out),
        Command::Eval(a) => eval_cmd(a, out),
    }
}

fn positive(what: &str, n: usize) -> Result<()> {
    if n == 0 {
        return Err(CliError::Usage(format!("{what} must be at least 1")));
    }
    Ok(())
}

fn demo_cmd(a: DemoArgs, out: &mut dyn Write) -> Result<()> {
    positive("--tokens", a.tokens)?;
    positive("--batch", a.batch)?;
    positive("--kv-heads", a.kv_heads)?;
    positive("--gqa", a.gqa as usize)?;
    positive("--runs", a.runs)?;
    let mut schemes = resolve_list(&a.schemes, false)?;
    // FP16 is every speedup's baseline.
    if !schemes.iter().any(|s| s.name == Some("fp16")) {
        schemes.insert(0, resolve("fp16")?);
    }
    let opts = DemoOptions {
        schemes,
        tokens: a.tokens,
        calibration: a.calibration,
        context: a.context,
        batch: a.batch,
        kv_heads: a.kv_heads,
        gqa: a.gqa,
        head_dim: a.head_dim,
        dtype: a.dtype,
        cpu_only: a.cpu,
        tune: a.tune,
        warmup: a.warmup,
        runs: a.runs,
        device: a.device,
        seed: a.seed,
    };
    demo::run(&opts, out)
}

fn schemes_cmd(a: SchemesArgs, out: &mut dyn Write) -> Result<()> {
    let mut t = Table::new(&[
        ("name", Align::Left),
        ("bits @4K", Align::Right),
        ("bits @32K", Align::Right),
        ("saved @32K", Align::Right),
        ("runs on", Align::Left),
        ("scheme text", Align::Left),
    ]);
    let mut refused = Vec::new();
    for b in BUILTIN {
        let at = |len| evaluate::memory(&b.spec, a.head_dim, a.kv_heads, len);
        let cells = match (at(4096), at(32768)) {
            (Ok(m4), Ok(m32)) => [
                format!("{:.3}", m4.bits_per_element()),
                format!("{:.3}", m32.bits_per_element()),
                format!("{:.1}%", 100.0 * m32.saved_vs_fp16()),
            ],
            // A rule of this scheme alone (CommVQ's codes of 64 RoPE pairs need head_dim a
            // multiple of 128) empties its row; a head_dim no scheme takes stays an error.
            (Err(evaluate::EvalError::Reference(kvq::reference::RefError::Shape(e))), _)
                if !matches!(e, kvq::ShapeError::HeadDim(_)) =>
            {
                refused.push(format!("{}: {e}", b.name));
                ["–".into(), "–".into(), "–".into()]
            }
            (Err(e), _) | (_, Err(e)) => return Err(e.into()),
        };
        let [bits4, bits32, saved] = cells;
        t.row(vec![
            b.name.to_string(),
            bits4,
            bits32,
            saved,
            if kvq::codegen::has_decode_kernel(&b.spec) || has_codebook_kernel(&b.spec) {
                "GPU + CPU"
            } else {
                "CPU only"
            }
            .to_string(),
            b.spec.to_string(),
        ]);
    }
    let text = format!(
        "{} built-in schemes. bits = effective bits per K/V element of one sequence ({} KV heads × \
         head_dim {}): payload + metadata + FP16 windows as allocated.\n\n{}\n\
         Use a name or any scheme text with --scheme (grammar: docs/GRAMMAR.md).\n",
        BUILTIN.len(),
        a.kv_heads,
        a.head_dim,
        t.render()
    );
    let notes: String = refused
        .iter()
        .map(|r| format!("not at this shape: {r}\n"))
        .collect();
    print(out, &(text + &notes))
}

fn parse_arch(text: &str) -> Result<Arch> {
    text.parse::<Arch>()
        .map_err(|e: InvalidArch| CliError::Usage(format!("--arch: {e}")))
}

fn gen_cmd(a: GenArgs, out: &mut dyn Write) -> Result<()> {
    let scheme = resolve(&a.scheme)?;
    positive("--gqa", a.gqa as usize)?;
    let arch = a.arch.as_deref().map(parse_arch).transpose()?;
    let shape = KernelShape::new(a.head_dim, a.gqa, a.dtype);
    let req = GenRequest {
        scheme: scheme.clone(),
        shape,
        out: a.out.clone(),
        arch,
        threads: a.threads,
        tile_tokens: a.tile_tokens,
        min_warps_per_sm: a.min_warps_per_sm,
        pack_heads: a.pack_heads,
        short_staging: a.short_staging,
        store_scores: a.store_scores,
        tune_file: a.tune_file.clone(),
        prefix: a.prefix.clone(),
        xquant: XQuantRequest {
            kv_heads: a.kv_heads,
            d_model: a.d_model,
            rebuild: match a.rebuild.as_deref() {
                None => None,
                Some("f16") => Some(RebuildPrecision::F16),
                Some("f32") => Some(RebuildPrecision::F32),
                Some(other) => {
                    return Err(CliError::Usage(format!(
                        "--rebuild: `{other}` (f16 or f32)"
                    )))
                }
            },
        },
        sample: a.sample.then(|| SampleSpec {
            lengths: a.sample_lengths.0.clone(),
            kv_heads: a.sample_kv_heads,
            seed: a.sample_seed,
            ..SampleSpec::default()
        }),
    };
    let outcome = gen::generate(&req)?;
    let mut s = format!(
        "kvq gen: {} ({}), head_dim {}, gqa {}, {} → {}\n",
        scheme.label(),
        scheme.spec,
        shape.head_dim,
        shape.gqa,
        shape.dtype,
        a.out.display()
    );
    for (path, bytes) in &outcome.files {
        let shown = path.strip_prefix(&a.out).unwrap_or(path);
        s.push_str(&format!(
            "  wrote {:<28} {bytes:>9} bytes\n",
            shown.display()
        ));
    }
    s.push_str("kernels:\n");
    for k in &outcome.kernels {
        s.push_str(&format!("  {k}\n"));
    }
    for c in &outcome.compiled {
        s.push_str(&format!("{c}\n"));
    }
    for n in &outcome.notes {
        s.push_str(&format!("note: {n}\n"));
    }
    print(out, &s)
}

fn tune_cmd(a: TuneArgs, out: &mut dyn Write) -> Result<()> {
    positive("--kv-heads", a.kv_heads)?;
    positive("--gqa", a.gqa as usize)?;
    let schemes = resolve_list(&a.scheme, true)?;
    let shape = KernelShape::new(a.head_dim, a.gqa, a.dtype);
    // Refuse bad shapes before spending time on the GPU (XQuant's kernel generator checks its
    // own when the kernel loads).
    for s in &schemes {
        if has_xquant_kernel(&s.spec) {
            positive("--d-model", a.d_model)?;
            continue;
        }
        TuneProblem::new(s.spec, shape, a.kv_heads, 1, 1)
            .check()
            .map_err(|e| CliError::Usage(e.to_string()))?;
    }
    if !(a.budget_s.is_finite() && a.budget_s > 0.0) {
        return Err(CliError::Usage("--budget-s must be positive".into()));
    }
    let g = gpu::open(a.device)?;
    let mut tuner = Tuner::new(&g.jit)?;
    tuner.set_options(TuneOptions {
        time_budget: Duration::from_secs_f64(a.budget_s),
        ..TuneOptions::default()
    });
    print(out, &format!("{}\n", g.device.props()))?;
    let mut t = Table::new(&[
        ("scheme", Align::Left),
        ("batch", Align::Right),
        ("context", Align::Right),
        ("result", Align::Left),
        ("launch", Align::Left),
        ("default µs", Align::Right),
        ("tuned µs", Align::Right),
        ("gain", Align::Right),
        ("candidates", Align::Right),
        ("rejected", Align::Right),
        ("time s", Align::Right),
    ]);
    for s in &schemes {
        for &batch in &a.batch.0 {
            for &context in &a.context.0 {
                let problem = TuneProblem::new(s.spec, shape, a.kv_heads, batch, context);
                let row = if has_codebook_kernel(&s.spec) {
                    codebook_tune_row(&mut tuner, s, &problem, a.force)?
                } else if has_xquant_kernel(&s.spec) {
                    let (label, force) = (s.label(), a.force);
                    tune_xquant::row(&g, &mut tuner, &label, &problem, a.d_model, force)?
                } else {
                    tune_row(&mut tuner, s, &problem, a.force)?
                };
                let mut cells = vec![s.label(), batch.to_string(), format_tokens(context)];
                cells.extend(row);
                t.row(cells);
            }
        }
    }
    print(
        out,
        &format!(
            "\n{}\nresults: {} (kvq demo, kvq gen and the runtime use them under KVQ_TUNE=cached, \
             the default)\n",
            t.render(),
            tuner.store().path().display()
        ),
    )
}

/// `--pieces` and `--pdl`: the measurement switches a bench may set, which the library itself
/// never reads from the environment.
fn bench_switches(a: &BenchArgs) -> Result<DecodeOptions> {
    let pieces = match &a.pieces {
        None => None,
        Some(text) => Some(PiecesOverride::parse(text).ok_or_else(|| {
            CliError::Usage(format!(
                "--pieces `{text}`: expected `off`, `PER_SPLIT,PERMILLE` or `COUNT/PERMILLE` \
                 (PERMILLE in 1..999)"
            ))
        })?),
    };
    let pdl = match a.pdl.as_deref() {
        None => None,
        Some("on") => Some(true),
        Some("off") => Some(false),
        Some(other) => {
            return Err(CliError::Usage(format!(
                "--pdl `{other}`: expected `on` or `off`"
            )))
        }
    };
    Ok(DecodeOptions { pieces, pdl })
}

fn bench_cmd(a: BenchArgs, out: &mut dyn Write) -> Result<()> {
    if let Some(json) = &a.replot {
        let (results, written) = kvq_bench::output::replot(json, a.out.as_deref())?;
        for path in written {
            eprintln!("[kvq bench] wrote {}", path.display());
        }
        return print(out, &format!("{}\n", results.markdown()));
    }
    positive("--d-model", a.d_model)?;
    let gib = |x: f64| (x.max(0.0) * (1u64 << 30) as f64) as u64;
    let config = BenchConfig {
        schemes: parse_schemes(&a.schemes)?,
        batches: parse_usize_list(&a.batch)?,
        contexts: parse_token_list(&a.context)?,
        q_heads: a.q_heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        d_model: a.d_model,
        dtype: a.dtype,
        warmup: a.warmup,
        runs: a.runs.max(1),
        tune: a.tune,
        check: !a.no_check,
        memory_budget: gib(a.mem_budget_gib),
        copy_bytes: gib(a.copy_gib).max(1 << 20),
        placement_pad: a.pad_mib.saturating_mul(1 << 20),
        seed: a.seed,
        launch: bench_switches(&a)?,
    };
    config.gqa()?;
    let g = gpu::open(a.device)?;
    let mut log = |line: &str| eprintln!("[kvq bench] {line}");
    let results = kvq_bench::run(&config, &g.jit, a.label.clone(), &mut log)?;
    if let Some(stem) = &a.out {
        kvq_bench::output::write_files(stem, &results, true)?;
        eprintln!(
            "[kvq bench] wrote {}.{{md,json,svg}}",
            stem.as_os_str().to_string_lossy()
        );
    }
    print(out, &format!("{}\n", results.markdown()))
}

fn info_cmd(a: InfoArgs, out: &mut dyn Write) -> Result<()> {
    print(out, &info::report(a.device))
}

fn eval_cmd(a: EvalArgs, out: &mut dyn Write) -> Result<()> {
    let opts = EvalOptions {
        scheme: scheme::resolve(&a.scheme)?,
        file: a.kv.clone(),
        layout: a.layout,
        layers: a.layers.0.clone(),
        cpu_only: a.cpu,
        device: a.device,
        json: a.json,
        rope_theta: a.rope_theta,
        last_query: a.last_query,
    };
    print(out, &eval::run(&opts)?)
}

/// `kvq tune`'s cells for an integer or FP16 scheme: its stored result, or a tuning session now.
fn tune_row(
    tuner: &mut Tuner<'_>,
    s: &Resolved,
    problem: &TuneProblem,
    force: bool,
) -> Result<Vec<String>> {
    let stored = if force {
        None
    } else {
        tuner.store().lookup(tuner.gpu(), &problem.key()).cloned()
    };
    Ok(match stored {
        Some(e) => stored_cells(&e, e.choice.to_string()),
        None => {
            eprintln!(
                "[kvq tune] {} batch {} context {}",
                s.label(),
                problem.batch,
                format_tokens(problem.max_len)
            );
            let r = tuner.tune(problem)?;
            vec![
                if r.truncated {
                    "tuned (budget hit)"
                } else {
                    "tuned"
                }
                .to_string(),
                r.chosen.to_string(),
                format!("{:.1}", r.default_us),
                format!("{:.1}", r.chosen_us),
                format!("{:.3}", r.speedup()),
                r.candidates.len().to_string(),
                r.rejected().to_string(),
                format!("{:.1}", r.elapsed.as_secs_f64()),
            ]
        }
    })
}

/// `kvq tune`'s cells for a codebook scheme (CommVQ): its stored launch, or a tuning session on
/// synthetic caches coded on the GPU.
fn codebook_tune_row(
    tuner: &mut Tuner<'_>,
    s: &Resolved,
    problem: &TuneProblem,
    force: bool,
) -> Result<Vec<String>> {
    let key = codebook_problem_key(problem)?;
    let stored = if force {
        None
    } else {
        tuner.store().lookup(tuner.gpu(), &key).cloned()
    };
    if let Some(e) = stored {
        let launch = match e.codebook {
            Some(params) => CodebookLaunch {
                params,
                splits: e.choice.splits,
            }
            .to_string(),
            None => e.choice.to_string(),
        };
        return Ok(stored_cells(&e, launch));
    }
    eprintln!(
        "[kvq tune] {} batch {} context {} (codebooks trained briefly, caches coded on the GPU)",
        s.label(),
        problem.batch,
        format_tokens(problem.max_len)
    );
    let started = std::time::Instant::now();
    let r = tuner.tune_codebook(problem)?;
    Ok(vec![
        "tuned".to_string(),
        r.chosen.to_string(),
        format!("{:.1}", r.default_us),
        format!("{:.1}", r.chosen_us),
        format!("{:.3}", r.speedup()),
        r.candidates.to_string(),
        r.rejected.to_string(),
        format!("{:.1}", started.elapsed().as_secs_f64()),
    ])
}

/// The cells of a stored result.
pub(crate) fn stored_cells(e: &kvq::runtime::tune::TuneEntry, launch: String) -> Vec<String> {
    vec![
        "stored".to_string(),
        launch,
        format!("{:.1}", e.default_us),
        format!("{:.1}", e.tuned_us),
        format!("{:.3}", e.default_us / e.tuned_us.max(f64::MIN_POSITIVE)),
        e.candidates.to_string(),
        e.rejected.to_string(),
        "–".to_string(),
    ]
}
