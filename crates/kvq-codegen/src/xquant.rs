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

/// Threads of the XQuant decode CTA (eight warps).
pub const XQUANT_THREADS: u32 = 256;
/// Latent channels of one pipeline chunk of K's rebuild (kernels/include/kvq/xquant/decode.cuh's
/// XQ_KC): 64 for the one-pass product where the store's heads allow, else 32 (a chunk never
/// spans two store heads).
fn chunk(spec: &SchemeSpec, width: usize, precision: RebuildPrecision) -> usize {
    let three_bit = matches!(&spec.k, TensorQuant::Int(q) if q.bits == 3);
    if precision == RebuildPrecision::F16 && width % 64 == 0 && !three_bit {
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

/// Dynamic shared memory of the decode: two pipeline stages (latents and up_k, each in one or
/// two f16 parts), the tile's V code rows on the tensor-core path, and the split's latent sums.
fn dynamic_shared_bytes(
    spec: &SchemeSpec,
    shape: &KernelShape,
    rank: usize,
    width: usize,
    precision: RebuildPrecision,
) -> usize {
    let parts = if precision == RebuildPrecision::F32 {
        2
    } else {
        1
    };
    let tile = xquant_tile(shape.head_dim) as usize;
    // Staged rows: a chunk plus 8 f16 values, so ldmatrix rows fall on distinct banks.
    let row_stride = chunk(spec, width, precision) + 8;
    let stages = 2 * parts * (tile + shape.head_dim as usize) * row_stride * 2;
    let v_rows = match &spec.v {
        TensorQuant::Int(q) if tensor_values(spec, rank, width) => {
            tile * (rank * q.bits as usize / 8 + 16)
        }
        _ => 0,
    };
    stages + v_rows + 4 * shape.gqa as usize * rank
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
    /// Whether V's latent sums run on tensor cores (else on CUDA cores).
    pub tensor_values: bool,
    pub source: String,
    /// Grid (num_splits, kv_heads, batch); dynamic shared memory: the rebuild's pipeline, the
    /// tile's V code rows, the split's latent sums.
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
    rank: usize,
    width: usize,
    precision: RebuildPrecision,
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
    if let TensorQuant::Int(q) = &spec.k {
        // A thread stages 8 to 32 consecutive latents of a row, under one scale.
        let span = xquant_tile(shape.head_dim) as usize * chunk(spec, width, precision)
            / XQUANT_THREADS as usize;
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
    None
}

/// The XQuant decode of `spec` for `shape` over caches of `kv_heads` KV heads whose layer input
/// is `d_model` wide.
pub fn xquant_kernels(
    spec: &SchemeSpec,
    shape: &KernelShape,
    kv_heads: u32,
    d_model: u32,
    precision: RebuildPrecision,
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
    if let Some(what) = unsupported(spec, shape, rank, width, precision) {
        return Err(CodegenError::Unsupported {
            family: "xquant decode",
            what,
        });
    }
    let latents = latent_spec(spec);
    let id = stable_id(&format!(
        "xquant|{spec}|{shape:?}|{kv_heads}|{d_model}|{precision:?}"
    ));
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
        threads: XQUANT_THREADS,
        tile: xquant_tile(shape.head_dim),
        passes: precision.passes(),
        tensor_v: tensor_values(spec, rank, width),
        cross_layer: spec.source == CacheSource::X(XSource::CrossLayer),
        smem_bytes: dynamic_shared_bytes(spec, shape, rank, width, precision),
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
                param("const float*", "up_v"),
                param("const double*", "rope_freq"),
                param("const float*", "base_k"),
                param("const float*", "base_v"),
                param("int32_t", "base_rows"),
                param("float*", "part_acc"),
                param("float*", "part_ml"),
            ])
            .collect(),
        grid: ["num_splits".into(), "kv_heads".into(), "batch".into()],
        block: XQUANT_THREADS,
        dynamic_shared_bytes: ctx.smem_bytes as u32,
    };
    let combine = combine_entry(&ctx.combine_name);
    Ok(XQuantKernels {
        scheme: spec.to_string(),
        shape: *shape,
        rank,
        store_width: width,
        precision,
        tensor_values: ctx.tensor_v,
        source,
        decode,
        combine,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latent_schemes_render_and_others_are_refused() {
        let spec: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(latent)"
            .parse()
            .unwrap();
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let k = xquant_kernels(&spec, &shape, 8, 4096, RebuildPrecision::F32).unwrap();
        assert_eq!(k.rank, 1024);
        // Two stages of latents and up_k (128 rows each, 40 f16 a row) in two parts, the tile's
        // 2-bit V rows (256 bytes and 16 of padding), the split's sums.
        assert_eq!(
            k.decode.dynamic_shared_bytes,
            2 * 2 * 256 * 40 * 2 + 128 * 272 + 4 * 4 * 1024
        );
        assert!(k.source.contains("static constexpr bool TENSOR_V = true;"));
        assert!(k.source.contains("static constexpr int XR = 1024;"));
        assert!(k.source.contains("static constexpr int PASSES = 3;"));
        let fast = xquant_kernels(&spec, &shape, 8, 4096, RebuildPrecision::F16).unwrap();
        assert!(fast.source.contains("static constexpr int PASSES = 1;"));
        // One part of chunks of 64 (72 f16 a staged row).
        assert_eq!(
            fast.decode.dynamic_shared_bytes,
            2 * 256 * 72 * 2 + 128 * 272 + 4 * 4 * 1024
        );
        assert_ne!(fast.decode.name, k.decode.name);
        // Latents past 1,024 sum V on CUDA cores: no V rows staged.
        let wide = xquant_kernels(
            &spec,
            &KernelShape::new(64, 8, Dtype::F16),
            32,
            2048,
            RebuildPrecision::F16,
        )
        .unwrap();
        assert!(!wide.tensor_values);
        assert_eq!(
            wide.decode.dynamic_shared_bytes,
            2 * (128 + 64) * 72 * 2 + 4 * 8 * 2048
        );
        assert!(!k.source.contains("{{") && !k.source.contains("{%"));
        assert_eq!(xquant_rank(576, 3, 64), 192);
        assert_eq!(xquant_rank(96, 2, 64), 96);
        let cl: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(cross_layer)"
            .parse()
            .unwrap();
        let k_cl = xquant_kernels(&cl, &shape, 8, 4096, RebuildPrecision::F16).unwrap();
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
                xquant_kernels(&s, &shape, 8, 4096, RebuildPrecision::F32),
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
                RebuildPrecision::F32
            )
            .is_err());
        }
    }
}
