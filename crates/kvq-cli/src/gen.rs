//! `kvq gen`: everything another engine needs to run kvq's kernels without kvq — the generated
//! CUDA sources, a C header with each entry point and a parameter struct per kernel, and a
//! `manifest.json` with launch shapes, the page-block layout and tuned values. Works without a GPU;
//! `--arch` also compiles the sources with NVRTC (where it loads) to check them.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kvq::codegen::{
    cache_kernels, decode_kernels, short_staging_changes, store_scores_changes, Dtype, KernelEntry,
    KernelShape, PieceRule, TuneParams,
};
use kvq::reference::int::{fp16_block_bytes, IntLayout, Section};
use kvq::runtime::nvrtc::{self, CompileOptions, Output, Source};
use kvq::runtime::tune::{TuneEntry, TuneStore};
use kvq::runtime::{Arch, RuntimeError};
use kvq::{Axis, BoostCriterion, SchemeSpec, TensorQuant};
use serde::Serialize;

use crate::error::{CliError, Result};
use crate::sample::{self, SampleSpec};
use crate::scheme::Resolved;

/// The layout version lives with the layout it names (kvq-reference), so it moves with any byte.
pub use kvq::reference::int::LAYOUT_VERSION;

/// Identifies the manifest's format; `MANIFEST_VERSION` changes when a field changes meaning.
pub const MANIFEST_FORMAT: &str = "kvq-gen";
/// See [`MANIFEST_FORMAT`].
pub const MANIFEST_VERSION: u32 = 3;

/// File names inside the output folder.
pub const DECODE_FILE: &str = "decode.cu";
/// See [`DECODE_FILE`].
pub const CACHE_FILE: &str = "cache.cu";
/// See [`DECODE_FILE`].
pub const HEADER_FILE: &str = "kvq_kernels.h";
/// See [`DECODE_FILE`].
pub const MANIFEST_FILE: &str = "manifest.json";

/// What `kvq gen` was asked for.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub scheme: Resolved,
    pub shape: KernelShape,
    pub out: PathBuf,
    /// Compile with NVRTC for this architecture.
    pub arch: Option<Arch>,
    /// Block parameters from the flags (each overrides the tuned or default value).
    pub threads: Option<u32>,
    pub tile_tokens: Option<u32>,
    pub min_warps_per_sm: Option<u32>,
    pub pack_heads: Option<bool>,
    pub short_staging: Option<bool>,
    pub store_scores: Option<bool>,
    /// Where tuned results are read from (`None`: the default `tune.json`).
    pub tune_file: Option<PathBuf>,
    /// Also write a sample batch with its reference output.
    pub sample: Option<SampleSpec>,
}

/// What was written, for the listing and for tests.
#[derive(Debug, Clone)]
pub struct GenOutcome {
    pub files: Vec<(PathBuf, u64)>,
    pub kernels: Vec<String>,
    pub compiled: Vec<String>,
    pub notes: Vec<String>,
}

#[derive(Serialize)]
struct SchemeInfo {
    name: Option<String>,
    text: String,
    /// `SchemeSpec::stable_hash`, the key tuned results are stored under.
    hash: String,
}

#[derive(Serialize)]
struct ParamInfo {
    index: usize,
    name: String,
    c_type: String,
    bytes: usize,
    /// Offset in the kernel's packed parameter buffer and in the header's struct (natural
    /// alignment), for `CU_LAUNCH_PARAM_BUFFER_POINTER`.
    offset: usize,
    about: String,
}

#[derive(Serialize)]
struct KernelInfo {
    role: String,
    file: String,
    name: String,
    about: String,
    params: Vec<ParamInfo>,
    param_bytes: usize,
    grid: [String; 3],
    block: [u32; 3],
    dynamic_shared_bytes: u32,
    /// Decode only: whether its piece CTAs do work when `num_pieces > 0`; without, the splits do
    /// all the work and the piece CTAs only mark their partials empty.
    #[serde(skip_serializing_if = "Option::is_none")]
    runs_pieces: Option<bool>,
}

#[derive(Serialize)]
struct SectionInfo {
    offset: usize,
    bytes: usize,
}

impl From<Section> for SectionInfo {
    fn from(s: Section) -> Self {
        SectionInfo {
            offset: s.offset,
            bytes: s.bytes,
        }
    }
}

#[derive(Serialize)]
struct BoostInfo {
    bits: u8,
    high_bits: u8,
    channels: usize,
    by: String,
    high_row_words: usize,
}

#[derive(Serialize)]
struct TensorInfo {
    /// `fp16` or `int`.
    kind: String,
    text: String,
    block_bytes: usize,
    /// FP16 local window (tokens) and tail ring capacity (`local + page`); 0 for FP16 tensors.
    local: u32,
    tail_capacity: u32,
    bits: Option<u8>,
    axis: Option<String>,
    symmetric: Option<bool>,
    /// Channels per scale on the token axis (`head_dim` on the channel axis).
    group: Option<usize>,
    /// Scale (and zero) entries per block.
    scale_count: Option<usize>,
    /// Symmetric codes are stored offset-binary: `code − offset` is the signed value.
    code_offset: Option<u32>,
    row_words: Option<usize>,
    sections: BTreeMap<String, SectionInfo>,
    boost: Option<BoostInfo>,
}

#[derive(Serialize)]
struct BufferInfo {
    name: String,
    shape: String,
    element: String,
    about: String,
}

#[derive(Serialize)]
struct LayoutInfo {
    version: String,
    doc: String,
    head_dim: u32,
    page_tokens: u32,
    sink: u32,
    k: TensorInfo,
    v: TensorInfo,
    /// How a sequence's tokens split into sink, quantized pages and tail ring.
    regions: Vec<String>,
    buffers: Vec<BufferInfo>,
}

#[derive(Serialize)]
struct TunedInfo {
    gpu: String,
    compute_capability: (u32, u32),
    sm_count: u32,
    kv_heads: usize,
    batch_bucket: usize,
    context_bucket: usize,
    threads: u32,
    tile_tokens: u32,
    min_warps_per_sm: u32,
    pack_heads: bool,
    short_staging: bool,
    store_scores: bool,
    splits: usize,
    /// The tuned launch's `num_pieces` and `piece_permille` (0 and 0: none).
    num_pieces: usize,
    piece_permille: u32,
    tuned_us: f64,
    default_us: f64,
    /// Whether the sources in this folder were generated with this entry's block parameters.
    matches_source: bool,
}

#[derive(Serialize)]
struct TuneInfo {
    threads: u32,
    tile_tokens: u32,
    /// Warps per SM the decode kernel's `__launch_bounds__` reserves registers for (0: none).
    min_warps_per_sm: u32,
    /// Whether a kernel that can hold two subtiles in one score fragment does (Kitty's at GQA ≤ 4).
    pack_heads: bool,
    /// Whether a kernel whose ring stages 4-bit K and V takes the short staging path (KIVI-4's;
    /// every other ring kernel always does).
    short_staging: bool,
    /// Whether a calibrated scheme's range pass stores its keys' scores for the decode kernel
    /// (launch.stores_scores says whether these kernels do).
    store_scores: bool,
    /// `default`, `tuned` or `flags`.
    source: String,
    tune_file: Option<String>,
    /// The block (threads, tile) of the runtime's untuned launches, by batch shape and context.
    default_block: String,
    /// Split-K count when no tuned entry covers the launch (`sm_count` of the GPU).
    default_splits: String,
    /// `num_pieces` and `piece_permille` when no tuned entry covers the launch.
    default_pieces: String,
    /// When the runtime's untuned launches take the short staging path (kernels generated with
    /// `short_staging` true).
    default_short_staging: String,
    /// When the runtime's untuned launches store a calibrated scheme's key scores (kernels
    /// generated with `store_scores` true).
    default_store_scores: String,
    /// Where the runtime's untuned launches depend on the GPU's memory bandwidth an SM (KIVI-4's
    /// twelve warps an SM on fast memory).
    default_fast_memory: String,
    tuned: Vec<TunedInfo>,
}

#[derive(Serialize)]
struct LaunchInfo {
    /// Kernels of one decode step, in stream order.
    decode_steps: Vec<String>,
    num_splits: String,
    /// The score-range grid's split count, which decode is given as `range_splits`.
    range_splits: String,
    /// What decode's `num_pieces` and `piece_permille` do.
    num_pieces: String,
    /// Whether score_range stores the keys' scores for decode (the `scores` scratch buffer).
    stores_scores: bool,
    scratch: Vec<BufferInfo>,
    notes: Vec<String>,
}

#[derive(Serialize)]
struct CompiledInfo {
    file: String,
    arch: String,
    nvrtc: String,
    bytes: usize,
}

#[derive(Serialize)]
struct Manifest {
    format: String,
    version: u32,
    kvq_version: String,
    layout_version: String,
    scheme: SchemeInfo,
    shape: KernelShape,
    files: BTreeMap<String, String>,
    kernels: Vec<KernelInfo>,
    launch: LaunchInfo,
    layout: LayoutInfo,
    tune: TuneInfo,
    compiled: Vec<CompiledInfo>,
    sample: Option<String>,
}

/// Bytes and alignment of a parameter's C type (pointers and `int32_t` are all kvq uses).
fn c_type_size(c_type: &str) -> usize {
    if c_type.ends_with('*') || c_type.contains("64") {
        8
    } else if c_type.contains("16") {
        2
    } else if c_type.contains('8') {
        1
    } else {
        4
    }
}

/// What each parameter name means (docs/KERNELS.md "Device buffers").
fn about_param(name: &str, dtype: Dtype) -> String {
    let io = match dtype {
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
    };
    match name {
        "q" => format!("queries [batch][q_heads][head_dim] {io} (q_heads = kv_heads·gqa)"),
        "out" => format!(
            "outputs [batch][q_heads][head_dim] {io} (decode writes them itself when its grid has \
             one part, gridDim.x = num_splits + num_pieces = 1, and may be given null)"
        ),
        "k_pool" | "v_pool" | "pool" => {
            "page blocks [physical_page][kv_head][block_bytes] (layout.k/v)".into()
        }
        "page_table" => {
            "[batch][max_pages] i32: logical page slot → physical page (K and V share it)".into()
        }
        "max_pages" => "columns of page_table".into(),
        "k_sink" | "v_sink" => "FP16 sink [batch][kv_heads][sink][head_dim]".into(),
        "k_tail" | "v_tail" | "tail" => {
            "FP16 tail ring [batch][kv_heads][tail_capacity][head_dim]".into()
        }
        "seq_lens" => "[batch] i32 tokens per sequence".into(),
        "score_range" => {
            "f32 [batch][kv_heads][gqa][range_splits][2] (CalibQuant score ranges; unused otherwise)"
                .into()
        }
        "scores" => {
            "f32 stored key scores, written by score_range and read by decode where the manifest's \
             launch.scratch sizes them (CalibQuant on the tensor-core kernel); unused otherwise"
                .into()
        }
        "part_acc" => {
            "f32 [batch·q_heads][num_splits + num_pieces][head_dim] partial outputs (splits, then \
             pieces)"
                .into()
        }
        "part_ml" => {
            "f32 [batch·q_heads][num_splits + num_pieces][2] partials' (max, denominator)".into()
        }
        "range_splits" => {
            "gridDim.x of the score_range launch: the ranges per head decode reduces \
             (launch.range_splits; ignored without calibration)"
                .into()
        }
        "num_pieces" => {
            "piece CTAs per (sequence, KV head), after the splits' (gridDim.x = num_splits + \
             num_pieces); 0: none (launch.num_pieces)"
                .into()
        }
        "piece_permille" => {
            "thousandths of each (sequence, KV head)'s cost the pieces cover, 1..=999 (ignored \
             when num_pieces = 0)"
                .into()
        }
        "num_parts" => {
            "partials per query head: num_splits + num_pieces of the decode launch".into()
        }
        "k_new" | "v_new" => format!("new tokens [n][kv_heads][head_dim] {io}"),
        "slots" => "[n] i32 sequence slots (rows of page_table/seq_lens)".into(),
        "k_in" | "v_in" | "x" => format!("prefill input [tokens][kv_heads][head_dim] {io}"),
        "tokens" => "prompt tokens".into(),
        "slot" => "the sequence's slot".into(),
        "jobs" => "[jobs][2] i32 (first input token, physical page)".into(),
        "n" => "entries of slots".into(),
        _ => String::new(),
    }
}

fn kernel_info(role: &str, file: &str, about: &str, e: &KernelEntry, dtype: Dtype) -> KernelInfo {
    let mut offset = 0usize;
    let params: Vec<ParamInfo> = e
        .params
        .iter()
        .enumerate()
        .map(|(index, (ty, name))| {
            let bytes = c_type_size(ty);
            offset = offset.div_ceil(bytes) * bytes;
            let p = ParamInfo {
                index,
                name: name.clone(),
                c_type: ty.clone(),
                bytes,
                offset,
                about: about_param(name, dtype),
            };
            offset += bytes;
            p
        })
        .collect();
    KernelInfo {
        role: role.into(),
        file: file.into(),
        name: e.name.clone(),
        about: about.into(),
        params,
        param_bytes: offset.div_ceil(8) * 8,
        grid: e.grid.clone(),
        block: [e.block, 1, 1],
        dynamic_shared_bytes: e.dynamic_shared_bytes,
        runs_pieces: None,
    }
}

fn tensor_info(spec: &SchemeSpec, t: &TensorQuant, head_dim: usize) -> Result<TensorInfo> {
    let page = spec.page as usize;
    match t {
        TensorQuant::Fp16 => Ok(TensorInfo {
            kind: "fp16".into(),
            text: t.to_string(),
            block_bytes: fp16_block_bytes(head_dim, page),
            local: 0,
            tail_capacity: 0,
            bits: None,
            axis: None,
            symmetric: None,
            group: None,
            scale_count: None,
            code_offset: None,
            row_words: None,
            sections: BTreeMap::from([(
                "rows".to_string(),
                SectionInfo {
                    offset: 0,
                    bytes: page * head_dim * 2,
                },
            )]),
            boost: None,
        }),
        TensorQuant::Int(q) => {
            let l = IntLayout::new(q, head_dim, page)
                .map_err(|e| CliError::Unsupported(format!("layout of `{t}`: {e}")))?;
            let local = spec.local_of(t);
            let mut sections = BTreeMap::new();
            sections.insert("codes".to_string(), l.codes.into());
            sections.insert("scales".to_string(), l.scales.into());
            if l.zeros.bytes > 0 {
                sections.insert("zeros".to_string(), l.zeros.into());
            }
            if l.high.bytes > 0 {
                sections.insert("high".to_string(), l.high.into());
            }
            if l.map.bytes > 0 {
                sections.insert("map".to_string(), l.map.into());
            }
            if l.slots.bytes > 0 {
                sections.insert("slots".to_string(), l.slots.into());
            }
            Ok(TensorInfo {
                kind: "int".into(),
                text: t.to_string(),
                block_bytes: l.block_bytes,
                local,
                tail_capacity: local + spec.page,
                bits: Some(q.bits),
                axis: Some(
                    match q.axis {
                        Axis::Channel => "channel",
                        Axis::Token => "token",
                    }
                    .into(),
                ),
                symmetric: Some(q.symmetric),
                group: Some(l.group),
                scale_count: Some(l.scale_count()),
                code_offset: Some(l.quant.offset()),
                row_words: Some(l.row_words),
                sections,
                boost: l.boost.map(|b| BoostInfo {
                    bits: b.bits,
                    high_bits: b.high_bits,
                    channels: b.channels,
                    by: match b.by {
                        BoostCriterion::Magnitude => "magnitude",
                        BoostCriterion::Variance => "variance",
                    }
                    .into(),
                    high_row_words: b.high_row_words,
                }),
            })
        }
        TensorQuant::Codebook(_) => Err(CliError::Unsupported(format!(
            "`{t}`: codebook tensors have no GPU layout yet (the CPU reference covers them)"
        ))),
    }
}

fn buffer(name: &str, shape: &str, element: &str, about: &str) -> BufferInfo {
    BufferInfo {
        name: name.into(),
        shape: shape.into(),
        element: element.into(),
        about: about.into(),
    }
}

fn layout_info(spec: &SchemeSpec, shape: &KernelShape) -> Result<LayoutInfo> {
    let d = shape.head_dim as usize;
    let io = shape.dtype.to_string();
    Ok(LayoutInfo {
        version: LAYOUT_VERSION.into(),
        doc: "docs/LAYOUT.md (page blocks, regions), docs/KERNELS.md (device buffers)".into(),
        head_dim: shape.head_dim,
        page_tokens: spec.page,
        sink: spec.sink,
        k: tensor_info(spec, &spec.k, d)?,
        v: tensor_info(spec, &spec.v, d)?,
        regions: vec![
            "int tensor of a sequence of len tokens: sink_end = min(sink, len); \
             pages = max(len − sink_end − local, 0) / page_tokens (integer division)"
                .into(),
            "tokens [0, sink_end) in the sink buffer; page p holds tokens \
             [sink_end + p·page_tokens, sink_end + (p+1)·page_tokens) in block \
             (page_table[seq][p], kv_head); the rest in the tail ring at slot \
             (t − sink_end) mod tail_capacity"
                .into(),
            "fp16 tensor: token t in FP16 page t / page_tokens, row t mod page_tokens; rows past \
             len are zero"
                .into(),
            "K and V share the page table: slot p maps to one physical page in k_pool and in v_pool"
                .into(),
        ],
        buffers: vec![
            buffer(
                "q",
                "[batch][kv_heads·gqa][head_dim]",
                &io,
                "query head h reads KV head h / gqa",
            ),
            buffer("out", "[batch][kv_heads·gqa][head_dim]", &io, ""),
            buffer(
                "k_pool",
                "[physical_pages][kv_heads][layout.k.block_bytes]",
                "u8",
                "one block per (page, KV head)",
            ),
            buffer(
                "v_pool",
                "[physical_pages][kv_heads][layout.v.block_bytes]",
                "u8",
                "",
            ),
            buffer(
                "page_table",
                "[batch][max_pages]",
                "i32",
                "logical page slot → physical page; K and V share a slot",
            ),
            buffer(
                "k_sink",
                "[batch][kv_heads][sink][head_dim]",
                "f16",
                "any valid pointer when sink = 0 (never read)",
            ),
            buffer("v_sink", "[batch][kv_heads][sink][head_dim]", "f16", ""),
            buffer(
                "k_tail",
                "[batch][kv_heads][layout.k.tail_capacity][head_dim]",
                "f16",
                "ring; any valid pointer for an fp16 tensor (never read)",
            ),
            buffer(
                "v_tail",
                "[batch][kv_heads][layout.v.tail_capacity][head_dim]",
                "f16",
                "",
            ),
            buffer("seq_lens", "[batch]", "i32", "tokens per sequence, ≥ 1"),
        ],
    })
}

/// Entries of the tune store for this scheme and kernel shape (any GPU, any bucket).
fn tuned_entries(store: &TuneStore, spec: &SchemeSpec, shape: &KernelShape) -> Vec<TuneEntry> {
    let hash = format!("{:016x}", spec.stable_hash());
    store
        .entries()
        .iter()
        .filter(|e| {
            e.problem.scheme_hash == hash
                && e.problem.head_dim == shape.head_dim
                && e.problem.gqa == shape.gqa
                && e.problem.dtype == shape.dtype
                && e.choice.check().is_ok()
        })
        .cloned()
        .collect()
}

/// Block parameters for the sources: flags, else the most common tuned choice (ties: the most
/// recent), else the default.
fn choose_params(
    req: &GenRequest,
    shape: &KernelShape,
    tuned: &[TuneEntry],
) -> Result<(TuneParams, &'static str)> {
    let default = TuneParams::default_for(&req.scheme.spec, shape);
    if req.threads.is_some()
        || req.tile_tokens.is_some()
        || req.min_warps_per_sm.is_some()
        || req.pack_heads.is_some()
        || req.short_staging.is_some()
        || req.store_scores.is_some()
    {
        let p = TuneParams {
            threads: req.threads.unwrap_or(default.threads),
            tile_tokens: req.tile_tokens.unwrap_or(default.tile_tokens),
            min_warps_per_sm: req.min_warps_per_sm.unwrap_or(default.min_warps_per_sm),
            pack_heads: req.pack_heads.unwrap_or(default.pack_heads),
            short_staging: req.short_staging.unwrap_or(default.short_staging),
            store_scores: req.store_scores.unwrap_or(default.store_scores),
        };
        p.validate().map_err(|e| {
            CliError::Usage(format!(
                "--threads/--tile-tokens/--min-warps-per-sm/--pack-heads/--short-staging/\
                 --store-scores: {e}"
            ))
        })?;
        return Ok((p, "flags"));
    }
    let mut best: Option<(TuneParams, usize, u64)> = None;
    for e in tuned {
        let p = e.choice.params;
        let count = tuned.iter().filter(|x| x.choice.params == p).count();
        let newest = tuned
            .iter()
            .filter(|x| x.choice.params == p)
            .map(|x| x.tuned_at_unix)
            .max()
            .unwrap_or(0);
        let better = match best {
            None => true,
            Some((_, c, t)) => (count, newest) > (c, t),
        };
        if better {
            best = Some((p, count, newest));
        }
    }
    Ok(match best {
        Some((p, _, _)) => (p, "tuned"),
        None => (default, "default"),
    })
}

fn write_file(path: &Path, bytes: &[u8], files: &mut Vec<(PathBuf, u64)>) -> Result<()> {
    std::fs::write(path, bytes).map_err(|source| CliError::Write {
        path: path.to_path_buf(),
        source,
    })?;
    files.push((path.to_path_buf(), bytes.len() as u64));
    Ok(())
}

/// A C identifier fragment: letters, digits and `_`, upper-case.
fn macro_tag(label: &str, shape: &KernelShape) -> String {
    let clean: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!(
        "KVQ_{clean}_D{}_G{}_{}",
        shape.head_dim,
        shape.gqa,
        shape.dtype.to_string().to_ascii_uppercase()
    )
}

/// The C header: layout constants, then per kernel its launch constants, a parameter struct, a
/// helper filling `cuLaunchKernel`'s argument array, and (under nvcc) the entry point's
/// declaration.
fn header_text(
    tag: &str,
    scheme: &Resolved,
    shape: &KernelShape,
    tune: &TuneParams,
    layout: &LayoutInfo,
    kernels: &[KernelInfo],
) -> String {
    let mut h = String::new();
    let guard = format!("{tag}_H");
    let _ = writeln!(h, "/* kvq generated header — do not edit. */");
    let _ = writeln!(h, "/* scheme: {} */", scheme.spec);
    let _ = writeln!(
        h,
        "/* shape:  head_dim={} gqa={} dtype={}; tuning threads={} tile_tokens={} \
         min_warps_per_sm={} pack_heads={} short_staging={} store_scores={} */",
        shape.head_dim,
        shape.gqa,
        shape.dtype,
        tune.threads,
        tune.tile_tokens,
        tune.min_warps_per_sm,
        tune.pack_heads,
        tune.short_staging,
        tune.store_scores
    );
    let _ = writeln!(
        h,
        "/* layout: {LAYOUT_VERSION} (docs/LAYOUT.md, docs/KERNELS.md); launch shapes and \
         buffer shapes: manifest.json */"
    );
    let _ = writeln!(h, "#ifndef {guard}\n#define {guard}\n");
    let _ = writeln!(h, "#include <stdint.h>\n");
    let _ = writeln!(h, "#define {tag}_LAYOUT_VERSION \"{LAYOUT_VERSION}\"");
    let _ = writeln!(h, "#define {tag}_HEAD_DIM {}", shape.head_dim);
    let _ = writeln!(h, "#define {tag}_GQA {}", shape.gqa);
    let _ = writeln!(h, "#define {tag}_PAGE_TOKENS {}", layout.page_tokens);
    let _ = writeln!(h, "#define {tag}_SINK {}", layout.sink);
    let _ = writeln!(h, "#define {tag}_K_BLOCK_BYTES {}", layout.k.block_bytes);
    let _ = writeln!(h, "#define {tag}_V_BLOCK_BYTES {}", layout.v.block_bytes);
    let _ = writeln!(
        h,
        "#define {tag}_K_TAIL_CAPACITY {}",
        layout.k.tail_capacity
    );
    let _ = writeln!(
        h,
        "#define {tag}_V_TAIL_CAPACITY {}",
        layout.v.tail_capacity
    );
    let _ = writeln!(h, "\n#ifdef __cplusplus\nextern \"C\" {{\n#endif");
    for k in kernels {
        let upper = format!("{tag}_{}", k.role.to_ascii_uppercase());
        let _ = writeln!(h, "\n/* {} ({}): {}", k.role, k.file, k.about);
        let _ = writeln!(
            h,
            " * grid ({}, {}, {}), block {} threads, {} bytes of dynamic shared memory. */",
            k.grid[0], k.grid[1], k.grid[2], k.block[0], k.dynamic_shared_bytes
        );
        let _ = writeln!(h, "#define {upper}_NAME \"{}\"", k.name);
        let _ = writeln!(h, "#define {upper}_BLOCK {}", k.block[0]);
        let _ = writeln!(h, "#define {upper}_DYNAMIC_SMEM {}", k.dynamic_shared_bytes);
        let _ = writeln!(h, "#define {upper}_NUM_PARAMS {}", k.params.len());
        if let Some(runs) = k.runs_pieces {
            let _ = writeln!(h, "#define {upper}_RUNS_PIECES {}", u8::from(runs));
        }
        let _ = writeln!(h, "typedef struct {}_params {{", k.name);
        for p in &k.params {
            let about = if p.about.is_empty() {
                String::new()
            } else {
                format!(" /* {} */", p.about)
            };
            let _ = writeln!(h, "    {} {};{about}", p.c_type, p.name);
        }
        let _ = writeln!(h, "}} {}_params;", k.name);
        let _ = writeln!(
            h,
            "/* Points args[i] at parameter i of *p, for cuLaunchKernel(..., kernelParams = args, ...). */"
        );
        let _ = writeln!(
            h,
            "static inline void {}_args({}_params* p, void* args[{}]) {{",
            k.name,
            k.name,
            k.params.len()
        );
        for p in &k.params {
            let _ = writeln!(h, "    args[{}] = (void*)&p->{};", p.index, p.name);
        }
        let _ = writeln!(h, "}}");
        let signature: Vec<String> = k
            .params
            .iter()
            .map(|p| format!("{} {}", p.c_type, p.name))
            .collect();
        let _ = writeln!(
            h,
            "#if defined(__CUDACC__)\n__global__ void {}({});\n#endif",
            k.name,
            signature.join(", ")
        );
    }
    let _ = writeln!(
        h,
        "\n#ifdef __cplusplus\n}}\n#endif\n\n#endif /* {guard} */"
    );
    ascii(&h)
}

/// The header in plain ASCII, so any C compiler and editor reads it as written.
fn ascii(text: &str) -> String {
    let mut s = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '·' | '×' => s.push('*'),
            '→' => s.push_str("->"),
            '—' | '–' | '−' => s.push('-'),
            '≥' => s.push_str(">="),
            '≤' => s.push_str("<="),
            '…' => s.push_str("..."),
            c if c.is_ascii() => s.push(c),
            _ => s.push('?'),
        }
    }
    s
}

/// Removes outputs of an earlier `kvq gen` into the same folder that this run will not rewrite
/// (CUBINs, a cache source, a sample), so the folder never mixes two schemes. Only kvq's own file
/// names are touched; failures are ignored (the files are then simply left).
fn remove_stale(out: &Path, writes_cache: bool, writes_sample: bool) {
    if let Ok(entries) = std::fs::read_dir(out) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let cubin = (name.starts_with("decode.") || name.starts_with("cache."))
                && name.ends_with(".cubin");
            if cubin || (!writes_cache && name == CACHE_FILE) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let sample = out.join(crate::sample::SAMPLE_DIR);
    if !writes_sample && sample.join("sample.json").is_file() {
        let _ = std::fs::remove_dir_all(sample);
    }
}

/// Writes the folder; see the module docs.
pub fn generate(req: &GenRequest) -> Result<GenOutcome> {
    let spec = &req.scheme.spec;
    let shape = &req.shape;
    if !req.scheme.has_gpu_kernel() {
        return Err(CliError::Unsupported(format!(
            "`{}` has no GPU kernel yet (CommVQ and XQuant run in the CPU reference only); \
             GPU schemes: fp16, kivi2, kivi4, kitty, kitty-pro, calibquant1, calibquant2, int8, \
             or scheme text of fp16/int(...) tensors",
            req.scheme.label()
        )));
    }
    let (store, tune_file) = match &req.tune_file {
        Some(p) => (Some(TuneStore::load_quietly(p)), Some(p.clone())),
        None => match TuneStore::default_path() {
            Ok(p) => (Some(TuneStore::load_quietly(&p)), Some(p)),
            Err(_) => (None, None),
        },
    };
    let mut notes = Vec::new();
    if let Some(w) = store.as_ref().and_then(|s| s.warning()) {
        notes.push(w.to_string());
    }
    let tuned = store
        .as_ref()
        .map(|s| tuned_entries(s, spec, shape))
        .unwrap_or_default();
    let (params, params_source) = choose_params(req, shape, &tuned)?;
    let decode = decode_kernels(spec, shape, &params)?;
    let cache = match cache_kernels(spec, shape.head_dim, shape.dtype) {
        Ok(c) => Some(c),
        Err(e) => {
            notes.push(format!("no cache kernels written: {e}"));
            None
        }
    };
    let layout = layout_info(spec, shape)?;

    let dtype = shape.dtype;
    let mut kernels = Vec::new();
    if let Some(r) = &decode.range {
        kernels.push(kernel_info(
            "score_range",
            DECODE_FILE,
            "CalibQuant's per-split score ranges over quantized keys; launch before decode with \
             decode's grid, block and dynamic shared memory",
            r,
            dtype,
        ));
    }
    kernels.push(KernelInfo {
        runs_pieces: Some(decode.runs_pieces()),
        ..kernel_info(
            "decode",
            DECODE_FILE,
            "split-K fused decode attention: per (split or piece, KV head, sequence), all query \
             heads of the KV head; writes one partial per split and per piece, and with one part \
             (num_splits = 1, num_pieces = 0) and a non-null out the output as well",
            &decode.decode,
            dtype,
        )
    });
    kernels.push(kernel_info(
        "combine",
        DECODE_FILE,
        "merges the num_parts partials (splits, then pieces) of each query head into out; \
         not needed after a decode launch of one part given out (it would write the same values)",
        &decode.combine,
        dtype,
    ));
    if let Some(c) = &cache {
        kernels.push(kernel_info(
            "append",
            CACHE_FILE,
            "writes token seq_lens[slots[i]] of each listed sequence (FP16 regions); commit \
             after the page quantizers",
            &c.append,
            dtype,
        ));
        kernels.push(kernel_info(
            "commit",
            CACHE_FILE,
            "seq_lens[slots[i]] += 1 after append and page quantization",
            &c.commit,
            dtype,
        ));
        kernels.push(kernel_info(
            "prefill_copy",
            CACHE_FILE,
            "FP16 part of a prompt into a slot: sink, tail after the last whole page, FP16 pages",
            &c.prefill_copy,
            dtype,
        ));
        for (t, q) in [("k", &c.k_quantizers), ("v", &c.v_quantizers)] {
            if let Some(q) = q {
                kernels.push(kernel_info(
                    &format!("{t}_quantize_input"),
                    CACHE_FILE,
                    "quantizes whole pages of a prefill's input into the pool",
                    &q.from_input,
                    dtype,
                ));
                kernels.push(kernel_info(
                    &format!("{t}_quantize_ring"),
                    CACHE_FILE,
                    "quantizes the page an append completed, from the tail ring (decides from \
                     seq_lens)",
                    &q.from_ring,
                    dtype,
                ));
            }
        }
    }

    std::fs::create_dir_all(&req.out).map_err(|source| CliError::Write {
        path: req.out.clone(),
        source,
    })?;
    remove_stale(&req.out, cache.is_some(), req.sample.is_some());
    let mut files = Vec::new();
    write_file(
        &req.out.join(DECODE_FILE),
        decode.source.as_bytes(),
        &mut files,
    )?;
    if let Some(c) = &cache {
        write_file(&req.out.join(CACHE_FILE), c.source.as_bytes(), &mut files)?;
    }
    let tag = macro_tag(&req.scheme.label(), shape);
    let header = header_text(&tag, &req.scheme, shape, &params, &layout, &kernels);
    write_file(&req.out.join(HEADER_FILE), header.as_bytes(), &mut files)?;

    // Compile before the manifest, so it records what was checked.
    let mut compiled = Vec::new();
    let mut compiled_lines = Vec::new();
    if let Some(arch) = req.arch {
        let mut sources = vec![(DECODE_FILE, decode.source.clone())];
        if let Some(c) = &cache {
            sources.push((CACHE_FILE, c.source.clone()));
        }
        for (file, code) in sources {
            let source = Source::new(file, code);
            match nvrtc::compile(&source, arch, Output::Cubin, &CompileOptions::default()) {
                Ok(c) => {
                    let stem = file.trim_end_matches(".cu");
                    let name = format!("{stem}.{arch}.cubin");
                    write_file(&req.out.join(&name), &c.image, &mut files)?;
                    compiled_lines.push(format!(
                        "compiled {file} for {arch} with NVRTC {}: {} bytes of CUBIN ({name})",
                        c.nvrtc,
                        c.image.len()
                    ));
                    compiled.push(CompiledInfo {
                        file: name,
                        arch: arch.to_string(),
                        nvrtc: c.nvrtc.to_string(),
                        bytes: c.image.len(),
                    });
                }
                Err(e @ RuntimeError::NvrtcNotFound { .. }) => {
                    notes.push(format!("{file} not compiled: {e}"));
                    break;
                }
                Err(e) => return Err(CliError::Runtime(e)),
            }
        }
    }

    let sample_file = match &req.sample {
        Some(s) => {
            let written = sample::write(&req.out, spec, shape, s)?;
            let rel = written.dir_name.clone();
            files.extend(written.files);
            notes.push(written.summary);
            Some(rel)
        }
        None => None,
    };

    let q_heads = "kv_heads·gqa";
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        version: MANIFEST_VERSION,
        kvq_version: env!("CARGO_PKG_VERSION").into(),
        layout_version: LAYOUT_VERSION.into(),
        scheme: SchemeInfo {
            name: req.scheme.name.map(str::to_string),
            text: spec.to_string(),
            hash: format!("{:016x}", spec.stable_hash()),
        },
        shape: *shape,
        files: {
            let mut f = BTreeMap::new();
            f.insert("decode".to_string(), DECODE_FILE.to_string());
            if cache.is_some() {
                f.insert("cache".to_string(), CACHE_FILE.to_string());
            }
            f.insert("header".to_string(), HEADER_FILE.to_string());
            f
        },
        launch: LaunchInfo {
            decode_steps: kernels
                .iter()
                .filter(|k| k.file == DECODE_FILE)
                .map(|k| k.role.clone())
                .collect(),
            num_splits: "any value ≥ 1 (decode's gridDim.x is num_splits + num_pieces, \
                         combine's num_parts too); tune.tuned gives measured values, \
                         tune.default_splits the heuristic"
                .into(),
            range_splits: format!(
                "any value ≥ 1: gridDim.x of score_range, passed to decode as range_splits (it \
                 reduces that many ranges a head); only where the scheme calibrates. kvq's \
                 runtime takes num_splits above {} splits, else max(num_splits, \
                 ⌊num_splits·R/D⌋), R and D the CTAs an SM holds of score_range and of decode \
                 (the driver's occupancy at their block and dynamic_shared_bytes): score_range \
                 has fewer registers, and a grid as small as decode's left SMs short of its CTAs",
                kvq::runtime::decode::RANGE_SCALE_MAX_SPLITS
            ),
            num_pieces: "the split CTAs take fixed shares of each (sequence, KV head); with \
                         num_pieces > 0 the last piece_permille/1000 of its cost is cut into \
                         num_pieces piece CTAs per (sequence, KV head), launched after every \
                         split's, which the GPU starts as SMs free up, so faster SMs take more of \
                         the work. Each piece writes its own partial after the splits', merged in \
                         a fixed order: the output does not depend on where a piece ran. \
                         num_pieces = 0 cuts none (piece_permille ignored). A decode kernel with \
                         runs_pieces = false accepts any num_pieces: its piece CTAs only mark \
                         their partials empty (l = 0)"
                .into(),
            stores_scores: decode.stores_scores,
            scratch: vec![
                buffer(
                    "part_acc",
                    &format!("[batch·{q_heads}][num_splits + num_pieces][head_dim]"),
                    "f32",
                    "written by decode, read by combine",
                ),
                buffer(
                    "part_ml",
                    &format!("[batch·{q_heads}][num_splits + num_pieces][2]"),
                    "f32",
                    "(running max, denominator) per split, then per piece",
                ),
                buffer(
                    "score_range",
                    "[batch][kv_heads][gqa][range_splits][2]",
                    "f32",
                    "only read when the scheme calibrates; otherwise any valid pointer",
                ),
                if decode.stores_scores {
                    buffer(
                        "scores",
                        &format!(
                            "[batch][kv_heads][max_pages·{}][gqa], plus 4 floats",
                            decode.page_tokens
                        ),
                        "f32",
                        "written by score_range (every quantized key's scores), read by decode \
                         in the same step; max_pages as passed to both",
                    )
                } else {
                    buffer(
                        "scores",
                        "any",
                        "f32",
                        "unused by these kernels; any valid pointer",
                    )
                },
            ],
            notes: vec![
                "every kernel uses static shared memory only unless dynamic_shared_bytes > 0; \
                 then set CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES to it first (static \
                 plus dynamic shared memory above 48 KiB is refused without it)"
                    .into(),
                "the grid depends only on batch, kv_heads, num_splits, range_splits and \
                 num_pieces: a launch can be captured in a CUDA graph while sequences grow"
                    .into(),
                "kernels enqueue on the caller's stream and never synchronise".into(),
                "on compute capability 9.0 and later, combine (and, for a calibrated scheme, \
                 decode) may be launched with \
                 CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuLaunchKernelEx) so it \
                 is scheduled while the kernel before it finishes: score_range and decode allow \
                 it early, and decode and combine wait for their predecessor's writes \
                 (griddepcontrol) before reading them; plain launches are also correct"
                    .into(),
            ],
        },
        kernels,
        layout,
        tune: TuneInfo {
            threads: params.threads,
            tile_tokens: params.tile_tokens,
            min_warps_per_sm: params.min_warps_per_sm,
            pack_heads: params.pack_heads,
            short_staging: params.short_staging,
            store_scores: params.store_scores,
            source: params_source.into(),
            tune_file: tune_file.map(|p| p.display().to_string()),
            default_block: default_block_text(spec, shape),
            default_splits: default_splits_text(spec),
            default_short_staging: default_short_staging_text(spec, shape, &params),
            default_store_scores: default_store_scores_text(spec, shape, &params),
            default_fast_memory: default_fast_memory_text(spec, shape),
            default_pieces: match decode.piece_rule {
                PieceRule::LongShares => format!(
                    "warps = block / 32; if bucket / (num_splits·warps) ≥ {} then num_pieces = \
                     2·num_splits and piece_permille = 100, else num_pieces = 0",
                    kvq::runtime::decode::PIECES_MIN_WARP_TOKENS
                ),
                PieceRule::FewSplits => format!(
                    "warps = block / 32; if num_splits·warps ≤ {} and bucket / (num_splits·warps) ≥ {} \
                     then num_pieces = 2 and piece_permille = 50, else num_pieces = 0",
                    kvq::runtime::decode::PIECES_MAX_FEW_SPLIT_WARPS,
                    kvq::runtime::decode::PIECES_FEW_SPLITS_MIN_WARP_TOKENS
                ),
                PieceRule::None => "num_pieces = 0 (this decode kernel runs no pieces)".into(),
            },
            tuned: tuned
                .iter()
                .map(|e| TunedInfo {
                    gpu: e.gpu.name.clone(),
                    compute_capability: e.gpu.compute_capability,
                    sm_count: e.gpu.sm_count,
                    kv_heads: e.problem.kv_heads,
                    batch_bucket: e.problem.batch_bucket,
                    context_bucket: e.problem.context_bucket,
                    threads: e.choice.params.threads,
                    tile_tokens: e.choice.params.tile_tokens,
                    min_warps_per_sm: e.choice.params.min_warps_per_sm,
                    pack_heads: e.choice.params.pack_heads,
                    short_staging: e.choice.params.short_staging,
                    store_scores: e.choice.params.store_scores,
                    splits: e.choice.splits,
                    num_pieces: e.choice.pieces.count,
                    piece_permille: e.choice.pieces.permille,
                    tuned_us: e.tuned_us,
                    default_us: e.default_us,
                    matches_source: e.choice.params == params,
                })
                .collect(),
        },
        compiled,
        sample: sample_file,
    };
    let json = serde_json::to_string_pretty(&manifest)
        .map_err(|e| CliError::Usage(format!("manifest: {e}")))?;
    write_file(&req.out.join(MANIFEST_FILE), json.as_bytes(), &mut files)?;
    if params_source == "tuned" {
        notes.push(format!(
            "block parameters from {} tuned result(s): threads {} tile_tokens {} \
             min_warps_per_sm {} pack_heads {} short_staging {} store_scores {}",
            tuned.len(),
            params.threads,
            params.tile_tokens,
            params.min_warps_per_sm,
            params.pack_heads,
            params.short_staging,
            params.store_scores
        ));
    }
    Ok(GenOutcome {
        files,
        kernels: manifest
            .kernels
            .iter()
            .map(|k| format!("{:<18} {}", k.role, k.name))
            .collect(),
        compiled: compiled_lines,
        notes,
    })
}

/// The manifest's rule for the short staging path of the runtime's untuned launches
/// (`kvq_runtime::short_staging_by_default`), for kernels where it is a choice.
fn default_short_staging_text(
    spec: &SchemeSpec,
    shape: &KernelShape,
    params: &TuneParams,
) -> String {
    if short_staging_changes(spec, shape, params) {
        format!(
            "warps = block / 32; short_staging = true (sources generated with --short-staging \
             true) where bucket / (num_splits·warps) ≥ {}, else false",
            kvq::runtime::decode::SHORT_STAGING_MIN_WARP_TOKENS
        )
    } else {
        "false (this decode kernel takes one staging path)".into()
    }
}

/// The manifest's rule for the stored scores of the runtime's untuned launches
/// (`kvq_runtime::store_scores_by_default`), for kernels where it is a choice.
fn default_store_scores_text(
    spec: &SchemeSpec,
    shape: &KernelShape,
    params: &TuneParams,
) -> String {
    if store_scores_changes(spec, shape, params) {
        let gqa = if kvq::runtime::decode::scores_stored_at_any_gqa(spec) {
            String::new()
        } else {
            format!(" and gqa ≤ {}", kvq::runtime::decode::STORED_SCORES_MAX_GQA)
        };
        format!(
            "store_scores = true (sources generated with --store-scores true, the default) \
             where bucket > {}{gqa}, else false; launches on a whole-pairs block \
             (default_block) store them as that block says",
            kvq::runtime::decode::SHORT_CONTEXT_BUCKET
        )
    } else {
        "false (this scheme's kernels store no scores)".into()
    }
}

/// The manifest's rule for the runtime's untuned launches on GPUs of fast memory for their SMs
/// (`kvq_runtime::decode::fast_memory_block`), for schemes it applies to.
fn default_fast_memory_text(spec: &SchemeSpec, shape: &KernelShape) -> String {
    use kvq::runtime::decode::{
        fast_memory_applies, FAST_MEMORY_GBPS_PER_SM, FAST_MEMORY_MIN_WARP_TOKENS,
    };
    if !fast_memory_applies(spec, shape) {
        return "none (these launches do not depend on the GPU's memory)".into();
    }
    format!(
        "where 2·memory_clock·bus_width / 8 / sm_count ≥ {FAST_MEMORY_GBPS_PER_SM} GB/s (peak DRAM \
         bandwidth an SM), outside the whole-pairs and one-tile blocks: the default_block's block \
         with min_warps_per_sm 12 and short_staging true (sources generated with \
         --min-warps-per-sm 12 --short-staging true) and num_splits from default_splits with \
         slots = (12 / warps)·sm_count, where bucket / (num_splits·warps) ≥ \
         {FAST_MEMORY_MIN_WARP_TOKENS}; else as default_block, default_splits and \
         default_short_staging say"
    )
}

/// The manifest's rule for the block of the runtime's untuned launches
/// (`kvq_runtime::decode::rule_block`, which `TuneChoice::default_block` and `occupancy_block`
/// apply): the scheme's whole-pairs blocks, then its one-tile blocks, then its few-pairs blocks,
/// else the codegen default.
fn default_block_text(spec: &SchemeSpec, shape: &KernelShape) -> String {
    use kvq::runtime::decode::{
        few_pairs_blocks, one_tile_blocks, whole_pairs_blocks, WholePairsBlock,
    };
    let base = TuneParams::default_for(spec, shape);
    let mut rules = Vec::new();
    let whole: Vec<String> = whole_pairs_blocks(spec, shape)
        .iter()
        .map(|w| {
            format!(
                "{} where {} and {}",
                block_change_text(&base, &w.params),
                range_text("waves", &w.waves),
                range_text("bucket", &w.buckets),
            )
        })
        .collect();
    if !whole.is_empty() {
        rules.push(format!(
            "waves = ceil(batch·kv_heads / sm_count); where batch·kv_heads ≥ {}·waves·sm_count, \
             with num_splits = 1 and num_pieces = 0: {}",
            WholePairsBlock::MIN_FILL_PERMILLE as f64 / 1000.0,
            whole.join(", ")
        ));
    }
    for one in one_tile_blocks(spec, shape) {
        let tile_warps = one.params.tile_tokens as usize * one.params.warps();
        rules.push(format!(
            "{} with num_splits = bucket / {tile_warps} (one tile a warp) where {} and \
             batch·kv_heads·num_splits ≤ {}·sm_count",
            block_change_text(&base, &one.params),
            range_text("batch·kv_heads", &one.pairs),
            one.floor_ctas_per_sm(),
        ));
    }
    for few in few_pairs_blocks(spec, shape) {
        let (pairs, buckets) = (
            range_text("batch·kv_heads", &few.pairs),
            range_text("bucket", &few.buckets),
        );
        let slots = if few.splits_from_default {
            format!(
                ", with default_splits' slots from the occupancy of the threads {} tile_tokens {} \
                 block",
                base.threads, base.tile_tokens
            )
        } else {
            String::new()
        };
        rules.push(format!(
            "{} where {pairs} and {buckets}{slots}",
            block_change_text(&base, &few.params)
        ));
    }
    let otherwise = format!(
        "threads {} and tile_tokens {}",
        base.threads, base.tile_tokens
    );
    if rules.is_empty() {
        return format!("{otherwise} at every batch and context");
    }
    format!("{}; else {otherwise}", rules.join("; "))
}

/// `what` within `range`: "any what" from 0 or 1 to `usize::MAX`, "what ≤ hi" from 0 or 1,
/// "what ≥ lo" to `usize::MAX`, "what = n" for one value, else "lo ≤ what ≤ hi".
fn range_text(what: &str, range: &std::ops::RangeInclusive<usize>) -> String {
    match (*range.start(), *range.end()) {
        (0 | 1, usize::MAX) => format!("any {what}"),
        (lo, hi) if lo == hi => format!("{what} = {lo}"),
        (0 | 1, hi) => format!("{what} ≤ {hi}"),
        (lo, usize::MAX) => format!("{what} ≥ {lo}"),
        (lo, hi) => format!("{lo} ≤ {what} ≤ {hi}"),
    }
}

/// A rule's block as the parameters it sets and the `kvq gen` flags that generate its sources:
/// threads and tile always, the occupancy floor, head packing, short staging and stored scores
/// where they differ from the codegen default `base`.
fn block_change_text(base: &TuneParams, block: &TuneParams) -> String {
    // (manifest name, value in the block, shown); each flag is the name with dashes. Threads
    // and tile always show; the rest where the block differs from the codegen default.
    fn differs<T: PartialEq + ToString>(name: &str, block: T, base: T) -> (&str, String, bool) {
        let shown = block != base;
        (name, block.to_string(), shown)
    }
    let params = [
        ("threads", block.threads.to_string(), true),
        ("tile_tokens", block.tile_tokens.to_string(), true),
        differs(
            "min_warps_per_sm",
            block.min_warps_per_sm,
            base.min_warps_per_sm,
        ),
        differs("pack_heads", block.pack_heads, base.pack_heads),
        differs("short_staging", block.short_staging, base.short_staging),
        differs("store_scores", block.store_scores, base.store_scores),
    ];
    let shown: Vec<_> = params.iter().filter(|(_, _, shown)| *shown).collect();
    let mut set: Vec<String> = shown.iter().map(|(n, v, _)| format!("{n} {v}")).collect();
    let flags: Vec<String> = shown
        .iter()
        .map(|(n, v, _)| format!("--{} {v}", n.replace('_', "-")))
        .collect();
    let last = set.pop().unwrap_or_default();
    format!(
        "{} and {last} (sources generated with {})",
        set.join(", "),
        flags.join(" ")
    )
}

/// The manifest's formula for the heuristic split count, with this scheme's fewest bucket tokens
/// per split warp (`kvq_runtime::min_warp_tokens`, which changes at most once, past
/// `SHORT_CONTEXT_BUCKET`).
fn default_splits_text(spec: &kvq::SchemeSpec) -> String {
    use kvq::runtime::decode::{min_warp_tokens, SHORT_CONTEXT_BUCKET};
    let short = min_warp_tokens(spec, SHORT_CONTEXT_BUCKET);
    let long = min_warp_tokens(spec, SHORT_CONTEXT_BUCKET + 1);
    let warp_tokens = if short == long {
        long.to_string()
    } else {
        format!("{short} if bucket ≤ {SHORT_CONTEXT_BUCKET}, else {long}")
    };
    format!(
        "slots = sm_count × cuOccupancyMaxActiveBlocksPerMultiprocessor(decode, block, its \
         dynamic_shared_bytes); ctas = batch·kv_heads; bucket = next power of two ≥ longest \
         sequence; warp_tokens = {warp_tokens}; most = clamp(bucket / (warp_tokens·block / 32), \
         1, 256); lo = clamp(ceil(0.9·slots / ctas), 1, most); the s in lo..=min(2·lo, most) \
         maximising ctas·s / (ceil(ctas·s / slots)·slots), ties to the smaller"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_offsets_follow_natural_alignment() {
        let e = KernelEntry {
            name: "k".into(),
            params: vec![
                ("const uint16_t*".into(), "q".into()),
                ("int32_t".into(), "n".into()),
                ("float*".into(), "out".into()),
                ("int32_t".into(), "m".into()),
            ],
            grid: ["1".into(), "1".into(), "1".into()],
            block: 32,
            dynamic_shared_bytes: 0,
        };
        let k = kernel_info("x", "x.cu", "", &e, Dtype::F16);
        let offsets: Vec<usize> = k.params.iter().map(|p| p.offset).collect();
        assert_eq!(offsets, [0, 8, 16, 24]);
        assert_eq!(k.param_bytes, 32);
    }

    #[test]
    fn macro_tags_are_identifiers() {
        let shape = KernelShape::new(128, 4, Dtype::Bf16);
        assert_eq!(macro_tag("kitty-pro", &shape), "KVQ_KITTY_PRO_D128_G4_BF16");
    }
}
