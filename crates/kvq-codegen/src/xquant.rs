//! XQuant's decode unit (`source = x(latent)` and `x(cross_layer)`): split-K attention over the
//! integer store of the layer input's latents, K rebuilt per tile from `L̂_k·up_k` on tensor cores
//! with RoPE, V never rebuilt (`(Σ p·l̂_v)·up_v` once per split), over
//! `kernels/include/kvq/xquant/*.cuh`, with the shared combine.

use crate::context::TensorCtx;
use crate::decode::{combine_entry, paged_params, param, stable_id, KernelEntry, COMBINE_THREADS};
use crate::templates::render;
use crate::{CodegenError, Dtype, KernelShape};
use kvq_reference::xquant::latent_store_width;
use kvq_spec::{Axis, CacheSource, SchemeSpec, TensorQuant, XSource};
use serde::Serialize;

/// Compute threads of the XQuant decode CTA (eight warps: the softmax, V's sums, and on
/// mma.sync K's rebuild too).
pub const XQUANT_THREADS: u32 = 256;
/// The producer warpgroup the warpgroup-MMA rebuild adds (one of its threads copies up_k).
const PRODUCER_THREADS: u32 = 128;
/// Shared-memory stages of the mma.sync rebuild (the warpgroup one takes up to four).
const SYNC_STAGES: usize = 2;
/// Latent channels of one pipeline chunk of K's rebuild (kernels/include/kvq/xquant/decode.cuh's
/// XQ_KC): 64 where the store's heads allow (on mma.sync only for the one-pass product of
/// codes other than 3-bit, on warpgroup MMAs only at one KV head a CTA), else 32 (a chunk never
/// spans two store heads).
fn chunk(
    spec: &SchemeSpec,
    width: usize,
    precision: RebuildPrecision,
    (mma, kv_per_cta): (RebuildMma, usize),
) -> usize {
    let three_bit = matches!(&spec.k, TensorQuant::Int(q) if q.bits == 3);
    let wide = match mma {
        RebuildMma::Warpgroup => kv_per_cta == 1,
        RebuildMma::Sync => precision == RebuildPrecision::F16 && !three_bit,
    };
    if width % 64 == 0 && wide {
        64
    } else {
        32
    }
}
/// Widest latent the unit takes: the split's latent sums (f32, one row a query head) reuse the
/// pipeline's dynamic shared memory.
const MAX_RANK: usize = 2048;
/// Most query heads a KV head (a warp a query head in the softmax).
const MAX_GQA: u32 = XQUANT_THREADS / 32;

/// How K's rebuild `L̂_k·up_k` multiplies on the tensor cores (docs/CODEBOOKS.md §3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
pub enum RebuildPrecision {
    /// Both operands split into two f16 halves and three products summed (hi·hi + hi·lo +
    /// lo·hi): about f32's precision, three times the tensor-core work. For checking the fast
    /// product, or latents whose f16 rounding matters.
    F32,
    /// One product of the f16 roundings of the latents and up_k, f32 sums: K moves by about
    /// 2⁻¹² of its size (1.8e-4 relative in kvq-reference's test), far below what 2- to 4-bit
    /// latents move it, and the decode runs about 1.8× faster.
    #[default]
    F16,
}

impl RebuildPrecision {
    fn passes(self) -> u32 {
        match self {
            Self::F32 => 3,
            Self::F16 => 1,
        }
    }
}

/// Which tensor-core instructions K's rebuild issues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
pub enum RebuildMma {
    /// `mma.sync` (sm_80 on): every warp copies, decodes and multiplies through a two-stage
    /// pipeline.
    #[default]
    Sync,
    /// Hopper's warpgroup MMAs (`wgmma`, sm_90a only): the two compute warpgroups take 64-token
    /// tiles in turn and decode their latents straight into the MMAs' A registers while the
    /// previous chunk multiplies, and one producer thread streams up_k into a ring of up to four
    /// stages. Where the KV heads pair up, a CTA takes two, which share each token's decoded
    /// latents ([`XQuantKernels::kv_heads_per_cta`]). For the one-pass product
    /// ([`RebuildPrecision::F16`]) of `x(latent)` schemes with 2- to 4-bit channel-axis K latents
    /// at head_dim up to 128.
    Warpgroup,
}

impl RebuildMma {
    /// The fastest rebuild for `spec`, `shape` and `precision` over `kv_heads` KV heads and a
    /// layer input `d_model` wide, on a GPU that has warpgroup MMAs (`warpgroups`: an sm_90a
    /// target) or not.
    pub fn best(
        spec: &SchemeSpec,
        shape: &KernelShape,
        (kv_heads, d_model): (u32, u32),
        precision: RebuildPrecision,
        warpgroups: bool,
    ) -> Self {
        let rank = xquant_rank(d_model as usize, kv_heads as usize, shape.head_dim as usize);
        let fits = latent_store_width(spec, rank).is_ok_and(|width| {
            warpgroup_plan(spec, shape, kv_heads as usize, (rank, width)).is_some()
        });
        if warpgroups && fits && warpgroup_refusal(spec, shape, precision).is_none() {
            Self::Warpgroup
        } else {
            Self::Sync
        }
    }

    fn threads(self) -> u32 {
        match self {
            Self::Sync => XQUANT_THREADS,
            Self::Warpgroup => XQUANT_THREADS + PRODUCER_THREADS,
        }
    }
}

/// Why the warpgroup rebuild does not take `spec` at `shape` and `precision`, if it does not.
fn warpgroup_refusal(
    spec: &SchemeSpec,
    shape: &KernelShape,
    precision: RebuildPrecision,
) -> Option<String> {
    if precision != RebuildPrecision::F16 {
        return Some("warpgroup MMAs with the three-pass (f32) rebuild".into());
    }
    if spec.source != CacheSource::X(XSource::Latent) {
        return Some("warpgroup MMAs over cross-layer latents".into());
    }
    if shape.head_dim > 128 {
        return Some(format!(
            "warpgroup MMAs at head_dim {} (up to 128: one m64nDk16 MMA a K step)",
            shape.head_dim
        ));
    }
    match &spec.k {
        TensorQuant::Int(q) if q.axis == Axis::Channel && (2..=4).contains(&q.bits) => None,
        other => Some(format!(
            "warpgroup MMAs over `k = {other}` latents (2- to 4-bit channel-axis codes decode \
             straight into the MMA's registers)"
        )),
    }
}

/// The K order of the warpgroup rebuild's MMAs within each block of 16 latent channels: slot
/// `k` reads channel `order[k]` of the block. A fragment register holds two latents of one code
/// word whose codes lie 16 bits apart (channels `c` and `c + 16 / bits`; 3-bit codes: of the
/// 2-bit plane), so one shift and mask decode both (kernels/include/kvq/xquant/warpgroup.cuh,
/// `xq_pair_channel`); up_k's rows are laid out in the same order. Other widths keep the
/// channels' order.
pub fn rebuild_k_order(spec: &SchemeSpec) -> [usize; 16] {
    let plane_bits = match &spec.k {
        TensorQuant::Int(q) if q.bits == 3 => 2,
        TensorQuant::Int(q) if matches!(q.bits, 2 | 4) => q.bits as usize,
        _ => return std::array::from_fn(|k| k),
    };
    let (per_word, apart) = (32 / plane_bits, 16 / plane_bits);
    std::array::from_fn(|slot| {
        // Slot 8·hi + 2·tq + e is element e of the pair 2·tq + hi of lane tq's fragment.
        let (hi, tq, e) = (slot / 8, slot % 8 / 2, slot % 2);
        let pair = 2 * tq + hi;
        (pair / apart) * per_word + pair % apart + e * apart
    })
}

/// Tokens of a tile (K rebuilt, scored and summed together) for a head size.
pub fn xquant_tile(head_dim: u32) -> u32 {
    if head_dim <= 128 {
        128
    } else {
        64
    }
}

/// Store heads of a latent row whose V sums can run on tensor cores (a scale and zero each per
/// token, kept per tile in shared memory).
const MAX_TENSOR_V_HEADS: usize = 4;

/// Whether V's latent sums run on tensor cores (kernels/include/kvq/xquant/values.cuh): token-axis
/// latents with one group a store head, 2 or 4 bits, at most 1,024 wide in at most four store
/// heads, head rows of whole 16-byte pieces. Other latents sum on CUDA cores.
fn tensor_values(spec: &SchemeSpec, rank: usize, width: usize) -> bool {
    if spec.source != CacheSource::X(XSource::Latent) {
        // XQuant-CL adds its accumulator's latents on CUDA cores.
        return false;
    }
    match &spec.v {
        TensorQuant::Int(q) => {
            q.axis == Axis::Token
                && q.group.map_or(true, |g| g as usize == width)
                && matches!(q.bits, 2 | 4)
                && q.boost.is_none()
                && rank <= 1024
                && rank / width <= MAX_TENSOR_V_HEADS
                && (width * q.bits as usize / 8) % 16 == 0
        }
        _ => false,
    }
}

/// Shared memory an H100/H200 CTA may opt into (227 KiB).
const HOPPER_CTA_SHARED: usize = 227 * 1024;

/// Static shared memory of the warpgroup decode: the arrays of kernels/include/kvq/xquant/decode.cuh
/// at two groups of 64 rows (the queries' fragments; each group's scores, V scales, zeros and
/// weights, row locations and softmax state; RoPE's steps; the ring's barriers), plus 256 bytes
/// for alignment. The ring takes what the CTA's 227 KiB leave.
fn warpgroup_static_bytes(
    spec: &SchemeSpec,
    shape: &KernelShape,
    (rank, width): (usize, usize),
    plan: WarpgroupPlan,
) -> usize {
    let stages = plan.stages;
    // The CTA's query heads.
    let (gqa, d) = (
        plan.kv_per_cta * shape.gqa as usize,
        shape.head_dim as usize,
    );
    let (groups, rows) = (2, 64);
    let tvh = if tensor_values(spec, rank, width) {
        rank / width
    } else {
        1
    };
    // W's rows a store head: four query heads share one n8 tile with their low parts.
    let w_part = if gqa <= 4 { 1 } else { 2 } * 8 * (rows + 8);
    // XqLoc: a flag, two pointers and two ints.
    let location = 32;
    // The queries as the scores' B fragments (kvq/xquant/scores.cuh): an 8-byte pair a lane, k
    // step of 8 columns and n8 tile (four query heads' high and low parts, or eight heads' one).
    let query_tiles = if shape.gqa <= 4 { 1 } else { 2 };
    plan.kv_per_cta * query_tiles * (d / 8) * 32 * 8
        // The scores (the CUDA-core V path's weights reuse them).
        + groups * 4 * gqa * rows
        + groups * 4 * tvh * rows * 2
        + groups * 2 * tvh * w_part
        + groups * location * rows
        + groups * 4 * (2 * gqa + gqa * tvh + 8)
        // RoPE's frequencies (f64) and eight rows' turn (two f32) a pair of columns.
        + (8 + 8) * d / 2
        + 16 * stages
        + 256
}

/// Dynamic shared memory of the decode: the pipeline's stages (latents and up_k, each in one or
/// two f16 parts; the warpgroup path: up_k of each of the CTA's KV heads), the tile's V code
/// rows on the tensor-core path, and the split's latent sums.
fn dynamic_shared_bytes(
    spec: &SchemeSpec,
    shape: &KernelShape,
    (rank, width): (usize, usize),
    precision: RebuildPrecision,
    (mma, plan): (RebuildMma, WarpgroupPlan),
) -> usize {
    let (stages, kv_per_cta) = (plan.stages, plan.kv_per_cta);
    let parts = if precision == RebuildPrecision::F32 {
        2
    } else {
        1
    };
    let tile = xquant_tile(shape.head_dim) as usize;
    let d = shape.head_dim as usize;
    let kc = chunk(spec, width, precision, (mma, kv_per_cta));
    let stage_bytes = match mma {
        // Staged rows: a chunk plus 8 f16 values, so ldmatrix rows fall on distinct banks.
        RebuildMma::Sync => parts * (tile + d) * (kc + 8) * 2,
        // up_k's chunk in core-matrix layout (kvq/xquant/warpgroup.cuh): a K group of 8
        // channels holds its D columns; the latents stay in registers.
        RebuildMma::Warpgroup => kv_per_cta * (kc / 8) * d * 16,
    };
    // The warpgroup path's two tile groups (consumer warpgroups) keep their own latent sums and
    // table of a page's K scale and zero pairs (4 bytes a latent channel).
    let (groups, k_table) = match mma {
        RebuildMma::Sync => (1, 0),
        RebuildMma::Warpgroup => (2, 4 * rank),
    };
    let v_rows = match &spec.v {
        TensorQuant::Int(q) if tensor_values(spec, rank, width) => {
            tile * (rank * q.bits as usize / 8 + 16)
        }
        _ => 0,
    };
    // A query head's sums are padded by four floats (their merge's lanes then meet 32 banks).
    let sums = 4 * kv_per_cta * shape.gqa as usize * (rank + 4);
    stages * stage_bytes + v_rows + groups * (sums + k_table)
}

/// How the warpgroup decode is laid out for one shape: KV heads a CTA and the ring's stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WarpgroupPlan {
    kv_per_cta: usize,
    stages: usize,
}

impl WarpgroupPlan {
    /// The mma.sync decode's: one KV head a CTA, a two-stage pipeline.
    const SYNC: Self = Self {
        kv_per_cta: 1,
        stages: SYNC_STAGES,
    };
}

/// The warpgroup decode's layout, `None` where not even two stages fit. Two KV heads a CTA where
/// the heads pair up, their query heads are at most eight and three or four stages fit beside
/// the rest (twice the latent sums; the latents are decoded once for both heads); else one, and
/// four stages where they fit (many query heads or 4-bit V rows take more room). The stages
/// hold the split's output parts at the end too. More stages than four ran no faster at 2-bit
/// latents and 3% slower at 4-bit ones (the shared memory they take is L1's, which the codes'
/// loads go through).
fn warpgroup_plan(
    spec: &SchemeSpec,
    shape: &KernelShape,
    kv_heads: usize,
    (rank, width): (usize, usize),
) -> Option<WarpgroupPlan> {
    let f16 = RebuildPrecision::F16;
    let d = shape.head_dim as usize;
    let fits = |plan: WarpgroupPlan| {
        let kc = chunk(spec, width, f16, (RebuildMma::Warpgroup, plan.kv_per_cta));
        let stage_bytes = plan.kv_per_cta * (kc / 8) * d * 16;
        let query_heads = plan.kv_per_cta * shape.gqa as usize;
        let output_parts = (XQUANT_THREADS as usize / (d / 4)) * query_heads * d * 4;
        plan.stages * stage_bytes >= output_parts
            && dynamic_shared_bytes(
                spec,
                shape,
                (rank, width),
                f16,
                (RebuildMma::Warpgroup, plan),
            ) + warpgroup_static_bytes(spec, shape, (rank, width), plan)
                <= HOPPER_CTA_SHARED
    };
    let pairs = kv_heads % 2 == 0 && 2 * shape.gqa <= MAX_GQA;
    let paired = (3..=4).rev().map(|stages| WarpgroupPlan {
        kv_per_cta: 2,
        stages,
    });
    let single = (2..=4).rev().map(|stages| WarpgroupPlan {
        kv_per_cta: 1,
        stages,
    });
    paired
        .filter(|_| pairs)
        .chain(single)
        .find(|&plan| fits(plan))
}

/// Generated XQuant decode and combine kernels for one shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct XQuantKernels {
    pub scheme: String,
    pub shape: KernelShape,
    /// Latent width `R` (the projections' rank).
    pub rank: usize,
    /// Channels of one head of the latents' store (`kvq_reference::xquant::latent_store_width`):
    /// the store holds `rank / store_width` heads.
    pub store_width: usize,
    /// How K's rebuild multiplies.
    pub precision: RebuildPrecision,
    /// Which tensor-core instructions it issues.
    pub mma: RebuildMma,
    /// Whether V's latent sums run on tensor cores (else on CUDA cores).
    pub tensor_values: bool,
    pub source: String,
    /// KV heads a CTA of the decode takes (2 where the warpgroup decode pairs them: they share
    /// the decoded latents; else 1).
    pub kv_heads_per_cta: usize,
    /// Grid (num_splits, kv_heads / kv_heads_per_cta, batch); dynamic shared memory: the
    /// rebuild's pipeline, the tile's V code rows, the split's latent sums.
    pub decode: KernelEntry,
    /// Grid (q_heads, batch).
    pub combine: KernelEntry,
}

#[derive(Serialize)]
struct UnitCtx {
    scheme_text: String,
    dtype: String,
    head_dim: u32,
    gqa: u32,
    rank: usize,
    store_width: usize,
    threads: u32,
    wgmma: bool,
    stages: usize,
    kv_per_cta: usize,
    tile: u32,
    passes: u32,
    tensor_v: bool,
    cross_layer: bool,
    smem_bytes: usize,
    page: u32,
    sink: u32,
    k: TensorCtx,
    v: TensorCtx,
    decode_name: String,
    combine_name: String,
    combine_threads: u32,
}

/// Whether `spec` has a GPU decode over its XQuant latents (`source = x(latent)` or
/// `x(cross_layer)` with plain integer latents, uncalibrated); shapes are checked when the kernel
/// is built ([`xquant_kernels`]).
pub fn has_xquant_kernel(spec: &SchemeSpec) -> bool {
    let plain = |t: &TensorQuant| matches!(t, TensorQuant::Int(q) if q.boost.is_none());
    matches!(spec.source, CacheSource::X(_))
        && plain(&spec.k)
        && plain(&spec.v)
        && spec.calibrate.is_none()
}

/// The scheme the latents are stored under: the XQuant spec's quantizers and regions, caching
/// K and V tensors (the latents) rather than the layer input.
pub fn latent_spec(spec: &SchemeSpec) -> SchemeSpec {
    SchemeSpec {
        source: CacheSource::Kv,
        ..*spec
    }
}

/// The latent width of projections from `d_model` to `kv_heads · head_dim`
/// (`kvq_reference::xquant::projection`: the smaller, padded to a multiple of 32).
pub fn xquant_rank(d_model: usize, kv_heads: usize, head_dim: usize) -> usize {
    d_model.min(kv_heads * head_dim).div_ceil(32) * 32
}

fn unsupported(
    spec: &SchemeSpec,
    shape: &KernelShape,
    (kv_heads, rank, width): (usize, usize, usize),
    (precision, mma): (RebuildPrecision, RebuildMma),
) -> Option<String> {
    if spec.source == CacheSource::Kv {
        return Some("schemes that cache K and V (not XQuant)".into());
    }
    for (name, t) in [("k", &spec.k), ("v", &spec.v)] {
        match t {
            TensorQuant::Int(q) if q.boost.is_none() => {}
            other => return Some(format!("`{name} = {other}` latents (integer latents only)")),
        }
    }
    if spec.calibrate.is_some() {
        return Some("calibrated scores".into());
    }
    if shape.head_dim % 32 != 0 || shape.head_dim > 256 {
        return Some(format!(
            "head_dim {} (a multiple of 32 up to 256: K is rebuilt in 8-column mma tiles, each \
             warp holding both RoPE halves)",
            shape.head_dim
        ));
    }
    if shape.gqa == 0 || shape.gqa > MAX_GQA {
        return Some(format!(
            "{} query heads a KV head (1 to {MAX_GQA})",
            shape.gqa
        ));
    }
    if let (RebuildMma::Sync, TensorQuant::Int(q)) = (mma, &spec.k) {
        // A thread stages a row's share of a chunk, 8 to 32 consecutive latents, under one scale
        // (the warpgroup rebuild takes channel-axis K latents only: warpgroup_refusal).
        let kc = chunk(spec, width, precision, (mma, 1));
        let span = xquant_tile(shape.head_dim) as usize * kc / XQUANT_THREADS as usize;
        if q.axis == Axis::Token && q.group.is_some_and(|g| g as usize % span != 0) {
            return Some(format!(
                "K latents in token groups of {} channels (a multiple of {span})",
                q.group.unwrap_or(0)
            ));
        }
    }
    if rank == 0 || rank > MAX_RANK {
        return Some(format!("a latent of {rank} channels (1 to {MAX_RANK})"));
    }
    match mma {
        RebuildMma::Warpgroup => warpgroup_refusal(spec, shape, precision).or_else(|| {
            warpgroup_plan(spec, shape, kv_heads, (rank, width))
                .is_none()
                .then(|| {
                    format!(
                        "warpgroup MMAs with latents of {rank} (two stages and the V rows and \
                         sums pass {HOPPER_CTA_SHARED} bytes of shared memory)"
                    )
                })
        }),
        RebuildMma::Sync => None,
    }
}

/// The XQuant decode of `spec` for `shape` over caches of `kv_heads` KV heads whose layer input
/// is `d_model` wide, K rebuilt at `precision` on `mma` (warpgroup MMAs compile for sm_90a only).
pub fn xquant_kernels(
    spec: &SchemeSpec,
    shape: &KernelShape,
    kv_heads: u32,
    d_model: u32,
    (precision, mma): (RebuildPrecision, RebuildMma),
) -> Result<XQuantKernels, CodegenError> {
    let rank = xquant_rank(d_model as usize, kv_heads as usize, shape.head_dim as usize);
    let width = match spec.source {
        CacheSource::Kv => rank,
        CacheSource::X(_) => {
            latent_store_width(spec, rank).map_err(|e| CodegenError::Unsupported {
                family: "xquant decode",
                what: e.to_string(),
            })?
        }
    };
    if let Some(what) = unsupported(
        spec,
        shape,
        (kv_heads as usize, rank, width),
        (precision, mma),
    ) {
        return Err(CodegenError::Unsupported {
            family: "xquant decode",
            what,
        });
    }
    let latents = latent_spec(spec);
    let id = stable_id(&format!(
        "xquant|{spec}|{shape:?}|{kv_heads}|{d_model}|{precision:?}|{mma:?}"
    ));
    let plan = match mma {
        RebuildMma::Sync => WarpgroupPlan::SYNC,
        RebuildMma::Warpgroup => warpgroup_plan(spec, shape, kv_heads as usize, (rank, width))
            .unwrap_or(WarpgroupPlan::SYNC),
    };
    let ctx = UnitCtx {
        scheme_text: spec.to_string(),
        dtype: match shape.dtype {
            Dtype::F16 => "f16".into(),
            Dtype::Bf16 => "bf16".into(),
        },
        head_dim: shape.head_dim,
        gqa: shape.gqa,
        rank,
        store_width: width,
        threads: mma.threads(),
        wgmma: mma == RebuildMma::Warpgroup,
        stages: plan.stages,
        kv_per_cta: plan.kv_per_cta,
        tile: xquant_tile(shape.head_dim),
        passes: precision.passes(),
        tensor_v: tensor_values(spec, rank, width),
        cross_layer: spec.source == CacheSource::X(XSource::CrossLayer),
        smem_bytes: dynamic_shared_bytes(spec, shape, (rank, width), precision, (mma, plan)),
        page: spec.page,
        sink: spec.sink,
        k: TensorCtx::new("k", &latents, &latents.k, width)?,
        v: TensorCtx::new("v", &latents, &latents.v, width)?,
        decode_name: format!("kvq_xquant_decode_{id}"),
        combine_name: format!("kvq_combine_{id}"),
        combine_threads: COMBINE_THREADS,
    };
    let source = render("xquant_decode.cu.tera", &ctx)?;
    let decode = KernelEntry {
        name: ctx.decode_name.clone(),
        params: paged_params()
            .into_iter()
            .chain([
                param("const uint16_t*", "up_k_hi"),
                param("const uint16_t*", "up_k_lo"),
                param("const uint16_t*", "up_k_groups"),
                param("const float*", "up_v"),
                param("const double*", "rope_freq"),
                param("const uint16_t*", "base_k"),
                param("const uint16_t*", "base_v"),
                param("int32_t", "base_rows"),
                param("float*", "part_acc"),
                param("float*", "part_ml"),
            ])
            .collect(),
        grid: [
            "num_splits".into(),
            if plan.kv_per_cta == 1 {
                "kv_heads".into()
            } else {
                format!("kv_heads / {}", plan.kv_per_cta)
            },
            "batch".into(),
        ],
        block: mma.threads(),
        dynamic_shared_bytes: ctx.smem_bytes as u32,
    };
    let combine = combine_entry(&ctx.combine_name);
    Ok(XQuantKernels {
        scheme: spec.to_string(),
        shape: *shape,
        rank,
        store_width: width,
        precision,
        mma,
        tensor_values: ctx.tensor_v,
        kv_heads_per_cta: plan.kv_per_cta,
        source,
        decode,
        combine,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rebuild_order_permutes_each_block_and_pairs_codes_sixteen_bits_apart() {
        for bits in [2, 3, 4] {
            let text =
                format!("k = int({bits}, channel), v = int({bits}, token), source = x(latent)");
            let spec: SchemeSpec = text.parse().unwrap();
            let order = rebuild_k_order(&spec);
            let mut seen = order;
            seen.sort_unstable();
            assert_eq!(seen, std::array::from_fn(|k| k), "{text}: a permutation");
            let plane = if bits == 3 { 2 } else { bits };
            for slot in (0..16).step_by(2) {
                // A register's two latents: one word, 16 bits apart.
                let (a, b) = (order[slot], order[slot + 1]);
                assert_eq!(
                    a * plane / 32,
                    b * plane / 32,
                    "{text} slot {slot}: one word"
                );
                assert_eq!((b - a) * plane, 16, "{text} slot {slot}: 16 bits apart");
            }
        }
        let eight: SchemeSpec = "k = int(8, channel), v = int(8, token), source = x(latent)"
            .parse()
            .unwrap();
        assert_eq!(rebuild_k_order(&eight), std::array::from_fn(|k| k));
    }

    #[test]
    fn latent_schemes_render_and_others_are_refused() {
        let spec: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(latent)"
            .parse()
            .unwrap();
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let k = xquant_kernels(
            &spec,
            &shape,
            8,
            4096,
            (RebuildPrecision::F32, RebuildMma::Sync),
        )
        .unwrap();
        assert_eq!(k.rank, 1024);
        // Two stages of latents and up_k (128 rows each, 40 f16 a row) in two parts, the tile's
        // 2-bit V rows (256 bytes and 16 of padding), the split's sums (rows padded by 4 floats).
        assert_eq!(
            k.decode.dynamic_shared_bytes,
            2 * 2 * 256 * 40 * 2 + 128 * 272 + 4 * 4 * (1024 + 4)
        );
        assert!(k.source.contains("static constexpr bool TENSOR_V = true;"));
        assert!(k.source.contains("static constexpr int XR = 1024;"));
        assert!(k.source.contains("static constexpr int PASSES = 3;"));
        let fast = xquant_kernels(
            &spec,
            &shape,
            8,
            4096,
            (RebuildPrecision::F16, RebuildMma::Sync),
        )
        .unwrap();
        assert!(fast.source.contains("static constexpr int PASSES = 1;"));
        // One part of chunks of 64 (72 f16 a staged row).
        assert_eq!(
            fast.decode.dynamic_shared_bytes,
            2 * 256 * 72 * 2 + 128 * 272 + 4 * 4 * (1024 + 4)
        );
        assert_ne!(fast.decode.name, k.decode.name);
        // Latents past 1,024 sum V on CUDA cores: no V rows staged.
        let wide = xquant_kernels(
            &spec,
            &KernelShape::new(64, 8, Dtype::F16),
            32,
            2048,
            (RebuildPrecision::F16, RebuildMma::Sync),
        )
        .unwrap();
        assert!(!wide.tensor_values);
        assert_eq!(
            wide.decode.dynamic_shared_bytes,
            2 * (128 + 64) * 72 * 2 + 4 * 8 * (2048 + 4)
        );
        assert!(!k.source.contains("{{") && !k.source.contains("{%"));
        assert_eq!(xquant_rank(576, 3, 64), 192);
        assert_eq!(xquant_rank(96, 2, 64), 96);
        let cl: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(cross_layer)"
            .parse()
            .unwrap();
        let k_cl = xquant_kernels(
            &cl,
            &shape,
            8,
            4096,
            (RebuildPrecision::F16, RebuildMma::Sync),
        )
        .unwrap();
        assert!(k_cl
            .source
            .contains("static constexpr bool CROSS_LAYER = true;"));
        assert!(!k_cl.tensor_values);
        for bad in [
            "k = int(2, channel), v = int(2, token)",
            "k = int(8, token, group = 4), v = int(2, token), source = x(latent)",
        ] {
            let s: SchemeSpec = bad.parse().unwrap();
            assert!(matches!(
                xquant_kernels(
                    &s,
                    &shape,
                    8,
                    4096,
                    (RebuildPrecision::F32, RebuildMma::Sync)
                ),
                Err(CodegenError::Unsupported { .. })
            ));
        }
        assert!(has_xquant_kernel(&spec) && has_xquant_kernel(&cl));
        assert!(!has_xquant_kernel(
            &"k = int(2, channel), v = int(2, token)".parse().unwrap()
        ));
        for (d, gqa) in [(48, 4), (128, 9), (288, 1)] {
            assert!(xquant_kernels(
                &spec,
                &KernelShape::new(d, gqa, Dtype::F16),
                2,
                512,
                (RebuildPrecision::F32, RebuildMma::Sync)
            )
            .is_err());
        }
    }

    #[test]
    fn warpgroup_rebuild_is_chosen_where_it_applies() {
        let spec: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(latent)"
            .parse()
            .unwrap();
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let f16 = RebuildPrecision::F16;
        assert_eq!(
            RebuildMma::best(&spec, &shape, (8, 4096), f16, true),
            RebuildMma::Warpgroup
        );
        assert_eq!(
            RebuildMma::best(&spec, &shape, (8, 4096), f16, false),
            RebuildMma::Sync
        );
        let f32 = RebuildPrecision::F32;
        assert_eq!(
            RebuildMma::best(&spec, &shape, (8, 4096), f32, true),
            RebuildMma::Sync
        );
        let d256 = KernelShape::new(256, 2, Dtype::F16);
        assert_eq!(
            RebuildMma::best(&spec, &d256, (8, 4096), f16, true),
            RebuildMma::Sync
        );
        let cl: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(cross_layer)"
            .parse()
            .unwrap();
        assert_eq!(
            RebuildMma::best(&cl, &shape, (8, 4096), f16, true),
            RebuildMma::Sync
        );
        // Asked for anyway, each is refused with the reason.
        for (s, sh, p) in [
            (&spec, &shape, f32),
            (&spec, &d256, f16),
            (&cl, &shape, f16),
        ] {
            match xquant_kernels(s, sh, 8, 4096, (p, RebuildMma::Warpgroup)) {
                Err(CodegenError::Unsupported { what, .. }) => assert!(what.contains("warpgroup")),
                other => panic!("{s} {sh:?} {p:?}: {other:?}"),
            }
        }
        let k = xquant_kernels(&spec, &shape, 8, 4096, (f16, RebuildMma::Warpgroup)).unwrap();
        assert_eq!(k.decode.block, 384);
        assert!(k.source.contains("#define KVQ_XQ_WGMMA 1"));
        // Two KV heads a CTA (8 KV heads pair up; 8 query heads), so chunks of 32 latents:
        // four stages of both heads' up_k chunk (4 K groups of 128 columns of 16 bytes each),
        // the tile's V rows, and for each of the two tile groups the split's sums of 8 query
        // heads and the page's K scale and zero table.
        assert_eq!(k.kv_heads_per_cta, 2);
        assert_eq!(k.decode.grid[1], "kv_heads / 2");
        assert_eq!(
            k.decode.dynamic_shared_bytes,
            4 * 2 * 4 * 128 * 16 + 128 * 272 + 2 * (4 * 8 * (1024 + 4) + 4 * 1024)
        );
        assert!(k.source.contains("static constexpr int WG_STAGES = 4;"));
        assert!(k.source.contains("static constexpr int KV_PER_CTA = 2;"));
        // The dynamic and static shared memory of `k`, laid out as `plan`, fit a CTA.
        let fits = |k: &XQuantKernels, s: &SchemeSpec, plan| {
            k.decode.dynamic_shared_bytes as usize
                + warpgroup_static_bytes(s, &shape, (1024, 256), plan)
                <= HOPPER_CTA_SHARED
        };
        let paired = |stages| WarpgroupPlan {
            kv_per_cta: 2,
            stages,
        };
        assert!(fits(&k, &spec, paired(4)));
        // An odd number of KV heads does not pair.
        let odd = xquant_kernels(&spec, &shape, 3, 4096, (f16, RebuildMma::Warpgroup)).unwrap();
        assert_eq!(
            (odd.kv_heads_per_cta, odd.decode.grid[1].as_str()),
            (1, "kv_heads")
        );
        // 4-bit V rows at 1,024 latents leave room for three stages at two KV heads a CTA.
        let v4: SchemeSpec = "k = int(4, channel), v = int(4, token), source = x(latent)"
            .parse()
            .unwrap();
        let k4 = xquant_kernels(&v4, &shape, 8, 4096, (f16, RebuildMma::Warpgroup)).unwrap();
        assert_eq!(k4.kv_heads_per_cta, 2);
        assert!(k4.source.contains("static constexpr int WG_STAGES = 3;"));
        assert!(fits(&k4, &v4, paired(3)));
        // K latents the fragments do not decode take mma.sync.
        for text in [
            "k = int(8, channel), v = int(2, token), source = x(latent)",
            "k = int(2, token), v = int(2, token), source = x(latent)",
        ] {
            let other: SchemeSpec = text.parse().unwrap();
            assert_eq!(
                RebuildMma::best(&other, &shape, (8, 4096), f16, true),
                RebuildMma::Sync,
                "{text}"
            );
        }
        let sync = xquant_kernels(&spec, &shape, 8, 4096, (f16, RebuildMma::Sync)).unwrap();
        assert!(sync.source.contains("#define KVQ_XQ_WGMMA 0"));
        assert_ne!(sync.decode.name, k.decode.name);
    }
}
