//! `manifest.json`: what an engine needs to launch the generated kernels — their parameters and
//! grids, the page-block layout, the scratch buffers, and the tuned and default block choices.

use std::collections::BTreeMap;
use std::path::Path;

use kvq::codegen::rules::LaunchRules;
use kvq::codegen::{CacheKernels, DecodeKernels, Dtype, KernelEntry, KernelShape, TuneParams};
use kvq::reference::int::{fp16_block_bytes, IntLayout, Section};
use kvq::runtime::tune::TuneEntry;
use kvq::{Axis, BoostCriterion, SchemeSpec, TensorQuant};
use serde::Serialize;

use super::{rules, CACHE_FILE, DECODE_FILE, HEADER_FILE, LAYOUT_VERSION};
use crate::error::{CliError, Result};
use crate::scheme::Resolved;

#[derive(Serialize)]
pub(super) struct SchemeInfo {
    name: Option<String>,
    text: String,
    /// `SchemeSpec::stable_hash`, the key tuned results are stored under.
    hash: String,
}

#[derive(Serialize)]
pub(super) struct ParamInfo {
    pub(super) index: usize,
    pub(super) name: String,
    pub(super) c_type: String,
    bytes: usize,
    /// Offset in the kernel's packed parameter buffer and in the header's struct (natural
    /// alignment), for `CU_LAUNCH_PARAM_BUFFER_POINTER`.
    offset: usize,
    pub(super) about: String,
}

#[derive(Serialize)]
pub(super) struct KernelInfo {
    pub(super) role: String,
    pub(super) file: String,
    pub(super) name: String,
    pub(super) about: String,
    pub(super) params: Vec<ParamInfo>,
    param_bytes: usize,
    pub(super) grid: [String; 3],
    pub(super) block: [u32; 3],
    pub(super) dynamic_shared_bytes: u32,
    /// Decode only: whether its piece CTAs do work when `num_pieces > 0`; without, the splits do
    /// all the work and the piece CTAs only mark their partials empty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) runs_pieces: Option<bool>,
}

#[derive(Serialize)]
pub(super) struct SectionInfo {
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
pub(super) struct BoostInfo {
    bits: u8,
    high_bits: u8,
    channels: usize,
    by: String,
    high_row_words: usize,
}

#[derive(Serialize)]
pub(super) struct TensorInfo {
    /// `fp16` or `int`.
    kind: String,
    text: String,
    pub(super) block_bytes: usize,
    /// FP16 local window (tokens) and tail ring capacity (`local + page`); 0 for FP16 tensors.
    local: u32,
    pub(super) tail_capacity: u32,
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
pub(super) struct BufferInfo {
    name: String,
    shape: String,
    element: String,
    about: String,
}

#[derive(Serialize)]
pub(super) struct LayoutInfo {
    version: String,
    doc: String,
    head_dim: u32,
    pub(super) page_tokens: u32,
    pub(super) sink: u32,
    pub(super) k: TensorInfo,
    pub(super) v: TensorInfo,
    /// How a sequence's tokens split into sink, quantized pages and tail ring.
    regions: Vec<String>,
    buffers: Vec<BufferInfo>,
}

#[derive(Serialize)]
pub(super) struct TunedInfo {
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
pub(super) struct TuneInfo {
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
    /// The rules of the runtime's untuned launches as data (`kvq_codegen::rules::LaunchRules`):
    /// the blocks, the conditions that pick them and the numbers of the split, piece, staging,
    /// stored-score and fast-memory rules, which an engine evaluates as `rules_evaluation` says.
    rules: LaunchRules,
    /// How to evaluate `rules`.
    rules_evaluation: Vec<String>,
    tuned: Vec<TunedInfo>,
}

#[derive(Serialize)]
pub(super) struct LaunchInfo {
    /// Kernels of one decode step, in stream order.
    decode_steps: Vec<String>,
    num_splits: String,
    /// The score-range grid's split count, which decode is given as `range_splits`.
    range_splits: String,
    /// What decode's `num_pieces` and `piece_permille` do.
    num_pieces: String,
    /// Whether score_range stores the keys' scores for decode (the `scores` scratch buffer).
    stores_scores: bool,
    /// Floats `scores` holds a token of a KV head: every grid row's query heads (gqa, or more
    /// where the last head group shares heads with the one before).
    score_columns: u32,
    scratch: Vec<BufferInfo>,
    notes: Vec<String>,
}

#[derive(Serialize)]
pub(super) struct CompiledInfo {
    pub(super) file: String,
    pub(super) arch: String,
    pub(super) nvrtc: String,
    pub(super) bytes: usize,
}

#[derive(Serialize)]
pub(super) struct Manifest {
    pub(super) format: String,
    pub(super) version: u32,
    pub(super) kvq_version: String,
    pub(super) layout_version: String,
    pub(super) scheme: SchemeInfo,
    pub(super) shape: KernelShape,
    pub(super) files: BTreeMap<String, String>,
    pub(super) kernels: Vec<KernelInfo>,
    pub(super) launch: LaunchInfo,
    pub(super) layout: LayoutInfo,
    pub(super) tune: TuneInfo,
    pub(super) compiled: Vec<CompiledInfo>,
    pub(super) sample: Option<String>,
}

/// Bytes and alignment of a parameter's C type (pointers and `int32_t` are all kvq uses).
fn c_type_size(c_type: &str) -> usize {
    if c_type.ends_with('*') || c_type.contains("64") || c_type == "double" {
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
            "[sequence slots][max_pages] i32: logical page → physical page (K and V share it)".into()
        }
        "max_pages" => "columns of page_table".into(),
        "k_sink" | "v_sink" => "FP16 sink [sequence slots][kv_heads][sink][head_dim]".into(),
        "k_tail" | "v_tail" | "tail" => {
            "FP16 tail ring [sequence slots][kv_heads][tail_capacity][head_dim]".into()
        }
        "seq_lens" => "[sequence slots] i32 tokens per sequence".into(),
        "seq_slots" => {
            "[batch] i32 cache slot of each row (null: row i is slot i; -1: a padding row)".into()
        }
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
        "lse" => {
            "f32 [batch·q_heads] log-sum-exp of each row's scores, ln Σ exp(q·k/√d) (natural log, \
             −inf for a row without tokens), for merging partial results; NULL: not written"
                .into()
        }
        "num_parts" => {
            "partials per query head: num_splits + num_pieces of the decode launch".into()
        }
        "k_new" | "v_new" => format!("new tokens [n][stride][kv_heads][head_dim] {io} (row i·stride)"),
        "stride" => "tokens between consecutive sequences' rows in k_new/v_new (1: one a sequence)".into(),
        "q_len" => {
            "query tokens a sequence (rows [batch][q_len]): the slot's last q_len tokens, each \
             seeing the tokens up to itself (1: decode)"
                .into()
        }
        "slots" => "[n] i32 sequence slots (rows of page_table/seq_lens)".into(),
        "k_in" | "v_in" | "x" => format!("prefill input [tokens][kv_heads][head_dim] {io}"),
        "tokens" => "prompt tokens".into(),
        "slot" => "the sequence's slot".into(),
        "jobs" => "[jobs][2] i32 (first input token, page-table entry slot·max_pages + page)".into(),
        "n" => "entries of slots".into(),
        // Codebook schemes (kvq/codebook/*.cuh).
        "k_book" => "RoPE-commutative key codebook [kv_heads][groups][residuals][levels][pairs] u32 (layout.codebooks); null without".into(),
        "k_rows" | "v_rows" => "additive rows C ⊙ σ [kv_heads][rows][head_dim] f32; null without".into(),
        "k_mean" | "v_mean" => "additive means μ [kv_heads][head_dim] f32; null without".into(),
        "rope_theta" => "RoPE base (double): keys are coded before RoPE and rotated by the decode".into(),
        "k_pre" => format!("new keys before RoPE [tokens][kv_heads][head_dim] {io} (read when keys are RoPE-coded)"),
        "k_post" => format!("new keys after RoPE [tokens][kv_heads][head_dim] {io}"),
        "v" => format!("new values [tokens][kv_heads][head_dim] {io}"),
        "r0" => "first row of k_pre/k_post/v this launch stores".into(),
        "t0" => "store: sequence position of row r0; encoders: the first table (layout.codebooks), f64".into(),
        "k_ring_from" | "v_ring_from" => "a coded side's tokens below this go to no ring (a page encoder reads them from the input); 0: every non-sink token".into(),
        "k_pending" | "v_pending" => format!("pending rings [sequence slots][kv_heads][tail_capacity][head_dim] {io}"),
        "status" => "u32[3]: flags, first bad-input token, first overflowing token (zero the flags, 0xFFFFFFFF the tokens, first)".into(),
        "src" => format!("rows the encoder codes, {io}: the input [tokens][kv_heads][head_dim] or a sequence's pending ring"),
        "tok_stride" => "elements between a source's consecutive tokens".into(),
        "head_stride" => "elements between a source's consecutive KV heads".into(),
        "first" => "the row (ring slot) of the launch's first token".into(),
        "cap" => "ring rows (tail_capacity) for a pending ring, 0 for the input".into(),
        "page0" => "logical page of the launch's first block (gridDim.x pages from it)".into(),
        "t1" | "t2" | "t3" | "t4" => "encoder tables (layout.codebooks), f64".into(),
        _ => String::new(),
    }
}

pub(super) fn kernel_info(
    role: &str,
    file: &str,
    about: &str,
    e: &KernelEntry,
    dtype: Dtype,
) -> KernelInfo {
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

pub(super) fn tensor_info(
    spec: &SchemeSpec,
    t: &TensorQuant,
    head_dim: usize,
) -> Result<TensorInfo> {
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

pub(super) fn layout_info(spec: &SchemeSpec, shape: &KernelShape) -> Result<LayoutInfo> {
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

/// The scheme as named and as text, with the hash tuned results are stored under.
pub(super) fn scheme_info(scheme: &Resolved) -> SchemeInfo {
    SchemeInfo {
        name: scheme.name.map(str::to_string),
        text: scheme.spec.to_string(),
        hash: format!("{:016x}", scheme.spec.stable_hash()),
    }
}

/// The output folder's files by role.
pub(super) fn file_names(writes_cache: bool) -> BTreeMap<String, String> {
    let mut f = BTreeMap::new();
    f.insert("decode".to_string(), DECODE_FILE.to_string());
    if writes_cache {
        f.insert("cache".to_string(), CACHE_FILE.to_string());
    }
    f.insert("header".to_string(), HEADER_FILE.to_string());
    f
}

/// Every kernel of the two sources: a decode step's in stream order, then the cache's.
pub(super) fn kernel_infos(
    decode: &DecodeKernels,
    cache: Option<&CacheKernels>,
    dtype: Dtype,
) -> Vec<KernelInfo> {
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
        "merges the num_parts partials (splits, then pieces) of each query head into out, and \
         each row's log-sum-exp into lse where lse is not NULL; not needed after a decode launch \
         of one part given out, unless lse is wanted (it would write the same out values)",
        &decode.combine,
        dtype,
    ));
    if let Some(c) = cache {
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
    kernels
}

/// How to launch a decode step and what its scratch buffers hold.
pub(super) fn launch_info(decode: &DecodeKernels, kernels: &[KernelInfo]) -> LaunchInfo {
    let q_heads = "kv_heads·gqa";
    LaunchInfo {
        decode_steps: kernels
            .iter()
            .filter(|k| k.file == DECODE_FILE)
            .map(|k| k.role.clone())
            .collect(),
        num_splits: "any value ≥ 1 (decode's gridDim.x is num_splits + num_pieces, \
                     combine's num_parts too); tune.tuned gives measured values, \
                     tune.rules the heuristic"
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
        score_columns: decode.score_columns(),
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
                    &if decode.head_groups == 1 {
                        format!(
                            "[batch][kv_heads][max_pages·{}][gqa], plus 4 floats",
                            decode.page_tokens
                        )
                    } else {
                        format!(
                            "[batch][kv_heads·{g}][max_pages·{}][{h}] (a row per head group \
                             of {h}; launch.score_columns = {c} floats a token), plus 4 floats",
                            decode.page_tokens,
                            g = decode.head_groups,
                            h = decode.group_heads,
                            c = decode.score_columns()
                        )
                    },
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
        ]
        .into_iter()
        .chain((decode.head_groups > 1).then(|| {
            let overlap = decode.groups().overlap();
            let last = if overlap == 0 {
                String::new()
            } else {
                let heads = if overlap == 1 { "head" } else { "heads" };
                format!(
                    "; the last row starts at query head gqa − {h} of its KV head, scores again \
                     the last {overlap} {heads} of the row before, and writes only the heads \
                     after them",
                    h = decode.group_heads
                )
            };
            format!(
                "decode and score_range take {g} grid rows a KV head (gridDim.y = kv_heads · \
                 {g}): the tensor-core kernel scores at most 8 query heads a CTA, so each row \
                 takes a group of {h} consecutive query heads{last}, and a KV head's rows read \
                 the same cache bytes",
                g = decode.head_groups,
                h = decode.group_heads
            )
        }))
        .collect(),
    }
}

/// The block the sources were generated with, where it came from, the rules of the runtime's
/// untuned launches and every tuned result for this scheme and shape.
pub(super) fn tune_info(
    spec: &SchemeSpec,
    shape: &KernelShape,
    params: &TuneParams,
    params_source: &str,
    tune_file: Option<&Path>,
    tuned: &[TuneEntry],
) -> TuneInfo {
    TuneInfo {
        threads: params.threads,
        tile_tokens: params.tile_tokens,
        min_warps_per_sm: params.min_warps_per_sm,
        pack_heads: params.pack_heads,
        short_staging: params.short_staging,
        store_scores: params.store_scores,
        source: params_source.into(),
        tune_file: tune_file.map(|p| p.display().to_string()),
        rules: rules::launch_rules(spec, shape),
        rules_evaluation: rules::evaluation(),
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
                matches_source: e.choice.params == *params,
            })
            .collect(),
    }
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
}
