//! `kvq gen` for codebook schemes (CommVQ): the decode unit (decode and combine) and the
//! cache-filling unit (rows and page encoders), the kernel headers, a C header, a manifest with the
//! device layout of `kvq_reference::commvq::device` (blocks, FP16 sink and tail, pending rings),
//! the codebook tensors each kernel reads and the codebook file format, and a README; with
//! `--sample`, a batch in that layout with its reference output ([`crate::sample_codebook`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kvq::codegen::{
    codebook_encode_kernels, codebook_kernels_with, CodebookEncodeKernels, CodebookKernels,
    CodebookParams,
};
use kvq::reference::commvq::device::{DeviceLayout, SideKind, SideLayout};
use kvq::reference::commvq::{CODEBOOK_FILE_FORMAT, DEVICE_LAYOUT_VERSION};
use kvq::runtime::codebook::codebook_problem_key;
use kvq::runtime::tune::{TuneProblem, TuneStore};
use serde::Serialize;

use super::family::{self, buffer, BufferInfo, LaunchInfo, ManifestHead};
use super::manifest::{kernel_info, CompiledInfo, KernelInfo};
use super::{GenOutcome, GenRequest, DECODE_FILE, HEADER_FILE, INCLUDE_DIR, MANIFEST_FILE};
use crate::error::{CliError, Result};
use crate::sample_codebook;

/// The cache-filling unit's file.
pub const ENCODE_FILE: &str = "encode.cu";

#[derive(Serialize)]
struct SideInfo {
    kind: &'static str,
    block_bytes: usize,
    /// Coded sides: the head's code words, then `P` f16 scales (RoPE keys) or factors (additive).
    codes: Option<[usize; 2]>,
    scales: Option<[usize; 2]>,
    /// FP16 sides: the `P × D` f16 rows of a page.
    rows: Option<[usize; 2]>,
    local: usize,
    sink: usize,
    tail_capacity: usize,
    levels: Option<usize>,
    residuals: Option<usize>,
    pairs_per_code: Option<usize>,
    groups: Option<usize>,
    code_bits: Option<u32>,
    stream_words: Option<usize>,
    token_scale: Option<bool>,
    additive_rows: Option<usize>,
}

#[derive(Serialize)]
struct LayoutInfo {
    version: &'static str,
    doc: &'static str,
    head_dim: usize,
    page_tokens: usize,
    sink: usize,
    k: SideInfo,
    v: SideInfo,
    buffers: Vec<BufferInfo>,
    codebooks: Vec<BufferInfo>,
    codebook_file: CodebookFileInfo,
}

#[derive(Serialize)]
struct CodebookFileInfo {
    format: &'static str,
    doc: &'static str,
    tensors: Vec<BufferInfo>,
}

#[derive(Serialize)]
struct TunedInfo {
    gpu: String,
    kv_heads: usize,
    batch_bucket: usize,
    context_bucket: usize,
    threads: u32,
    tile: u32,
    book_in_shared_memory: bool,
    splits: usize,
    tuned_us: f64,
    default_us: f64,
}

#[derive(Serialize)]
struct Manifest {
    #[serde(flatten)]
    head: ManifestHead,
    params: CodebookParams,
    files: BTreeMap<String, String>,
    kernels: Vec<KernelInfo>,
    launch: LaunchInfo,
    layout: LayoutInfo,
    tuned: Vec<TunedInfo>,
    compiled: Vec<CompiledInfo>,
    sample: Option<String>,
}

fn section(s: kvq::reference::int::Section) -> Option<[usize; 2]> {
    (s.bytes > 0).then_some([s.offset, s.bytes])
}

fn side_info(s: &SideLayout) -> SideInfo {
    let mut i = SideInfo {
        kind: "fp16",
        block_bytes: s.block_bytes,
        codes: section(s.codes),
        scales: section(s.scales),
        rows: section(s.rows),
        local: s.local,
        sink: s.sink,
        tail_capacity: s.tail_cap,
        levels: None,
        residuals: None,
        pairs_per_code: None,
        groups: None,
        code_bits: None,
        stream_words: None,
        token_scale: None,
        additive_rows: None,
    };
    match s.kind {
        SideKind::Fp16 => {}
        SideKind::Rope {
            levels,
            residuals,
            pairs_per_code,
            groups,
            code_bits,
            stream_words,
            span,
        } => {
            i.kind = "rope_commutative";
            i.levels = Some(levels);
            i.residuals = Some(residuals);
            i.pairs_per_code = Some(pairs_per_code);
            i.groups = Some(groups);
            i.code_bits = Some(code_bits);
            i.stream_words = Some(stream_words);
            i.token_scale = Some(span == kvq::CodebookSpan::Token);
        }
        SideKind::Additive { rows } => {
            i.kind = "additive";
            i.additive_rows = Some(rows);
        }
    }
    i
}

fn layout_info(l: &DeviceLayout) -> LayoutInfo {
    let mut codebooks = Vec::new();
    let mut file = Vec::new();
    if let SideKind::Rope { .. } = l.k.kind {
        codebooks.push(buffer(
            "k_book",
            "[kv_heads][groups][residuals][levels][pairs_per_code]",
            "u32",
            "RoPE-commutative key entries, f16(re) | f16(im) << 16",
        ));
        file.push(buffer(
            "k.entries",
            "[kv_heads, groups, residuals, levels, pairs_per_code, 2]",
            "f16",
            "the same entries, (re, im)",
        ));
    }
    for (side, which) in [(&l.k, "k"), (&l.v, "v")] {
        if let SideKind::Additive { .. } = side.kind {
            let (rows, mean) = if which == "k" {
                ("k_rows", "k_mean")
            } else {
                ("v_rows", "v_mean")
            };
            codebooks.push(buffer(
                rows,
                "[kv_heads][rows][head_dim]",
                "f32",
                "additive rows times the channel scale, C ⊙ σ (exact in f32)",
            ));
            codebooks.push(buffer(mean, "[kv_heads][head_dim]", "f32", "the mean μ"));
            for (t, about) in [
                ("table", "[books, rows, dim]: the rows C"),
                ("channel_scale", "[books, dim]: σ"),
                ("mean", "[books, dim]: μ"),
            ] {
                file.push(BufferInfo {
                    name: match (which, t) {
                        ("k", "table") => "k.table",
                        ("k", "channel_scale") => "k.channel_scale",
                        ("k", _) => "k.mean",
                        (_, "table") => "v.table",
                        (_, "channel_scale") => "v.channel_scale",
                        _ => "v.mean",
                    },
                    shape: about.split(':').next().unwrap_or_default().into(),
                    element: "f16",
                    about: about.into(),
                });
            }
        }
    }
    codebooks.push(buffer(
        "t0..t4 (encoders)",
        "per coded side",
        "f64",
        "the reference encoders' tables (kvq_reference::commvq::encoder): RoPE keys c, i·c, ‖c‖², \
         c_a·(i·c_b) per (head, group, round); additive rows C, ‖C_j‖², C_2j·C_2j+1, μ, σ per \
         book. Computed on the host from the codebooks by kvq's own code: an engine without kvq \
         computes them with the same f64 arithmetic (docs/CODEBOOKS.md §2.2) or runs kvq's runtime",
    ));
    let per = |rows: &str| format!("[sequence slots][kv_heads][{rows}][head_dim]");
    LayoutInfo {
        version: DEVICE_LAYOUT_VERSION,
        doc: "docs/CODEBOOKS.md §2.2 (kvq_reference::commvq::device)",
        head_dim: l.head_dim,
        page_tokens: l.page,
        sink: l.sink,
        k: side_info(&l.k),
        v: side_info(&l.v),
        buffers: vec![
            buffer(
                "k_pool / v_pool",
                "[physical_page][kv_head][block_bytes]",
                "u8",
                "one block per (page, KV head) a side: coded pages (codes, scales) or FP16 rows",
            ),
            buffer(
                "page_table",
                "[sequence slots][max_pages]",
                "i32",
                "logical page → physical page, shared by K and V; a coded side's pages count from \
                 the sink's end, an FP16 side's from token 0",
            ),
            buffer("k_sink / v_sink", &per("sink"), "f16", "coded sides' first tokens (keys after RoPE)"),
            buffer(
                "k_tail / v_tail",
                &per("tail_capacity"),
                "f16",
                "coded sides' recent tokens, token t at slot (t − sink) mod tail_capacity",
            ),
            buffer(
                "k_pending / v_pending",
                &per("tail_capacity"),
                "io dtype",
                "what the page encoders read when a page closes: the same slots, in the input \
                 format (keys with RoPE-commutative codes before RoPE)",
            ),
            buffer("seq_lens", "[sequence slots]", "i32", "tokens per sequence"),
        ],
        codebooks,
        codebook_file: CodebookFileInfo {
            format: CODEBOOK_FILE_FORMAT,
            doc: "docs/CODEBOOKS.md §2.3: safetensors, metadata kvq.format, kvq.scheme, kvq.kv_heads, \
                  kvq.head_dim",
            tensors: file,
        },
    }
}

/// The stored codebook results for this scheme and kernel shape (any KV heads and buckets).
fn tuned(store: &TuneStore, req: &GenRequest) -> Vec<TunedInfo> {
    let probe = TuneProblem::new(req.scheme.spec, req.shape, 1, 1, 1);
    let Ok(key) = codebook_problem_key(&probe) else {
        return Vec::new();
    };
    store
        .entries()
        .iter()
        .filter(|e| {
            e.problem.scheme_hash == key.scheme_hash
                && e.problem.candidates == key.candidates
                && (e.problem.head_dim, e.problem.gqa, e.problem.dtype)
                    == (key.head_dim, key.gqa, key.dtype)
        })
        .filter_map(|e| {
            let p = e.codebook?;
            Some(TunedInfo {
                gpu: e.gpu.to_string(),
                kv_heads: e.problem.kv_heads,
                batch_bucket: e.problem.batch_bucket,
                context_bucket: e.problem.context_bucket,
                threads: p.threads,
                tile: p.tile,
                book_in_shared_memory: p.book_in_shared_memory,
                splits: e.choice.splits,
                tuned_us: e.tuned_us,
                default_us: e.default_us,
            })
        })
        .collect()
}

/// The launch shape of the decode unit: the default, with `--threads`/`--tile-tokens` over it.
fn params(req: &GenRequest) -> Result<CodebookParams> {
    let mut p = CodebookParams::default_for(&req.scheme.spec, &req.shape)?;
    if let Some(t) = req.threads {
        p.threads = t;
    }
    if let Some(t) = req.tile_tokens {
        p.tile = t;
    }
    if req.min_warps_per_sm.is_some()
        || req.pack_heads.is_some()
        || req.short_staging.is_some()
        || req.store_scores.is_some()
    {
        return Err(CliError::Usage(
            "codebook schemes take --threads and --tile-tokens only (the other block flags are \
             the integer decode's)"
                .into(),
        ));
    }
    Ok(p)
}

fn kernels(decode: &CodebookKernels, encode: &CodebookEncodeKernels) -> Vec<KernelInfo> {
    let dtype = decode.shape.dtype;
    let mut out = vec![
        kernel_info(
            "decode",
            DECODE_FILE,
            "split-K codebook decode: per (split, KV head, sequence), every query head of the KV \
             head; keys rebuilt from their codes, additive values through per-row sums; writes a \
             partial per split, or with one split `out` itself",
            &decode.decode,
            dtype,
        ),
        kernel_info(
            "combine",
            DECODE_FILE,
            "merges the splits' partials into the outputs (and optionally each row's LSE)",
            &decode.combine,
            dtype,
        ),
        kernel_info(
            "store",
            ENCODE_FILE,
            "a chunk of new tokens: every value checked, FP16 rows into the sink, tail ring or FP16 \
             pages, coded sides' inputs into the pending rings",
            &encode.store,
            dtype,
        ),
    ];
    for (role, e) in [
        ("encode_k", &encode.encode_k),
        ("encode_v", &encode.encode_v),
    ] {
        if let Some(e) = e {
            out.push(kernel_info(
                role,
                ENCODE_FILE,
                "codes whole pages into their blocks, bit for bit the CPU reference's, from the \
                 caller's tensor or a pending ring; tables t0… as layout.codebooks says",
                e,
                dtype,
            ));
        }
    }
    let st = &encode.steps;
    out.push(kernel_info(
        "step_store",
        ENCODE_FILE,
        "one new token a sequence at its device-held length (graph-capturable): rows checked \
         and stored as `store` does, coded sides' inputs into the pending rings",
        &st.store,
        dtype,
    ));
    for (role, e) in [
        ("step_encode_k", &st.encode_k),
        ("step_encode_v", &st.encode_v),
    ] {
        if let Some(e) = e {
            out.push(kernel_info(
                role,
                ENCODE_FILE,
                "codes the page a sequence's new token closes, if any, from its pending ring",
                e,
                dtype,
            ));
        }
    }
    out.push(kernel_info(
        "step_commit",
        ENCODE_FILE,
        "advances seq_lens by one for each step row whose slot stayed clean",
        &st.commit,
        dtype,
    ));
    out.push(kernel_info(
        "set_length",
        ENCODE_FILE,
        "empties a slot before a prompt (begin = 1), or sets its length after one if clean",
        &st.set_length,
        dtype,
    ));
    out
}

fn readme(req: &GenRequest, arch: &str) -> String {
    format!(
        "# kvq generated kernels (codebook scheme)

scheme: `{scheme}`; head_dim {head_dim}, GQA {gqa}, {dtype}.

- `{DECODE_FILE}`: the decode unit (split-K decode over the paged cache, combine).
- `{ENCODE_FILE}`: the cache-filling unit (new tokens' rows, page encoders).
- `{INCLUDE_DIR}/kvq/`: the kernels' code, CUDA headers the units `#include \"kvq/…\"`.
- `{HEADER_FILE}`: C header with launch constants and a parameter struct per kernel.
- `{MANIFEST_FILE}`: entry points, launch shapes, the device layout ({DEVICE_LAYOUT_VERSION}), the \
codebook tensors each kernel reads and the codebook file format ({CODEBOOK_FILE_FORMAT}).

{compiling}",
        scheme = req.scheme.spec,
        head_dim = req.shape.head_dim,
        gqa = req.shape.gqa,
        dtype = req.shape.dtype,
        compiling = family::compiling_section(arch, DECODE_FILE),
    )
}

fn header_text(req: &GenRequest, layout: &DeviceLayout, kernels: &[KernelInfo]) -> String {
    let tag = req.prefix.upper();
    let mut h = String::new();
    let guard = family::header_prologue(&mut h, req, DEVICE_LAYOUT_VERSION, "docs/CODEBOOKS.md");
    let _ = writeln!(h, "#define {tag}_PAGE_TOKENS {}", layout.page);
    let _ = writeln!(h, "#define {tag}_SINK {}", layout.sink);
    for (side, name) in [(&layout.k, "K"), (&layout.v, "V")] {
        let _ = writeln!(h, "#define {tag}_{name}_BLOCK_BYTES {}", side.block_bytes);
        let _ = writeln!(h, "#define {tag}_{name}_TAIL_CAPACITY {}", side.tail_cap);
        let _ = writeln!(h, "#define {tag}_{name}_LOCAL {}", side.local);
    }
    family::header_epilogue(h, req, kernels, &guard)
}

/// Writes the folder for a codebook scheme; see the module docs.
pub(super) fn generate(req: &GenRequest) -> Result<GenOutcome> {
    let spec = &req.scheme.spec;
    let shape = &req.shape;
    if let Some(s) = &req.sample {
        sample_codebook::check(s, shape)?;
    }
    let params = params(req)?;
    let decode = codebook_kernels_with(spec, shape, 1, &params)?;
    let encode = codebook_encode_kernels(spec, shape.head_dim, shape.dtype, 1)?;
    let layout = decode.layout;
    let mut notes = Vec::new();
    let store = match &req.tune_file {
        Some(p) => Some(super::named_tune_file(p)?),
        None => TuneStore::default_path().ok().map(TuneStore::load_quietly),
    };
    let tuned = store.as_ref().map(|s| tuned(s, req)).unwrap_or_default();
    if !tuned.is_empty() {
        notes.push(format!(
            "{} tuned codebook launch(es) in the manifest (tuned): a launch's kernel shape is a \
             compile-time choice, rerun kvq gen with --threads/--tile-tokens to take one",
            tuned.len()
        ));
    }
    let kernels = kernels(&decode, &encode);
    let arch = family::arch_name(req);
    let family::Written {
        mut files,
        compiled,
        compiled_lines,
    } = family::write_folder(
        req,
        &[
            (DECODE_FILE, decode.source.as_str()),
            (ENCODE_FILE, encode.source.as_str()),
        ],
        &readme(req, &arch),
        &header_text(req, &layout, &kernels),
        &mut notes,
    )?;
    let sample = match &req.sample {
        Some(s) => {
            let written = sample_codebook::write(&req.out, spec, shape, s)?;
            files.extend(written.files);
            notes.push(written.summary);
            Some(written.dir_name)
        }
        None => None,
    };
    let manifest = Manifest {
        head: ManifestHead::new(req, "codebook", DEVICE_LAYOUT_VERSION),
        params,
        files: family::file_names(&[("decode", DECODE_FILE), ("encode", ENCODE_FILE)]),
        kernels,
        launch: LaunchInfo {
            decode_steps: vec!["decode".into(), "combine".into()],
            notes: vec![
                "decode: grid (num_splits, kv_heads, batch); with num_splits = 1 it writes out \
                 and the combine is skipped (out may be null otherwise)"
                    .into(),
                "combine: grid (q_heads, batch), num_parts = num_splits".into(),
            ],
            num_splits: format!(
                "any value in 1..=1024; the runtime's default: each split at least four tiles of \
                 {} tokens, {}",
                params.tile,
                if params.book_in_shared_memory {
                    "one wave of CTAs at one CTA an SM"
                } else {
                    "two waves of CTAs"
                }
            ),
            fill_steps: vec![
                "host-driven chunk (a prompt, or tokens whose length the host knows): store, grid \
                 (new tokens, kv_heads); then encode_k / encode_v, grid (pages, kv_heads), for \
                 every page the chunk filled"
                    .into(),
                "graph-capturable step (one token a sequence, lengths read on the device, slots[i] \
                 −1 skips a row): step_store, grid (n, kv_heads); step_encode_k / step_encode_v, \
                 grid (n, kv_heads), each codes the page its sequence's token closes; \
                 step_commit, grid (ceil(n / 128)), advances the clean slots' seq_lens by one. A \
                 prompt into an empty slot: set_length(slot, 0, begin = 1), the chunk above with \
                 status + 4·slot, set_length(slot, tokens, 0)"
                    .into(),
                "status: 4 u32 a slot, all zero when clean (zero them once); [0] flags 1 bad input \
                 (NaN, inf or past f16), 2 key norm past f16, 4 value factor past f16; [1] the \
                 first bad token and [2] the first overflowing token, complemented (~word); a \
                 flagged slot takes no step until the host clears it"
                    .into(),
            ],
            scratch: family::split_scratch(),
        },
        layout: layout_info(&layout),
        tuned,
        compiled,
        sample: sample.clone(),
    };
    super::finish(
        &req.out,
        &manifest,
        &manifest.kernels,
        files,
        compiled_lines,
        notes,
    )
}
