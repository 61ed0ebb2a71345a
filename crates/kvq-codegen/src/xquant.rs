//! XQuant's decode unit (`source = x(latent)`): split-K attention over the integer store of the
//! layer input's latents, K rebuilt per tile from `L̂_k·up_k` with RoPE, V never rebuilt
//! (`(Σ p·l̂_v)·up_v` once per split), over `kernels/include/kvq/xquant/decode.cuh`, with the
//! shared combine.

use crate::context::TensorCtx;
use crate::decode::{combine_entry, param, stable_id, KernelEntry, COMBINE_THREADS};
use crate::templates::render;
use crate::{CodegenError, Dtype, KernelShape};
use kvq_spec::{CacheSource, SchemeSpec, TensorQuant, XSource};
use serde::Serialize;

/// Threads of the XQuant decode CTA.
pub const XQUANT_THREADS: u32 = 128;
/// Tokens of a tile (K rebuilt and scored together).
pub const XQUANT_TILE: u32 = 16;
/// Widest latent the unit takes: the tile's latents live in dynamic shared memory as f32.
const MAX_RANK: usize = 2048;

/// Generated XQuant decode and combine kernels for one shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct XQuantKernels {
    pub scheme: String,
    pub shape: KernelShape,
    /// Latent width `R` (the projections' rank).
    pub rank: usize,
    pub source: String,
    /// Grid (num_splits, kv_heads, batch); dynamic shared memory: a tile's latents.
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
    threads: u32,
    tile: u32,
    page: u32,
    sink: u32,
    k: TensorCtx,
    v: TensorCtx,
    decode_name: String,
    combine_name: String,
    combine_threads: u32,
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

fn unsupported(spec: &SchemeSpec, shape: &KernelShape, rank: usize) -> Option<String> {
    match spec.source {
        CacheSource::X(XSource::Latent) => {}
        CacheSource::X(XSource::CrossLayer) => {
            return Some("cross-layer XQuant (the accumulator path is not built yet)".into())
        }
        CacheSource::Kv => return Some("schemes that cache K and V (not XQuant)".into()),
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
            "head_dim {} (a multiple of 32 up to 256: K is rebuilt in 8-column tiles over four warps)",
            shape.head_dim
        ));
    }
    if shape.gqa > XQUANT_TILE || shape.gqa * XQUANT_TILE > XQUANT_THREADS {
        return Some(format!(
            "{} query heads a KV head (at most {})",
            shape.gqa,
            XQUANT_THREADS / XQUANT_TILE
        ));
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
) -> Result<XQuantKernels, CodegenError> {
    let rank = xquant_rank(d_model as usize, kv_heads as usize, shape.head_dim as usize);
    if let Some(what) = unsupported(spec, shape, rank) {
        return Err(CodegenError::Unsupported {
            family: "xquant decode",
            what,
        });
    }
    let latents = latent_spec(spec);
    let id = stable_id(&format!("xquant|{spec}|{shape:?}|{kv_heads}|{d_model}"));
    let ctx = UnitCtx {
        scheme_text: spec.to_string(),
        dtype: match shape.dtype {
            Dtype::F16 => "f16".into(),
            Dtype::Bf16 => "bf16".into(),
        },
        head_dim: shape.head_dim,
        gqa: shape.gqa,
        rank,
        threads: XQUANT_THREADS,
        tile: XQUANT_TILE,
        page: spec.page,
        sink: spec.sink,
        k: TensorCtx::new("k", &latents, &latents.k, rank)?,
        v: TensorCtx::new("v", &latents, &latents.v, rank)?,
        decode_name: format!("kvq_xquant_decode_{id}"),
        combine_name: format!("kvq_combine_{id}"),
        combine_threads: COMBINE_THREADS,
    };
    let source = render("xquant_decode.cu.tera", &ctx)?;
    let decode = KernelEntry {
        name: ctx.decode_name.clone(),
        params: vec![
            param("const uint16_t*", "q"),
            param("const uint8_t*", "k_pool"),
            param("const uint8_t*", "v_pool"),
            param("const int32_t*", "page_table"),
            param("int32_t", "max_pages"),
            param("const uint16_t*", "k_sink"),
            param("const uint16_t*", "v_sink"),
            param("const uint16_t*", "k_tail"),
            param("const uint16_t*", "v_tail"),
            param("const int32_t*", "seq_lens"),
            param("const int32_t*", "seq_slots"),
            param("const uint16_t*", "up_k_hi"),
            param("const uint16_t*", "up_k_lo"),
            param("const float*", "up_v"),
            param("const double*", "rope_freq"),
            param("float*", "part_acc"),
            param("float*", "part_ml"),
        ],
        grid: ["num_splits".into(), "kv_heads".into(), "batch".into()],
        block: XQUANT_THREADS,
        dynamic_shared_bytes: (4 * XQUANT_TILE as usize * rank) as u32,
    };
    let combine = combine_entry(&ctx.combine_name);
    Ok(XQuantKernels {
        scheme: spec.to_string(),
        shape: *shape,
        rank,
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
        let k = xquant_kernels(&spec, &KernelShape::new(128, 4, Dtype::F16), 8, 4096).unwrap();
        assert_eq!(k.rank, 1024);
        assert_eq!(k.decode.dynamic_shared_bytes, 4 * 16 * 1024);
        assert!(k.source.contains("static constexpr int XR = 1024;"));
        assert!(!k.source.contains("{{") && !k.source.contains("{%"));
        assert_eq!(xquant_rank(576, 3, 64), 192);
        assert_eq!(xquant_rank(96, 2, 64), 96);
        for bad in [
            "k = int(2, channel), v = int(2, token), source = x(cross_layer)",
            "k = int(2, channel), v = int(2, token)",
        ] {
            let s: SchemeSpec = bad.parse().unwrap();
            assert!(matches!(
                xquant_kernels(&s, &KernelShape::new(128, 4, Dtype::F16), 8, 4096),
                Err(CodegenError::Unsupported { .. })
            ));
        }
    }
}
