//! `kvq gen` for XQuant schemes (`source = x(latent)` and `x(cross_layer)`): the decode unit (the
//! fused decode that rebuilds K from the latents on tensor cores, and the combine), the kernel
//! headers, a C header, a manifest with the latent store's layout (docs/LAYOUT.md §10), the projection tensors the decode reads and how to make them from a projection file
//! (`kvq-projections-1`), and a README.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kvq::codegen::{
    latent_spec, rebuild_k_order, xquant_cross_layer_kernel, xquant_kernels, xquant_project_kernel,
    xquant_tile, RebuildMma, RebuildPrecision, XQuantKernels, XQuantProjectKernel,
};
use kvq::reference::int::LAYOUT_VERSION;
use kvq::reference::xquant::PROJECTION_FILE_FORMAT;
use kvq::{CacheSource, XSource};
use serde::Serialize;

use super::family::{self, buffer, BufferInfo, LaunchInfo, ManifestHead};
use super::manifest::{kernel_info, tensor_info, CompiledInfo, KernelInfo, TensorInfo};
use super::{GenOutcome, GenRequest, DECODE_FILE, HEADER_FILE, INCLUDE_DIR, MANIFEST_FILE};
use crate::error::{CliError, Result};

/// The cache writes' projection unit.
const PROJECT_FILE: &str = "project.cu";
/// XQuant-CL's write steps around the projection (delta, accumulator rows, lift).
const CROSS_LAYER_FILE: &str = "cross_layer.cu";

#[derive(Serialize)]
struct LatentInfo {
    kv_heads: u32,
    d_model: u32,
    /// Channels of each latent (`R`): min(d_model, kv_heads·head_dim), padded to a multiple of 32.
    rank: usize,
    /// `f16` (one product) or `f32` (three split products).
    rebuild: &'static str,
    /// The rebuild's tensor-core instructions: `mma.sync` (sm_80 on) or `wgmma` (Hopper's
    /// warpgroup MMAs, sm_90a only: with `--arch sm_90a`, where the scheme and shape allow).
    mma: &'static str,
    /// Tokens a CTA rebuilds and scores together.
    tile_tokens: u32,
    /// Whether V's latent sums run on tensor cores (else CUDA cores); no effect on results.
    tensor_values: bool,
    cross_layer: bool,
}

#[derive(Serialize)]
struct LayoutInfo {
    version: &'static str,
    doc: &'static str,
    /// A sequence's latent rows of `rank` channels are stored as `store_heads` heads of
    /// `store_head_dim` channels, in the integer store's page blocks and FP16 sink and tail rows
    /// (`kvq_reference::xquant::latent_store_width`).
    store_head_dim: usize,
    store_heads: usize,
    page_tokens: u32,
    sink: u32,
    k: TensorInfo,
    v: TensorInfo,
    buffers: Vec<BufferInfo>,
    projection_file: ProjectionFileInfo,
}

#[derive(Serialize)]
struct ProjectionFileInfo {
    format: &'static str,
    doc: &'static str,
    /// How the decode's projection buffers come from the file's tensors.
    to_buffers: Vec<String>,
}

#[derive(Serialize)]
struct Manifest {
    #[serde(flatten)]
    head: ManifestHead,
    latent: LatentInfo,
    files: BTreeMap<String, String>,
    kernels: Vec<KernelInfo>,
    launch: LaunchInfo,
    layout: LayoutInfo,
    compiled: Vec<CompiledInfo>,
}

fn layout_info(
    req: &GenRequest,
    k: &XQuantKernels,
    project: Option<&XQuantProjectKernel>,
    cross_layer: bool,
) -> Result<LayoutInfo> {
    let latents = latent_spec(&req.scheme.spec);
    let (r, w) = (k.rank, k.store_width);
    let heads = r / w;
    let mut buffers = vec![
        buffer(
            "q / out",
            "[batch][kv_heads·gqa][head_dim]",
            "io dtype",
            "query head h reads KV head h / gqa",
        ),
        buffer(
            "k_pool / v_pool",
            &format!("[physical_pages][{heads}][layout.{{k,v}}.block_bytes]"),
            "u8",
            "a page of a sequence's K (V) latents: one block a store head, its `store_head_dim` \
             channels of each latent row",
        ),
        buffer(
            "page_table",
            "[sequence slots][max_pages]",
            "i32",
            "logical page → physical page, shared by the K and V latents",
        ),
        buffer(
            "k_sink / v_sink",
            &format!("[sequence slots][{heads}][sink][{w}]"),
            "f16",
            "the first tokens' latents",
        ),
        buffer(
            "k_tail / v_tail",
            &format!("[sequence slots][{heads}][tail_capacity][{w}]"),
            "f16",
            "recent tokens' latents, token t at slot (t − sink_end) mod tail_capacity",
        ),
        buffer("seq_lens", "[sequence slots]", "i32", "tokens per sequence"),
        buffer(
            "seq_slots",
            "[batch] or null",
            "i32",
            "row i's sequence slot (null: slot i; −1: a padding row)",
        ),
        buffer(
            "up_k_hi",
            &format!("[kv_heads·head_dim][{r}]"),
            "f16",
            "up_kᵀ (a K column's latent weights contiguous), rounded to nearest",
        ),
        buffer(
            "up_k_lo",
            &format!("[kv_heads·head_dim][{r}]"),
            "f16",
            "what that rounding left, f16(x − hi); read by the f32 rebuild only (may be null for \
             the f16 one)",
        ),
        buffer(
            "up_k_groups",
            &format!("[kv_heads][{r} / 8][head_dim][8]"),
            "f16",
            if k.mma == RebuildMma::Warpgroup {
                "up_k_hi regrouped so that a chunk of latents is one bulk copy (this unit's \
                 warpgroup rebuild reads it, and not up_k_hi)"
            } else {
                "up_k_hi regrouped, read by Hopper's warpgroup rebuild only: this unit runs \
                 mma.sync and takes null"
            },
        ),
        buffer(
            "up_v",
            &format!("[{r}][kv_heads·head_dim]"),
            "f32",
            "the V projection's up factor as in the file",
        ),
        buffer(
            "rope_freq",
            "[head_dim / 2]",
            "f64",
            "theta^(−2i / head_dim): K's pairs (i, i + head_dim/2) turn by position·rope_freq[i]",
        ),
    ];
    buffers.push(if cross_layer {
        buffer(
            "base_k / base_v",
            &format!("[sequence slots][base_rows][{r}]"),
            "f16",
            "XQuant-CL: the accumulator's latents X̂_{i−1}·down_k, X̂_{i−1}·down_v of each token, \
             kept per layer and added to every stored latent; the writes fill a token's row \
             (slot·base_rows + position) (docs/CODEBOOKS.md §3.1 on what keeping them costs)",
        )
    } else {
        buffer(
            "base_k / base_v",
            "null",
            "f32",
            "XQuant-CL only; pass null and base_rows 0",
        )
    });
    let d_model = req.xquant.d_model.unwrap_or(0);
    if let Some(p) = project {
        buffers.push(buffer(
            "down_hi / down_lo",
            &format!("[2·{r}][{d_model}]"),
            "io dtype",
            "the projection's [down_k | down_v] transposed (a latent column's d_model weights \
             contiguous; K's columns, then V's) in two halves of X's format, down ≈ hi + lo",
        ));
        buffers.push(buffer(
            "partial",
            &format!("[{}][n][2·{r}]", p.partitions),
            "f32",
            "scratch of a split narrow projection (one CTA a partition of d_model), read by the \
             reduce; null otherwise",
        ));
        buffers.push(buffer(
            "lat_k / lat_v",
            &format!("[n][{r}]"),
            "f16",
            "the projection's output: the new tokens' latent rows, which the integer cache \
             kernels take as their K and V input ([n][store_heads][store_head_dim])",
        ));
    }
    if cross_layer {
        buffers.push(buffer(
            "x_hat",
            &format!("[n][{d_model}]"),
            "io dtype",
            "XQuant-CL: the accumulator of the new tokens the engine carries from layer to layer \
             (zeros before the first layer), replaced in place by this layer's",
        ));
        buffers.push(buffer(
            "delta",
            &format!("[n][{d_model}]"),
            "io dtype",
            "XQuant-CL: x − x_hat, the projection's input for the stored latents",
        ));
        buffers.push(buffer(
            "acc_k / acc_v",
            &format!("[n][{r}]"),
            "f16",
            "XQuant-CL: the projection of x_hat, copied into base_k / base_v by cl_base",
        ));
        buffers.push(buffer(
            "lift",
            &format!("[2·{r}][{d_model}]"),
            "f32",
            "XQuant-CL: the layer's lift matrix (row j: the X-space delta of a unit latent j, K's \
             then V's), Projections::lift_matrix of the projection file",
        ));
        buffers.push(buffer(
            "lift_partial",
            &format!("[partitions][n][{d_model}]"),
            "f32",
            "XQuant-CL: scratch of a split lift (one CTA a partition of the latents), read by \
             cl_lift_reduce; null otherwise",
        ));
    }
    Ok(LayoutInfo {
        version: LAYOUT_VERSION,
        doc: "docs/LAYOUT.md §10 (latent rows as store heads; page blocks, regions); docs/CODEBOOKS.md §3",
        store_head_dim: w,
        store_heads: heads,
        page_tokens: latents.page,
        sink: latents.sink,
        k: tensor_info(&latents, &latents.k, w)?,
        v: tensor_info(&latents, &latents.v, w)?,
        buffers,
        projection_file: ProjectionFileInfo {
            format: PROJECTION_FILE_FORMAT,
            doc: "crates/kvq-reference/src/xquant/file.rs: safetensors, k.down/k.up/v.down/v.up \
                  F32, k.singular/v.singular F64; metadata kvq.format, kvq.scheme, kvq.d_model, \
                  kvq.kv_heads, kvq.head_dim, kvq.rank",
            to_buffers: vec![
                "up_k_hi[o][r] = f16(k.up[r][o]); up_k_lo[o][r] = f16(k.up[r][o] − up_k_hi[o][r])"
                    .into(),
                format!(
                    "up_k_groups[h][s / 8][j][s % 8] = up_k_hi[h·head_dim + j][16·(s / 16) + \
                     order[s % 16]], order = {:?}: the warpgroup rebuild's K order, each register \
                     of its A fragments two latents of one code word",
                    rebuild_k_order(&req.scheme.spec)
                ),
                "up_v = v.up as stored".into(),
                format!(
                    "down_hi[c][i] = x(down[i][c]), down_lo[c][i] = x(down[i][c] − down_hi[c][i]) \
                     (rounded to nearest in X's format), down = k.down [{d_model} × {r}] for c < \
                     {r}, v.down for the rest: the cache writes' X·down (docs/CODEBOOKS.md §3.1)"
                ),
            ]
            .into_iter()
            .chain(cross_layer.then(|| {
                "XQuant-CL: lift = Projections::lift_matrix() of the file's projections, \
                 D = [k.down | v.down]: Dᵀ·(D·Dᵀ + εI)⁻¹ = (Dᵀ·D + εI)⁻¹·Dᵀ in f64, \
                 ε = 1e-9·trace/d_model (kvq_reference::xquant::lift)"
                    .to_string()
            }))
            .collect(),
        },
    })
}

fn readme(req: &GenRequest, arch: &str, k: &XQuantKernels, project: bool, cl: bool) -> String {
    format!(
        "# kvq generated kernels (XQuant scheme)

scheme: `{scheme}`; head_dim {head_dim}, GQA {gqa}, {dtype}; latents of {rank} channels.

- `{DECODE_FILE}`: the decode unit (the fused split-K decode that rebuilds K from the latents on \
tensor cores and never rebuilds V, and the combine); {targets}.
{project}- `{INCLUDE_DIR}/kvq/`: the kernels' code, CUDA headers the unit `#include \"kvq/…\"`.
- `{HEADER_FILE}`: C header with launch constants and a parameter struct per kernel.
- `{MANIFEST_FILE}`: entry points, launch shapes, the latent store's layout ({LAYOUT_VERSION} at \
latent rows as store heads), the projection buffers and how they come from a `{PROJECTION_FILE_FORMAT}` file.

{compiling}",
        scheme = req.scheme.spec,
        head_dim = req.shape.head_dim,
        gqa = req.shape.gqa,
        dtype = req.shape.dtype,
        rank = k.rank,
        targets = match k.mma {
            RebuildMma::Warpgroup => {
                "sm_90a only (K's rebuild on Hopper's warpgroup MMAs; generate without \
                 `--arch sm_90a` for a unit that runs on sm_80 and later)"
            }
            RebuildMma::Sync => "sm_80 or later",
        },
        compiling = family::compiling_section(arch, DECODE_FILE),
        project = if project {
            format!(
                "- `{PROJECT_FILE}`: the cache writes' projection (new tokens' layer input to f16 \
                 latent rows on tensor cores; the latents' integer scheme's cache kernels, from \
                 `kvq gen` of that scheme at the store head width, then store them).\n{}",
                if cl {
                    format!(
                        "- `{CROSS_LAYER_FILE}`: XQuant-CL's steps around the projection (the \
                         delta against the accumulator the engine carries, the accumulator's \
                         latent rows, the lift to the next layer's accumulator).\n"
                    )
                } else {
                    String::new()
                }
            )
        } else {
            String::new()
        },
    )
}

fn header_text(
    req: &GenRequest,
    k: &XQuantKernels,
    layout: &LayoutInfo,
    kernels: &[KernelInfo],
) -> String {
    let tag = req.prefix.upper();
    let mut h = String::new();
    let guard = family::header_prologue(
        &mut h,
        req,
        LAYOUT_VERSION,
        "docs/LAYOUT.md §10, latent rows as store heads",
    );
    let _ = writeln!(h, "#define {tag}_LATENT_RANK {}", k.rank);
    let _ = writeln!(h, "#define {tag}_STORE_HEAD_DIM {}", k.store_width);
    let _ = writeln!(h, "#define {tag}_STORE_HEADS {}", k.rank / k.store_width);
    let _ = writeln!(h, "#define {tag}_PAGE_TOKENS {}", layout.page_tokens);
    let _ = writeln!(h, "#define {tag}_SINK {}", layout.sink);
    for (side, name) in [(&layout.k, "K"), (&layout.v, "V")] {
        let _ = writeln!(h, "#define {tag}_{name}_BLOCK_BYTES {}", side.block_bytes);
        let _ = writeln!(
            h,
            "#define {tag}_{name}_TAIL_CAPACITY {}",
            side.tail_capacity
        );
    }
    family::header_epilogue(h, req, kernels, &guard)
}

/// Writes the folder for an XQuant scheme; see the module docs.
pub(super) fn generate(req: &GenRequest) -> Result<GenOutcome> {
    let spec = &req.scheme.spec;
    let shape = &req.shape;
    let x = &req.xquant;
    let (Some(kv_heads), Some(d_model)) = (x.kv_heads, x.d_model) else {
        return Err(CliError::Usage(format!(
            "`{}` caches the layer input's latents, whose width follows from the model: give \
             --kv-heads and --d-model",
            req.scheme.label()
        )));
    };
    if req.sample.is_some()
        || req.threads.is_some()
        || req.tile_tokens.is_some()
        || req.min_warps_per_sm.is_some()
        || req.pack_heads.is_some()
        || req.short_staging.is_some()
        || req.store_scores.is_some()
    {
        return Err(CliError::Usage(
            "XQuant schemes take --kv-heads, --d-model and --rebuild (the block flags and \
             --sample are the integer and codebook decodes')"
                .into(),
        ));
    }
    let precision = x.rebuild.unwrap_or_default();
    // Warpgroup MMAs exist on sm_90a only: a folder for any other or no `--arch` runs mma.sync.
    let hopper = req.arch.is_some_and(|a| {
        a.compute_capability() == (9, 0) && a.variant() == kvq::jit::ArchVariant::Specific
    });
    let mma = RebuildMma::best(spec, shape, (kv_heads, d_model), precision, hopper);
    let k = xquant_kernels(spec, shape, kv_heads, d_model, (precision, mma))?;
    let cross_layer = spec.source == CacheSource::X(XSource::CrossLayer);
    let dtype = shape.dtype;
    let mut notes = Vec::new();
    // The writes' projection (and XQuant-CL's steps around it), X in the decode's dtype.
    let project = match xquant_project_kernel(dtype, d_model, k.rank) {
        Ok(p) => Some(p),
        Err(e) => {
            notes.push(format!("no projection unit: {e}"));
            None
        }
    };
    let cl_writes = match (cross_layer, &project) {
        (true, Some(_)) => Some(xquant_cross_layer_kernel(dtype, d_model, k.rank)?),
        _ => None,
    };
    let layout = layout_info(req, &k, project.as_ref(), cross_layer)?;
    let mut kernels = vec![
        kernel_info(
            "decode",
            DECODE_FILE,
            "split-K XQuant decode: per (split, KV head or pair of KV heads as the grid says, \
             sequence), every query head of those KV heads; K rebuilt from the latents per tile on \
             tensor cores with RoPE, V's latents summed and multiplied by up_v once per split; \
             writes a partial per split",
            &k.decode,
            dtype,
        ),
        kernel_info(
            "combine",
            DECODE_FILE,
            "merges the splits' partials into the outputs (and optionally each row's LSE)",
            &k.combine,
            dtype,
        ),
    ];
    let mut units = vec![(DECODE_FILE, k.source.as_str())];
    let mut unit_names = vec![("decode", DECODE_FILE)];
    let mut fill_steps = Vec::new();
    if let Some(p) = &project {
        units.push((PROJECT_FILE, p.source.as_str()));
        unit_names.push(("project", PROJECT_FILE));
        kernels.push(kernel_info(
            "project_narrow",
            PROJECT_FILE,
            "the latents of a few tokens: 32 tokens × 16 latent columns a CTA, one partition of \
             d_model a CTA when split (then the reduce), else every partition",
            &p.narrow,
            dtype,
        ));
        kernels.push(kernel_info(
            "project_wide",
            PROJECT_FILE,
            "the latents of many tokens (prefills): 128 tokens × 64 latent columns a CTA, every \
             partition",
            &p.wide,
            dtype,
        ));
        kernels.push(kernel_info(
            "project_reduce",
            PROJECT_FILE,
            "a split narrow projection's partition sums added in order into the latent rows",
            &p.reduce,
            dtype,
        ));
        fill_steps = vec![
            format!(
                "project n new tokens' X ([n][{d_model}]): project_wide, grid (ceil(n / 128), \
                 2·{r} / 64, 1), when that grid has at least as many CTAs as the GPU has SMs; \
                 else project_narrow, grid (ceil(n / 32), 2·{r} / 16, z), z = {p_count} when \
                 ceil(n / 32)·(2·{r} / 16) < SMs (then project_reduce, grid ceil(n·2·{r} / 256)), \
                 else 1. Every choice gives a token the same latents.",
                r = k.rank,
                p_count = p.partitions
            ),
            "store: lat_k and lat_v are the K and V input of the latents' integer scheme \
             (`kvq gen --scheme '<this scheme without source>' --head-dim <store_head_dim>`, \
             kv_heads = store_heads, f16 input): its append or prefill, page quantizers and \
             commit, as for any integer scheme"
                .into(),
        ];
    }
    if let Some(c) = &cl_writes {
        units.push((CROSS_LAYER_FILE, c.source.as_str()));
        unit_names.push(("cross_layer", CROSS_LAYER_FILE));
        for (role, what, entry) in [
            (
                "cl_delta",
                "XQuant-CL: delta = x − x_hat, rounded to X's format",
                &c.delta,
            ),
            (
                "cl_base",
                "XQuant-CL: the accumulator's f16 latent rows into base_k / base_v: an append's \
                 token i at row slots[i]·rows_a_slot + seq_lens[slots[i]] (before the store's \
                 append counts it; slot −1 skipped), a prefill's (slots null) at row0 + i",
                &c.base,
            ),
            (
                "cl_lift",
                "XQuant-CL: x_hat += [lat_k | lat_v]·lift, in place; one partition of the latents \
                 a CTA when split (then cl_lift_reduce)",
                &c.lift,
            ),
            (
                "cl_lift_reduce",
                "XQuant-CL: a split lift's partition sums added in order, plus x_hat",
                &c.lift_reduce,
            ),
        ] {
            kernels.push(kernel_info(role, CROSS_LAYER_FILE, what, entry, dtype));
        }
        let d = c.d_model;
        fill_steps = vec![
            "XQuant-CL, for each layer in order with the new tokens' x_hat (zeros before the \
             first layer): cl_delta (any grid of 256 threads) writes delta; project delta into \
             lat_k / lat_v and x_hat into acc_k / acc_v, as below"
                .into(),
            fill_steps.first().cloned().unwrap_or_default(),
            "cl_base (any grid of 256 threads): acc_k / acc_v into base_k / base_v at the new \
             tokens' rows, before the store's append counts them in seq_lens"
                .into(),
            fill_steps.get(1).cloned().unwrap_or_default(),
            format!(
                "cl_lift: grid (ceil(n / 32), ceil({d} / 128), z), z = {p} when \
                 ceil(n / 32)·ceil({d} / 128) < SMs (then cl_lift_reduce, grid \
                 ceil(n·{d} / 256)), else 1; lat_k / lat_v still hold the delta's latents. \
                 Every choice gives a token the same accumulator.",
                p = c.partitions
            ),
        ];
    }
    let arch = family::arch_name(req);
    let family::Written {
        files,
        compiled,
        compiled_lines,
    } = family::write_folder(
        req,
        &units,
        &readme(req, &arch, &k, project.is_some(), cl_writes.is_some()),
        &header_text(req, &k, &layout, &kernels),
        &mut notes,
    )?;
    let manifest = Manifest {
        head: ManifestHead::new(req, "xquant", LAYOUT_VERSION),
        latent: LatentInfo {
            kv_heads,
            d_model,
            rank: k.rank,
            rebuild: match precision {
                RebuildPrecision::F16 => "f16",
                RebuildPrecision::F32 => "f32",
            },
            mma: match k.mma {
                RebuildMma::Sync => "mma.sync",
                RebuildMma::Warpgroup => "wgmma",
            },
            tile_tokens: xquant_tile(shape.head_dim),
            tensor_values: k.tensor_values,
            cross_layer,
        },
        files: family::file_names(&unit_names),
        kernels,
        launch: LaunchInfo {
            decode_steps: vec!["decode".into(), "combine".into()],
            notes: vec![
                format!(
                    "decode: grid ({}), block {}, the dynamic shared memory the kernel entry \
                     states; always followed by the combine",
                    k.decode.grid.join(", "),
                    k.decode.block
                ),
                "combine: grid (q_heads, batch), num_parts = num_splits".into(),
            ],
            num_splits: format!(
                "any value in 1..=1024; the runtime's default: floor(SMs / (batch·{})) (one \
                 wave at one CTA an SM), at most one split a tile of {} tokens, then the fewest \
                 splits with the same tiles each",
                k.decode.grid[1],
                xquant_tile(shape.head_dim)
            ),
            fill_steps,
            scratch: family::split_scratch(),
        },
        layout,
        compiled,
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
