//! `kvq-bench`: decode latency and effective bandwidth of every GPU scheme over a grid of batch
//! sizes and context lengths, against the device-to-device copy bandwidth of the same run.
//!
//! Prints progress to stderr and the markdown table to stdout; `--out STEM` also writes
//! `STEM.md`, `STEM.json` and `STEM.svg`; `--replot JSON` redraws saved results without a GPU.
//! Exits with 2 when there is no usable GPU.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kvq::codegen::Dtype;
use kvq::runtime::{Device, Jit};
use kvq_bench::grid::{parse_schemes, parse_token_list, parse_usize_list};
use kvq_bench::{plot, BenchConfig, BenchError, BenchResults};

/// Decode benchmarks for kvq's fused quantized-KV attention kernels.
#[derive(Parser, Debug)]
#[command(name = "kvq-bench", version)]
struct Args {
    /// Schemes: entries separated by `;`, each `all`, a comma list of GPU built-ins, or scheme text
    /// (`"kivi2; k = int(1, channel), v = int(1, channel)"`); fp16 is always added, as the baseline.
    #[arg(long, default_value = "all")]
    schemes: String,
    /// Batch sizes, comma-separated.
    #[arg(long, default_value = "1,16")]
    batch: String,
    /// Context lengths, comma-separated (4096, 4K, 128K, …).
    #[arg(long, default_value = "4K,32K,128K")]
    context: String,
    /// Query heads per sequence.
    #[arg(long, default_value_t = 32)]
    q_heads: usize,
    /// KV heads per sequence.
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Channels per head.
    #[arg(long, default_value_t = 128)]
    head_dim: u32,
    /// Query/output dtype: f16 or bf16.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// Timed runs per configuration (median reported).
    #[arg(long, default_value_t = 30)]
    runs: usize,
    /// Untimed runs before each timing.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Tune every shape (results stored in the cache dir's tune.json) and time tuned vs default.
    #[arg(long)]
    tune: bool,
    /// Skip the check of outputs against the CPU reference.
    #[arg(long)]
    no_check: bool,
    /// Device memory one shape may use, GiB (larger shapes are skipped with a note).
    #[arg(long, default_value_t = 60.0)]
    mem_budget_gib: f64,
    /// Size of the device-to-device copy that measures bandwidth, GiB.
    #[arg(long, default_value_t = 4.0)]
    copy_gib: f64,
    /// Device memory set aside before anything else, MiB: moves every buffer to other addresses
    /// (placement alone changed some shapes' times by up to 15% on an H100).
    #[arg(long, default_value_t = 0)]
    pad_mib: u64,
    /// Write STEM.md, STEM.json and STEM.svg.
    #[arg(long, value_name = "STEM")]
    out: Option<PathBuf>,
    /// Free text recorded in the outputs (e.g. the commit).
    #[arg(long)]
    label: Option<String>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 2024)]
    seed: u64,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Measure nothing: read a results JSON written by `--out` and write its table and plot
    /// again (to `--out`, or beside the JSON). Needs no GPU.
    #[arg(long, value_name = "JSON")]
    replot: Option<PathBuf>,
}

fn config(args: &Args) -> Result<BenchConfig, BenchError> {
    let gib = |x: f64| (x.max(0.0) * (1u64 << 30) as f64) as u64;
    let dtype: Dtype = args.dtype.parse().map_err(BenchError::Usage)?;
    Ok(BenchConfig {
        schemes: parse_schemes(&args.schemes)?,
        batches: parse_usize_list(&args.batch)?,
        contexts: parse_token_list(&args.context)?,
        q_heads: args.q_heads,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        dtype,
        warmup: args.warmup,
        runs: args.runs.max(1),
        tune: args.tune,
        check: !args.no_check,
        memory_budget: gib(args.mem_budget_gib),
        copy_bytes: gib(args.copy_gib).max(1 << 20),
        placement_pad: args.pad_mib.saturating_mul(1 << 20),
        seed: args.seed,
    })
}

fn write(path: PathBuf, text: &str) -> Result<(), BenchError> {
    std::fs::write(&path, text).map_err(|source| BenchError::Write { path, source })
}

fn with_extension(stem: &std::path::Path, ext: &str) -> PathBuf {
    let mut s = stem.as_os_str().to_owned();
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

/// Writes STEM.md, STEM.json (unless `json` is `None`) and STEM.svg; reports each failure.
fn write_outputs(stem: &std::path::Path, results: &BenchResults, json: bool) {
    if let Some(dir) = stem.parent().filter(|d| !d.as_os_str().is_empty()) {
        let _ = std::fs::create_dir_all(dir);
    }
    let mut outputs = vec![
        write(with_extension(stem, "md"), &results.markdown()),
        plot::write_svg(results, &with_extension(stem, "svg")),
    ];
    if json {
        outputs.push(write(with_extension(stem, "json"), &results.json()));
    }
    for r in outputs {
        if let Err(e) = r {
            eprintln!("kvq-bench: {e}");
        }
    }
}

fn replot(json: &std::path::Path, out: Option<&std::path::Path>) -> ExitCode {
    let results = match BenchResults::read_json_file(json) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvq-bench: cannot read {}: {e}", json.display());
            return ExitCode::FAILURE;
        }
    };
    let stem = out.map_or_else(|| json.with_extension(""), std::path::Path::to_path_buf);
    write_outputs(&stem, &results, false);
    println!("{}", results.markdown());
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(json) = &args.replot {
        return replot(json, args.out.as_deref());
    }
    let config = match config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvq-bench: {e}");
            return ExitCode::from(64);
        }
    };
    let device = match Device::open(args.device) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kvq-bench: no usable GPU, nothing measured: {e}");
            return ExitCode::from(2);
        }
    };
    let jit = match Jit::new(&device) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("kvq-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let mut log = |line: &str| eprintln!("[kvq-bench] {line}");
    let results = match kvq_bench::run(&config, &jit, args.label.clone(), &mut log) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvq-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(stem) = &args.out {
        write_outputs(stem, &results, true);
    }
    println!("{}", results.markdown());
    ExitCode::SUCCESS
}
