//! The codebook schemes' (CommVQ's) decode unit: a thin translation unit of the two sides' layout
//! traits over `kernels/include/kvq/codebook/decode.cuh`, and its launch metadata.

use super::sides::{side_ctx, SideCtx};
use crate::decode::{cache_params, combine_entry, param, stable_id, KernelEntry, COMBINE_THREADS};
use crate::templates::render;
use crate::{CodegenError, Dtype, KernelShape};
use kvq_reference::commvq::device::{DeviceLayout, SideKind, SideLayout};
use kvq_spec::{CacheSource, Codebook, CodebookQuant, CodebookSpan, SchemeSpec, TensorQuant};
use serde::{Deserialize, Serialize};

/// Threads of a default codebook decode CTA that gathers its key codebook from L2: four warps, a
/// token each at a time.
pub const CODEBOOK_THREADS: u32 = 128;
/// Tokens such a CTA scores before its softmax step (tiles also end at page and region edges).
pub const CODEBOOK_TILE: u32 = 64;
/// Threads and tile of a default CTA that holds its KV head's key codebook in shared memory: a
/// codebook the size of CommVQ-1's (160 KiB) leaves room for one CTA an SM, so sixteen warps to
/// keep the gathers' latency covered. (On an H200 the tuner found four warps gathering from L2,
/// with more splits, faster at long contexts and slower at short ones: BENCHMARKS.md.)
pub const CODEBOOK_SMEM_THREADS: u32 = 512;
pub const CODEBOOK_SMEM_TILE: u32 = 128;
/// Static shared memory a CTA may take (the driver refuses more without an opt-in).
const STATIC_SHARED_LIMIT: usize = 48 * 1024;
/// Shared memory one CTA may take on sm_80 and sm_90 (static plus dynamic, with the opt-in).
const CTA_SHARED_LIMIT: usize = 227 * 1024;

/// A codebook decode's launch shape, what the tuner chooses among ([`codebook_candidates`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CodebookParams {
    /// Threads of a CTA (a multiple of 32; a warp scores one token at a time).
    pub threads: u32,
    /// Tokens a CTA stages and scores before its softmax step.
    pub tile: u32,
    /// Whether a CTA copies its KV head's key codebook into shared memory first (gathers from
    /// there instead of L2); only where it fits beside the tables.
    pub book_in_shared_memory: bool,
}

impl CodebookParams {
    /// The untuned launch: with the codebook in shared memory where it fits at
    /// [`CODEBOOK_SMEM_TILE`] (one CTA an SM, so sixteen warps), otherwise four warps gathering
    /// from L2.
    pub fn default_for(
        spec: &SchemeSpec,
        shape: &KernelShape,
    ) -> Result<CodebookParams, CodegenError> {
        let layout = DeviceLayout::new(spec, 1, shape.head_dim as usize)?;
        Ok(if book_fits(shape, &layout, CODEBOOK_SMEM_TILE) {
            CodebookParams {
                threads: CODEBOOK_SMEM_THREADS,
                tile: CODEBOOK_SMEM_TILE,
                book_in_shared_memory: true,
            }
        } else {
            CodebookParams {
                threads: CODEBOOK_THREADS,
                tile: CODEBOOK_TILE,
                book_in_shared_memory: false,
            }
        })
    }
}

/// Block sizes and tiles the tuner tries (each also with the key codebook in shared memory where
/// it fits): the defaults, half and double their warps, and tiles around them.
const CANDIDATE_THREADS: [u32; 3] = [128, 256, 512];
const CANDIDATE_TILES: [u32; 2] = [64, 128];

/// Every launch shape the codebook decode can take for `spec` at `shape` among the tuner's grid:
/// the default first.
pub fn codebook_candidates(
    spec: &SchemeSpec,
    shape: &KernelShape,
) -> Result<Vec<CodebookParams>, CodegenError> {
    let default = CodebookParams::default_for(spec, shape)?;
    let layout = DeviceLayout::new(spec, 1, shape.head_dim as usize)?;
    let mut out = vec![default];
    for threads in CANDIDATE_THREADS {
        for tile in CANDIDATE_TILES {
            for smem in [false, true] {
                let p = CodebookParams {
                    threads,
                    tile,
                    book_in_shared_memory: smem,
                };
                if p != default && launchable(shape, &layout, &p).is_none() {
                    out.push(p);
                }
            }
        }
    }
    Ok(out)
}

/// Why `p` cannot launch at this shape, if it cannot.
fn launchable(shape: &KernelShape, layout: &DeviceLayout, p: &CodebookParams) -> Option<String> {
    if p.threads == 0 || p.threads % 32 != 0 || p.threads > 1024 {
        return Some(format!(
            "{} threads (a multiple of 32, at most 1024)",
            p.threads
        ));
    }
    if p.tile == 0 || p.tile > 256 {
        return Some(format!("a tile of {} tokens (1 to 256)", p.tile));
    }
    let table = 4 * static_floats(shape, layout, p.tile);
    if table > STATIC_SHARED_LIMIT {
        return Some(format!(
            "a tile of {} tokens: the CTA's tables take {} KiB of shared memory, over {} KiB",
            p.tile,
            table.div_ceil(1024),
            STATIC_SHARED_LIMIT / 1024
        ));
    }
    if p.book_in_shared_memory && !book_fits(shape, layout, p.tile) {
        return Some(format!(
            "the key codebook in shared memory ({} KiB beside {} KiB of tables, over {} KiB, or no RoPE keys)",
            key_book_bytes(layout).div_ceil(1024),
            table.div_ceil(1024),
            CTA_SHARED_LIMIT / 1024
        ));
    }
    None
}

/// Generated source of a codebook scheme's decode and its combine, with the device layout the
/// kernels read (the CPU reference's, `kvq_reference::commvq::device`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CodebookKernels {
    pub scheme: String,
    pub shape: KernelShape,
    pub source: String,
    /// The launch shape it was generated for.
    pub params: CodebookParams,
    /// Whether a CTA holds its KV head's key codebook in shared memory.
    pub book_in_shared_memory: bool,
    /// Tokens a CTA stages and scores at a time.
    pub tile: u32,
    /// Split-K decode: grid (num_splits, kv_heads, batch).
    pub decode: KernelEntry,
    /// Merges the splits: grid (q_heads, batch).
    pub combine: KernelEntry,
    #[serde(skip)]
    pub layout: DeviceLayout,
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
    smem_book: bool,
    decode_name: String,
    combine_name: String,
    combine_threads: u32,
}

/// Whether the codebook decode kernel takes the scheme: K/V caches whose sides are codebooks or
/// FP16, at least one a codebook, additive codebooks of one KV head, no score calibration.
/// (Shapes it refuses are [`codebook_kernels`]'s typed errors.)
pub fn has_codebook_kernel(spec: &SchemeSpec) -> bool {
    let side_ok = |t: &TensorQuant| match t {
        TensorQuant::Fp16 => true,
        TensorQuant::Int(_) => false,
        TensorQuant::Codebook(CodebookQuant {
            codebook: Codebook::Additive { .. },
            span,
        }) => *span == CodebookSpan::Head,
        TensorQuant::Codebook(_) => true,
    };
    spec.source == CacheSource::Kv
        && spec.calibrate.is_none()
        && side_ok(&spec.k)
        && side_ok(&spec.v)
        && [spec.k, spec.v]
            .iter()
            .any(|t| matches!(t, TensorQuant::Codebook(_)))
}

/// Bytes of one KV head's RoPE key codebook as the kernel reads it (f16 re/im pairs), 0 without one.
fn key_book_bytes(layout: &DeviceLayout) -> usize {
    match layout.k.kind {
        SideKind::Rope {
            levels,
            residuals,
            pairs_per_code,
            groups,
            ..
        } => groups * residuals * levels * pairs_per_code * 4,
        _ => 0,
    }
}

/// Floats of the CTA's static shared tables at `tile` tokens.
fn static_floats(shape: &KernelShape, layout: &DeviceLayout, tile: u32) -> usize {
    let rows = |s: &SideLayout| match s.kind {
        SideKind::Additive { rows } => rows,
        _ => 1,
    };
    // Each side's staged tile of codes (kvq_cb_stage_words), and its scales or factors.
    let stage = |s: &SideLayout| match s.kind {
        SideKind::Rope {
            residuals,
            groups,
            code_bits,
            ..
        } => groups * residuals * (tile as usize * code_bits as usize / 32 + 2),
        SideKind::Additive { rows } => rows / 32 * tile as usize,
        SideKind::Fp16 => 1,
    };
    let gqa = shape.gqa as usize;
    gqa * (tile as usize + 5 + shape.head_dim as usize)
        + gqa * rows(&layout.k)
        + gqa * rows(&layout.v)
        + stage(&layout.k)
        + stage(&layout.v)
        + 2 * tile as usize
}

/// Whether a KV head's key codebook fits in a CTA's shared memory beside the tables of a `tile`:
/// gathers from shared memory instead of L2 (every token gathers `2·R·g` entries of it).
fn book_fits(shape: &KernelShape, layout: &DeviceLayout, tile: u32) -> bool {
    let book = key_book_bytes(layout);
    book > 0 && book + 4 * static_floats(shape, layout, tile) <= CTA_SHARED_LIMIT
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

/// The decode and combine kernels of a codebook scheme for one shape, with the default launch
/// ([`CodebookParams::default_for`]).
pub fn codebook_kernels(
    spec: &SchemeSpec,
    shape: &KernelShape,
    kv_heads: u32,
) -> Result<CodebookKernels, CodegenError> {
    codebook_kernels_with(
        spec,
        shape,
        kv_heads,
        &CodebookParams::default_for(spec, shape)?,
    )
}

/// [`codebook_kernels`] with the launch shape `params` (a tuner's choice); shapes that cannot
/// launch are typed errors naming why.
pub fn codebook_kernels_with(
    spec: &SchemeSpec,
    shape: &KernelShape,
    kv_heads: u32,
    params: &CodebookParams,
) -> Result<CodebookKernels, CodegenError> {
    let layout = DeviceLayout::new(spec, kv_heads as usize, shape.head_dim as usize)?;
    if let Some(what) =
        unsupported(spec, shape, &layout).or_else(|| launchable(shape, &layout, params))
    {
        return Err(CodegenError::Unsupported {
            family: "codebook decode",
            what,
        });
    }
    let (threads, tile, smem_book) = (params.threads, params.tile, params.book_in_shared_memory);
    let id = stable_id(&format!(
        "codebook|{spec}|{shape:?}|{kv_heads}|{threads}|{tile}|{smem_book}"
    ));
    let ctx = UnitCtx {
        dtype: match shape.dtype {
            Dtype::F16 => "f16".into(),
            Dtype::Bf16 => "bf16".into(),
        },
        head_dim: shape.head_dim,
        gqa: shape.gqa,
        threads,
        tile,
        page: spec.page,
        sink: spec.sink,
        sides: vec![side_ctx("KSide", &layout.k), side_ctx("VSide", &layout.v)],
        smem_book,
        decode_name: format!("kvq_codebook_decode_{id}"),
        combine_name: format!("kvq_combine_{id}"),
        combine_threads: COMBINE_THREADS,
    };
    let source = render("codebook_decode.cu.tera", &ctx)?;
    let decode = KernelEntry {
        name: ctx.decode_name.clone(),
        params: [
            cache_params(),
            vec![
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
        ]
        .concat(),
        grid: ["num_splits".into(), "kv_heads".into(), "batch".into()],
        block: threads,
        dynamic_shared_bytes: if smem_book {
            key_book_bytes(&layout) as u32
        } else {
            0
        },
    };
    let combine = combine_entry(&ctx.combine_name);
    Ok(CodebookKernels {
        scheme: spec.to_string(),
        shape: *shape,
        source,
        params: *params,
        book_in_shared_memory: smem_book,
        tile,
        decode,
        combine,
        layout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> SchemeSpec {
        SchemeSpec::parse(text).unwrap()
    }

    const COMMVQ1: &str = "k = codebook(rope_commutative, levels = 64, residuals = 10, pairs_per_code = 64, span = token), \
                           v = codebook(additive, rows = 128)";
    const COMMVQ2: &str = "k = codebook(rope_commutative, levels = 64, residuals = 21, pairs_per_code = 64, span = token), \
                           v = codebook(additive, rows = 256)";

    #[test]
    fn the_codebook_kernel_takes_codebook_and_fp16_sides_without_calibration() {
        assert!(has_codebook_kernel(&spec(COMMVQ1)));
        assert!(has_codebook_kernel(&spec(
            "k = fp16, v = codebook(additive, rows = 64)"
        )));
        assert!(!has_codebook_kernel(&spec("k = fp16, v = fp16")));
        assert!(!has_codebook_kernel(&spec(
            "k = int(2, channel), v = codebook(additive, rows = 64)"
        )));
        assert!(!has_codebook_kernel(&spec(
            "k = fp16, v = codebook(additive, rows = 512, span = token)"
        )));
        assert!(!has_codebook_kernel(&spec(
            "k = int(2, channel), v = int(2, token), source = x(latent)"
        )));
    }

    #[test]
    fn shapes_the_kernel_cannot_take_are_typed_errors_naming_why() {
        let shape = KernelShape::new(64, 4, Dtype::F16);
        let sixteen = spec(
            "k = codebook(rope_commutative, levels = 8, residuals = 2, pairs_per_code = 16), v = fp16",
        );
        let e = codebook_kernels(&sixteen, &shape, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("16 pairs a code"), "{e}");
        let wide = KernelShape::new(128, 128, Dtype::F16);
        let e = codebook_kernels(&spec(COMMVQ2), &wide, 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("GQA 128") && e.contains("shared memory"), "{e}");
    }

    #[test]
    fn a_codebook_that_fits_shared_memory_is_held_there_one_cta_an_sm() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let one = codebook_kernels(&spec(COMMVQ1), &shape, 8).unwrap();
        assert!(one.book_in_shared_memory);
        // 10 rounds × 64 entries × 64 pairs, an f16 pair each.
        assert_eq!(one.decode.dynamic_shared_bytes, 10 * 64 * 64 * 4);
        assert_eq!(
            (one.decode.block, one.tile),
            (CODEBOOK_SMEM_THREADS, CODEBOOK_SMEM_TILE)
        );
        assert!(one.source.contains("KVQ_CB_SMEM_BOOK = true"));
        let two = codebook_kernels(&spec(COMMVQ2), &shape, 8).unwrap();
        assert!(!two.book_in_shared_memory);
        assert_eq!(two.decode.dynamic_shared_bytes, 0);
        assert_eq!(
            (two.decode.block, two.tile),
            (CODEBOOK_THREADS, CODEBOOK_TILE)
        );
        // Gathering CommVQ-1's codebook from L2 instead is a candidate; holding CommVQ-2's is not.
        let l2 = CodebookParams {
            threads: CODEBOOK_THREADS,
            tile: CODEBOOK_SMEM_TILE,
            book_in_shared_memory: false,
        };
        assert!(codebook_candidates(&spec(COMMVQ1), &shape)
            .unwrap()
            .contains(&l2));
        let held = CodebookParams {
            book_in_shared_memory: true,
            ..l2
        };
        let e = codebook_kernels_with(&spec(COMMVQ2), &shape, 8, &held).unwrap_err();
        assert!(e.to_string().contains("shared memory"), "{e}");
    }

    #[test]
    fn the_unit_is_thin_traits_and_entry_points() {
        let shape = KernelShape::new(128, 8, Dtype::Bf16);
        let k = codebook_kernels(&spec(COMMVQ2), &shape, 8).unwrap();
        let lines = k.source.lines().count();
        assert!(lines <= 150, "{lines} lines");
        assert!(!k.source.contains("{%") && !k.source.contains("{{"));
        assert!(k.source.contains(&k.decode.name) && k.source.contains(&k.combine.name));
        assert_eq!(k.decode.params.len(), 21);
        assert_eq!(k.decode.params[17], ("double".into(), "rope_theta".into()));
    }

    #[test]
    fn every_candidate_generates_and_the_default_comes_first() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        for (text, smem) in [(COMMVQ1, true), (COMMVQ2, false)] {
            let spec = spec(text);
            let c = codebook_candidates(&spec, &shape).unwrap();
            assert_eq!(c[0], CodebookParams::default_for(&spec, &shape).unwrap());
            assert_eq!(c[0].book_in_shared_memory, smem);
            assert!(c.len() >= 6, "{c:?}");
            // CommVQ-2's codebook never fits; CommVQ-1's does at some tiles.
            assert_eq!(c.iter().any(|p| p.book_in_shared_memory), smem);
            let mut names = std::collections::HashSet::new();
            for p in &c {
                let k = codebook_kernels_with(&spec, &shape, 8, p).unwrap();
                assert_eq!((k.decode.block, k.tile, k.params), (p.threads, p.tile, *p));
                assert!(names.insert(k.decode.name), "{p:?} repeats a kernel name");
            }
        }
    }

    #[test]
    fn launch_shapes_that_cannot_run_are_typed_errors() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let two = spec(COMMVQ2);
        for (p, why) in [
            (
                CodebookParams {
                    threads: 100,
                    tile: 64,
                    book_in_shared_memory: false,
                },
                "threads",
            ),
            (
                CodebookParams {
                    threads: 128,
                    tile: 0,
                    book_in_shared_memory: false,
                },
                "tile",
            ),
            (
                CodebookParams {
                    threads: 128,
                    tile: 64,
                    book_in_shared_memory: true,
                },
                "codebook in shared memory",
            ),
        ] {
            let e = codebook_kernels_with(&two, &shape, 8, &p)
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{p:?}: {e}");
        }
    }
}
