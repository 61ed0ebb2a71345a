//! The codebook schemes' (CommVQ's) decode unit: a thin translation unit of the two sides' layout
//! traits over `kernels/include/kvq/codebook/decode.cuh`, and its launch metadata.

use crate::decode::{param, stable_id, KernelEntry, COMBINE_THREADS};
use crate::templates::render;
use crate::{CodegenError, Dtype, KernelShape};
use kvq_reference::commvq::device::{DeviceLayout, SideKind, SideLayout};
use kvq_spec::{CacheSource, SchemeSpec};
use serde::Serialize;

/// Threads of a codebook decode CTA: four warps, a token each at a time.
pub const CODEBOOK_THREADS: u32 = 128;
/// Tokens a CTA scores before its softmax step (tiles also end at page and region edges).
pub const CODEBOOK_TILE: u32 = 64;
/// Static shared memory a CTA may take (the driver refuses more without an opt-in).
const STATIC_SHARED_LIMIT: usize = 48 * 1024;

/// Generated source of a codebook scheme's decode and its combine, with the device layout the
/// kernels read (the CPU reference's, `kvq_reference::commvq::device`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CodebookKernels {
    pub scheme: String,
    pub shape: KernelShape,
    pub source: String,
    /// Split-K decode: grid (num_splits, kv_heads, batch).
    pub decode: KernelEntry,
    /// Merges the splits: grid (q_heads, batch).
    pub combine: KernelEntry,
    #[serde(skip)]
    pub layout: DeviceLayout,
}

#[derive(Serialize)]
struct SideCtx {
    name: &'static str,
    kind: &'static str,
    block_bytes: usize,
    codes_offset: usize,
    scales_offset: usize,
    local: usize,
    tail_cap: usize,
    levels: usize,
    residuals: usize,
    pairs: usize,
    groups: usize,
    code_bits: u32,
    stream_words: usize,
    rows: usize,
}

#[derive(Serialize)]
struct UnitCtx {
    dtype: String,
    head_dim: u32,
    gqa: u32,
    threads: u32,
    tile: u32,
    page: u32,
    sink: u32,
    sides: Vec<SideCtx>,
    decode_name: String,
    combine_name: String,
    combine_threads: u32,
}

fn side_ctx(name: &'static str, s: &SideLayout) -> SideCtx {
    let mut ctx = SideCtx {
        name,
        kind: "Fp16",
        block_bytes: s.block_bytes,
        codes_offset: s.codes.offset,
        scales_offset: s.scales.offset,
        local: s.local,
        tail_cap: s.tail_cap.max(1),
        levels: 1,
        residuals: 1,
        pairs: 32,
        groups: 1,
        code_bits: 2,
        stream_words: 1,
        rows: 32,
    };
    match s.kind {
        SideKind::Fp16 => {}
        SideKind::Rope {
            levels,
            residuals,
            pairs_per_code,
            code_bits,
            groups,
            stream_words,
            ..
        } => {
            ctx.kind = "Rope";
            (ctx.levels, ctx.residuals, ctx.pairs, ctx.groups) =
                (levels, residuals, pairs_per_code, groups);
            (ctx.code_bits, ctx.stream_words) = (code_bits, stream_words);
        }
        SideKind::Additive { rows } => {
            ctx.kind = "Additive";
            ctx.rows = rows;
        }
    }
    ctx
}

/// Why the codebook kernel cannot take this scheme and shape, if it cannot.
fn unsupported(spec: &SchemeSpec, shape: &KernelShape, layout: &DeviceLayout) -> Option<String> {
    let d = shape.head_dim as usize;
    if spec.source != CacheSource::Kv {
        return Some("schemes that cache layer activations (XQuant)".into());
    }
    if spec.calibrate.is_some() {
        return Some("score calibration on codebook-coded keys".into());
    }
    if d % 2 != 0 || d > 256 {
        return Some(format!("head_dim {d} (even, at most 256)"));
    }
    if let SideKind::Rope { pairs_per_code, .. } = layout.k.kind {
        if pairs_per_code % 32 != 0 {
            return Some(format!(
                "RoPE-commutative keys of {pairs_per_code} pairs a code (a multiple of 32: a warp's lanes take a code's pairs)"
            ));
        }
    }
    if matches!(layout.v.kind, SideKind::Rope { .. }) {
        return Some("values coded by a RoPE-commutative codebook".into());
    }
    let rows = |s: &SideLayout| match s.kind {
        SideKind::Additive { rows } => rows,
        _ => 1,
    };
    let gqa = shape.gqa as usize;
    let floats =
        gqa * (CODEBOOK_TILE as usize + 5 + d) + gqa * rows(&layout.k) + gqa * rows(&layout.v);
    if floats * 4 > STATIC_SHARED_LIMIT {
        return Some(format!(
            "GQA {gqa} at head_dim {d}: the CTA's score, code-row and output tables take {} KiB of shared memory, over {} KiB",
            floats * 4 / 1024,
            STATIC_SHARED_LIMIT / 1024
        ));
    }
    None
}

/// The decode and combine kernels of a codebook scheme for one shape.
pub fn codebook_kernels(
    spec: &SchemeSpec,
    shape: &KernelShape,
    kv_heads: u32,
) -> Result<CodebookKernels, CodegenError> {
    let layout = DeviceLayout::new(spec, kv_heads as usize, shape.head_dim as usize)?;
    if let Some(what) = unsupported(spec, shape, &layout) {
        return Err(CodegenError::Unsupported {
            family: "codebook decode",
            what,
        });
    }
    let id = stable_id(&format!(
        "codebook|{spec}|{shape:?}|{kv_heads}|{CODEBOOK_THREADS}|{CODEBOOK_TILE}"
    ));
    let ctx = UnitCtx {
        dtype: match shape.dtype {
            Dtype::F16 => "f16".into(),
            Dtype::Bf16 => "bf16".into(),
        },
        head_dim: shape.head_dim,
        gqa: shape.gqa,
        threads: CODEBOOK_THREADS,
        tile: CODEBOOK_TILE,
        page: spec.page,
        sink: spec.sink,
        sides: vec![side_ctx("KSide", &layout.k), side_ctx("VSide", &layout.v)],
        decode_name: format!("kvq_codebook_decode_{id}"),
        combine_name: format!("kvq_combine_{id}"),
        combine_threads: COMBINE_THREADS,
    };
    let source = render("codebook_decode.cu.tera", &ctx)?;
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
            param("int32_t", "q_len"),
            param("const uint32_t*", "k_book"),
            param("const float*", "k_rows"),
            param("const float*", "k_mean"),
            param("const float*", "v_rows"),
            param("const float*", "v_mean"),
            param("double", "rope_theta"),
            param("float*", "part_acc"),
            param("float*", "part_ml"),
            param("uint16_t*", "out"),
        ],
        grid: ["num_splits".into(), "kv_heads".into(), "batch".into()],
        block: CODEBOOK_THREADS,
        dynamic_shared_bytes: 0,
    };
    let combine = KernelEntry {
        name: ctx.combine_name.clone(),
        params: vec![
            param("const float*", "part_acc"),
            param("const float*", "part_ml"),
            param("uint16_t*", "out"),
            param("float*", "lse"),
            param("int32_t", "num_parts"),
        ],
        grid: ["q_heads".into(), "batch".into(), "1".into()],
        block: COMBINE_THREADS,
        dynamic_shared_bytes: 0,
    };
    Ok(CodebookKernels {
        scheme: spec.to_string(),
        shape: *shape,
        source,
        decode,
        combine,
        layout,
    })
}
