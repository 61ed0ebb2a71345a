//! The command line: subcommands and flags (clap derive). Parsing only; `run` does the work.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use kvq::codegen::Dtype;

use crate::eval::KvLayout;
use crate::gen::CPrefix;

/// A parsed comma-separated list (one flag value, not repeated flags).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CommaList(pub Vec<usize>);

/// Parses `4096`, `4K`, `1M` (the bench runner's token-count syntax).
fn tokens(s: &str) -> Result<usize, String> {
    kvq_bench::grid::parse_tokens(s).map_err(|e| e.to_string())
}

/// Parses a comma list of token counts.
fn token_list(s: &str) -> Result<CommaList, String> {
    let v = kvq_bench::grid::parse_token_list(s).map_err(|e| e.to_string())?;
    if v.is_empty() {
        return Err("no value".into());
    }
    Ok(CommaList(v))
}

/// Parses a comma list of positive integers.
fn usize_list(s: &str) -> Result<CommaList, String> {
    let v = kvq_bench::grid::parse_usize_list(s).map_err(|e| e.to_string())?;
    if v.is_empty() {
        return Err("no value".into());
    }
    Ok(CommaList(v))
}

/// Parses a comma list of non-negative integers (layer indices).
fn index_list(s: &str) -> Result<CommaList, String> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<usize>()
                .map_err(|_| format!("`{t}` is not a layer index"))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(CommaList)
}

/// Quantized KV-cache attention: scheme DSL, CPU reference, JIT-generated GPU kernels.
#[derive(Parser, Debug)]
#[command(name = "kvq", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// What to do.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Every built-in scheme on synthetic K/V with outliers: memory, attention error and, with a
    /// GPU, fused-decode latency against FP16 (CPU reference table without one).
    Demo(DemoArgs),
    /// The built-in schemes: grammar text, bits per element, GPU kernel or CPU reference.
    Schemes(SchemesArgs),
    /// Write a scheme's CUDA sources, a C header and manifest.json for another engine (no GPU
    /// needed).
    Gen(GenArgs),
    /// Tune decode launches on this GPU and store the results (tune.json in the cache folder).
    Tune(TuneArgs),
    /// Decode latency and effective bandwidth of GPU schemes over batch sizes and contexts.
    Bench(BenchArgs),
    /// GPU, driver, NVRTC, cache folders and tuned entries of this machine.
    Info(InfoArgs),
    /// A scheme's error on your own captured K/V (safetensors), per layer and KV head.
    Eval(EvalArgs),
}

/// `kvq demo`.
#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// `all`, or a comma list of built-in names.
    #[arg(long, default_value = "all")]
    pub schemes: String,
    /// Cached tokens of the synthetic layer the attention error is measured on.
    #[arg(long, default_value_t = 2048)]
    pub tokens: usize,
    /// Held-out tokens of that layer CommVQ trains its codebooks on.
    #[arg(long, default_value_t = 1024)]
    pub calibration: usize,
    /// Context of the latency run and the memory columns (e.g. 4096, 32K).
    #[arg(long, default_value = "32K", value_parser = tokens)]
    pub context: usize,
    /// Sequences per decode in the latency run.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// KV heads of the latency run and memory columns.
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    /// Query heads per KV head in the latency run.
    #[arg(long, default_value_t = 4)]
    pub gqa: u32,
    /// Channels per head of the latency run and memory columns.
    #[arg(long, default_value_t = 128)]
    pub head_dim: u32,
    /// Query/output dtype of the GPU kernels: f16 or bf16.
    #[arg(long, default_value = "f16")]
    pub dtype: Dtype,
    /// Use the CPU reference only, even with a GPU.
    #[arg(long)]
    pub cpu: bool,
    /// Tune launches that have no stored result (as KVQ_TUNE=full) instead of using the default.
    #[arg(long)]
    pub tune: bool,
    /// Timed decodes per scheme (median reported).
    #[arg(long, default_value_t = 30)]
    pub runs: usize,
    /// Untimed decodes before timing.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Seed of the latency run's random K/V and queries.
    #[arg(long, default_value_t = 2024)]
    pub seed: u64,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

/// `kvq schemes`.
#[derive(Args, Debug, Clone)]
pub struct SchemesArgs {
    /// KV heads for the bits/element columns.
    #[arg(long, default_value_t = 8)]
    pub kv_heads: u32,
    /// Channels per head for the bits/element columns (any multiple of 16).
    #[arg(long, default_value_t = 128)]
    pub head_dim: u32,
}

/// `kvq gen`.
#[derive(Args, Debug, Clone)]
pub struct GenArgs {
    /// A built-in name (`kivi2`, …) or scheme text (`"k = int(2, channel), v = int(2, token)"`).
    #[arg(long)]
    pub scheme: String,
    /// Channels per head: a multiple of 16, at most 512; the tensor-core decode and the cache
    /// kernels take 64 to 256.
    #[arg(long)]
    pub head_dim: u32,
    /// Query/output dtype (and the dtype of new K/V the cache kernels take): f16 or bf16.
    #[arg(long, default_value = "f16")]
    pub dtype: Dtype,
    /// Query heads per KV head.
    #[arg(long, default_value_t = 1)]
    pub gqa: u32,
    /// Output folder (created if missing; files in it are overwritten).
    #[arg(long)]
    pub out: PathBuf,
    /// Also compile the sources with NVRTC for this architecture (e.g. sm_90a, sm_80) and write
    /// the CUBIN next to them.
    #[arg(long)]
    pub arch: Option<String>,
    /// Threads per CTA of the decode kernel (64, 128, 256); default: tuned, else the heuristic.
    #[arg(long)]
    pub threads: Option<u32>,
    /// Tokens per tile of the decode kernel (16, 32, 64); default: tuned, else the heuristic.
    #[arg(long)]
    pub tile_tokens: Option<u32>,
    /// Warps per SM the decode kernel's registers must leave room for (0: no floor, 12); default:
    /// tuned, else the heuristic.
    #[arg(long)]
    pub min_warps_per_sm: Option<u32>,
    /// Whether a decode kernel that can hold two 16-token subtiles in one score fragment does
    /// (Kitty's kernels at GQA ≤ 4; true or false); default: tuned, else true.
    #[arg(long)]
    pub pack_heads: Option<bool>,
    /// Whether a decode kernel whose ring stages 4-bit K and V takes the short staging path
    /// (KIVI-4's; true or false); default: tuned, else false (the runtime's untuned launches take
    /// it where a split warp's share of the context reaches 4096 tokens).
    #[arg(long)]
    pub short_staging: Option<bool>,
    /// Whether a calibrated scheme's range pass stores its keys' scores for the decode kernel,
    /// which then reads them instead of the keys (CalibQuant on the tensor-core kernel; true or
    /// false); default: tuned, else true (the runtime's untuned launches store them past 4096-token
    /// contexts).
    #[arg(long)]
    pub store_scores: Option<bool>,
    /// Tuning results to read (default: tune.json in the cache folder).
    #[arg(long)]
    pub tune_file: Option<PathBuf>,
    /// Prefix of every name in the C header: `kvq` gives `kvq_decode_params`, `kvq_decode_args`,
    /// `KVQ_DECODE_NAME`, `KVQ_HEAD_DIM`; names never carry a hash, so they stay put when the
    /// scheme or tuning changes. Give each header its own prefix to include several in one file.
    #[arg(long, default_value = "kvq")]
    pub prefix: CPrefix,
    /// XQuant schemes: KV heads of the model (with --d-model, it fixes the latent width).
    #[arg(long)]
    pub kv_heads: Option<u32>,
    /// XQuant schemes: the layer input's width (latents are min(d_model, kv_heads·head_dim) wide,
    /// padded to a multiple of 32).
    #[arg(long)]
    pub d_model: Option<u32>,
    /// XQuant schemes: how K is rebuilt from the latents, `f16` (one product of f16 roundings,
    /// the default) or `f32` (three split products, f32's precision).
    #[arg(long)]
    pub rebuild: Option<String>,
    /// Also write sample/: a small batch in the device layout, queries and the reference output.
    #[arg(long)]
    pub sample: bool,
    /// Tokens of each sample sequence.
    #[arg(long, default_value = "1,77,300,1000", value_parser = usize_list)]
    pub sample_lengths: CommaList,
    /// KV heads of the sample.
    #[arg(long, default_value_t = 2)]
    pub sample_kv_heads: usize,
    /// Seed of the sample's K/V and queries.
    #[arg(long, default_value_t = 7)]
    pub sample_seed: u64,
}

/// `kvq tune`.
#[derive(Args, Debug, Clone)]
pub struct TuneArgs {
    /// `all` (GPU built-ins), a comma list of built-in names, or scheme text.
    #[arg(long, default_value = "all")]
    pub scheme: String,
    /// Channels per head.
    #[arg(long, default_value_t = 128)]
    pub head_dim: u32,
    /// Query heads per KV head.
    #[arg(long, default_value_t = 4)]
    pub gqa: u32,
    /// Query/output dtype: f16 or bf16.
    #[arg(long, default_value = "f16")]
    pub dtype: Dtype,
    /// KV heads per sequence.
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    /// XQuant schemes: the layer input's width (their latents are min(d_model,
    /// kv_heads·head_dim) wide).
    #[arg(long, default_value_t = 4096)]
    pub d_model: usize,
    /// Batch sizes, comma-separated.
    #[arg(long, default_value = "1", value_parser = usize_list)]
    pub batch: CommaList,
    /// Context lengths, comma-separated (4096, 32K, …).
    #[arg(long, default_value = "32K", value_parser = token_list)]
    pub context: CommaList,
    /// Tune again even where a result is stored.
    #[arg(long)]
    pub force: bool,
    /// Stop timing new candidates of one shape after this many seconds.
    #[arg(long, default_value_t = 25.0)]
    pub budget_s: f64,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

/// `kvq bench`: the benchmark front end (kvq-bench's runner and outputs).
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Schemes: entries separated by `;`, each `all`, a comma list of GPU built-ins, or scheme text
    /// (`"kivi2; k = int(1, channel), v = int(1, channel)"`); fp16 is always added, as the baseline.
    #[arg(long, default_value = "all")]
    pub schemes: String,
    /// Batch sizes, comma-separated.
    #[arg(long, default_value = "1,16")]
    pub batch: String,
    /// Context lengths, comma-separated (4096, 4K, 128K, …).
    #[arg(long, default_value = "4K,32K,128K")]
    pub context: String,
    /// Query heads per sequence.
    #[arg(long, default_value_t = 32)]
    pub q_heads: usize,
    /// KV heads per sequence.
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    /// Channels per head.
    #[arg(long, default_value_t = 128)]
    pub head_dim: u32,
    /// XQuant schemes: the layer input's width (their latents are min(d_model,
    /// kv_heads·head_dim) wide).
    #[arg(long, default_value_t = 4096)]
    pub d_model: usize,
    /// Query/output dtype: f16 or bf16.
    #[arg(long, default_value = "f16")]
    pub dtype: Dtype,
    /// Timed runs per configuration (median reported).
    #[arg(long, default_value_t = 30)]
    pub runs: usize,
    /// Untimed runs before each timing.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Tune every shape (stored in tune.json) and time tuned against default.
    #[arg(long)]
    pub tune: bool,
    /// Skip the check of outputs against the CPU reference.
    #[arg(long)]
    pub no_check: bool,
    /// Device memory one shape may use, GiB.
    #[arg(long, default_value_t = 60.0)]
    pub mem_budget_gib: f64,
    /// Size of the device-to-device copy that measures bandwidth, GiB.
    #[arg(long, default_value_t = 4.0)]
    pub copy_gib: f64,
    /// Device memory set aside before anything else, MiB: moves every buffer to other addresses
    /// (placement alone changed some shapes' times by up to 15% on an H100).
    #[arg(long, default_value_t = 0)]
    pub pad_mib: u64,
    /// Write STEM.md, STEM.json and STEM.svg.
    #[arg(long, value_name = "STEM")]
    pub out: Option<PathBuf>,
    /// Free text recorded in the outputs (e.g. the commit).
    #[arg(long)]
    pub label: Option<String>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 2024)]
    pub seed: u64,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Measurement switch: pieces for the kernels that run them, instead of the launch rules'
    /// (`off`, `PER_SPLIT,PERMILLE` or `COUNT/PERMILLE`).
    #[arg(long, value_name = "PIECES")]
    pub pieces: Option<String>,
    /// Measurement switch: overlapped (programmatic dependent) launches `on` or `off` instead of
    /// the library's default.
    #[arg(long, value_name = "on|off")]
    pub pdl: Option<String>,
    /// Measure nothing: read a results JSON written by `--out` and write its table and plot again
    /// (to `--out`, or beside the JSON). Needs no GPU.
    #[arg(long, value_name = "JSON")]
    pub replot: Option<PathBuf>,
}

/// `kvq info`.
#[derive(Args, Debug, Clone)]
pub struct InfoArgs {
    /// GPU ordinal to describe.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

/// `kvq eval`.
#[derive(Args, Debug, Clone)]
pub struct EvalArgs {
    /// A built-in name or scheme text.
    #[arg(long)]
    pub scheme: String,
    /// safetensors file with `layer.{i}.k`, `layer.{i}.v` and optional `layer.{i}.q`, and what
    /// CommVQ and XQuant read besides (docs/CLI.md).
    #[arg(long)]
    pub kv: PathBuf,
    /// Axis order of the K/V tensors.
    #[arg(long, value_enum, default_value_t = KvLayout::TokensFirst)]
    pub layout: KvLayout,
    /// Only these layers (comma-separated indices; default: every layer in the file).
    #[arg(long, value_parser = index_list, default_value = "")]
    pub layers: CommaList,
    /// Use the CPU reference only, even with a GPU.
    #[arg(long)]
    pub cpu: bool,
    /// The model's RoPE base θ (CommVQ and XQuant schemes apply RoPE themselves).
    #[arg(long)]
    pub rope_theta: Option<f64>,
    /// With a whole sequence's queries, evaluate the last token's only (as CommVQ and XQuant
    /// always are), so that every scheme is measured at the same step.
    #[arg(long)]
    pub last_query: bool,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Print the results as JSON (per layer and KV head) instead of the table.
    #[arg(long)]
    pub json: bool,
}
