//! The codebook schemes' cache-filling unit: a chunk's FP16 rows and pending rows
//! ([`CodebookEncodeKernels::store`]) and each coded side's page encoder, over
//! `kernels/include/kvq/codebook/encode.cuh`. The encoders write the reference's device layout bit
//! for bit (`kvq_reference::commvq::device`), from the tables of `kvq_reference::commvq::encoder`.

use super::sides::{side_ctx, SideCtx};
use crate::decode::{param, stable_id, KernelEntry};
use crate::templates::render;
use crate::{CodegenError, Dtype};
use kvq_reference::commvq::device::{DeviceLayout, SideKind, SideLayout};
use kvq_spec::{CacheSource, SchemeSpec};
use serde::Serialize;

/// Warps of an encoder CTA: a RoPE key encoder's warp codes up to [`ENCODE_TOKENS`] tokens' group
/// vectors together, an additive encoder's takes four tokens, eight lanes each.
pub const ENCODE_WARPS: u32 = 4;
/// Tokens a RoPE key encoder warp codes together where shared memory allows (fewer otherwise):
/// each table entry it reads serves them all.
pub const ENCODE_TOKENS: u32 = 4;
/// Threads of the row-storing kernel (a CTA a token and KV head, threads over the channels).
pub const STORE_THREADS: u32 = 128;
/// Static shared memory a CTA may take without the opt-in.
const STATIC_SHARED_LIMIT: usize = 48 * 1024;
/// The encoders keep a token's residual in registers and local memory.
const MAX_HEAD_DIM: usize = 256;

/// Generated cache-filling kernels of a codebook scheme at one head size and input format.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CodebookEncodeKernels {
    pub scheme: String,
    pub head_dim: u32,
    pub dtype: Dtype,
    pub source: String,
    /// A chunk's rows: grid (chunk tokens, kv_heads).
    pub store: KernelEntry,
    /// Pages of the key side (absent for FP16 keys): grid (pages, kv_heads).
    pub encode_k: Option<KernelEntry>,
    /// Pages of the value side (absent for FP16 values): grid (pages, kv_heads).
    pub encode_v: Option<KernelEntry>,
    /// Engine steps, lengths read on the device (graph-capturable): one new token of each of `n`
    /// sequences stored (grid (n, kv_heads)), the page it closes on each coded side coded from the
    /// slot's pending ring (grid (n, kv_heads)), then the clean slots' lengths advanced.
    pub steps: CodebookStepKernels,
    #[serde(skip)]
    pub layout: DeviceLayout,
}

/// The step kernels of [`CodebookEncodeKernels`] (kvq/codebook/encode.cuh, "Engine steps").
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CodebookStepKernels {
    /// Each sequence's new token: grid (n, kv_heads).
    pub store: KernelEntry,
    /// The key page the new tokens close: grid (n, kv_heads); absent for FP16 keys.
    pub encode_k: Option<KernelEntry>,
    /// The value page the new tokens close: grid (n, kv_heads); absent for FP16 values.
    pub encode_v: Option<KernelEntry>,
    /// The clean slots' lengths advanced by one: grid (⌈n / 128⌉), block 128.
    pub commit: KernelEntry,
    /// One slot emptied before a prompt (`begin` ≠ 0), or its length set after one if its status
    /// stayed clean: grid (1), block 1.
    pub set_length: KernelEntry,
}

/// u32 status words an engine cache keeps a sequence slot (KVQ_CB_STATUS_WORDS): flags, the first
/// bad input's token and the first overflow's, each complemented; all zero when clean.
pub const CODEBOOK_STATUS_WORDS: usize = 4;

#[derive(Serialize)]
struct EncoderCtx {
    name: String,
    step_name: String,
    side: &'static str,
    threads: u32,
}

#[derive(Serialize)]
struct UnitCtx {
    dtype: String,
    head_dim: u32,
    page: u32,
    sink: u32,
    encode_warps: u32,
    encode_tokens: u32,
    store_threads: u32,
    store_name: String,
    step_store_name: String,
    step_commit_name: String,
    set_length_name: String,
    sides: Vec<SideCtx>,
    encoders: Vec<EncoderCtx>,
}

/// Bytes of a side's encoder's static shared tables (kvq/codebook/encode.cuh) when a RoPE key warp
/// codes `tokens` tokens together.
fn shared_bytes(side: &SideLayout, tokens: usize) -> usize {
    let warps = ENCODE_WARPS as usize;
    match side.kind {
        SideKind::Rope {
            levels,
            residuals,
            pairs_per_code,
            groups,
            ..
        } => {
            8 * warps * tokens * 2 * pairs_per_code
                + 8 * 2 * warps * tokens * levels
                + 4 * groups * residuals * side.page
                + 8 * side.page
        }
        // Eight lanes a token, its residual in shared memory.
        SideKind::Additive { .. } => 8 * warps * 32 / 8 * side.head_dim,
        SideKind::Fp16 => 0,
    }
}

/// Tokens a RoPE key warp codes together: the most of ENCODE_TOKENS, 2, 1 that fit.
fn rope_tokens(side: &SideLayout) -> u32 {
    [ENCODE_TOKENS, 2, 1]
        .into_iter()
        .find(|&t| shared_bytes(side, t as usize) <= STATIC_SHARED_LIMIT)
        .unwrap_or(1)
}

fn unsupported(spec: &SchemeSpec, layout: &DeviceLayout) -> Option<String> {
    if spec.source != CacheSource::Kv {
        return Some("schemes that cache layer activations (XQuant)".into());
    }
    if layout.head_dim > MAX_HEAD_DIM {
        return Some(format!(
            "head_dim {} (at most {MAX_HEAD_DIM})",
            layout.head_dim
        ));
    }
    if let SideKind::Rope { levels, .. } = layout.k.kind {
        if levels > 1024 {
            return Some(format!(
                "{levels} levels (at most 1024: a warp scans every (a, b) pair of a round)"
            ));
        }
    }
    let shared = shared_bytes(&layout.k, 1);
    if shared > STATIC_SHARED_LIMIT {
        return Some(format!(
            "a key page encoder needs {} KiB of shared memory (codes of every round of the page), over {} KiB",
            shared.div_ceil(1024),
            STATIC_SHARED_LIMIT / 1024
        ));
    }
    None
}

fn encoder_entry(name: &str, threads: u32) -> KernelEntry {
    KernelEntry {
        name: name.to_string(),
        params: vec![
            param("const uint16_t*", "src"),
            param("int32_t", "tok_stride"),
            param("int32_t", "head_stride"),
            param("int32_t", "first"),
            param("int32_t", "cap"),
            param("int32_t", "page0"),
            param("int32_t", "slot"),
            param("uint8_t*", "pool"),
            param("const int32_t*", "page_table"),
            param("int32_t", "max_pages"),
            param("const double*", "t0"),
            param("const double*", "t1"),
            param("const double*", "t2"),
            param("const double*", "t3"),
            param("const double*", "t4"),
            param("uint32_t*", "status"),
        ],
        grid: ["pages".into(), "kv_heads".into(), "1".into()],
        block: threads,
        dynamic_shared_bytes: 0,
    }
}

fn store_entry(name: &str) -> KernelEntry {
    KernelEntry {
        name: name.to_string(),
        params: vec![
            param("const uint16_t*", "k_pre"),
            param("const uint16_t*", "k_post"),
            param("const uint16_t*", "v"),
            param("int32_t", "r0"),
            param("int32_t", "t0"),
            param("int32_t", "k_ring_from"),
            param("int32_t", "v_ring_from"),
            param("int32_t", "slot"),
            param("uint8_t*", "k_pool"),
            param("uint8_t*", "v_pool"),
            param("const int32_t*", "page_table"),
            param("int32_t", "max_pages"),
            param("uint16_t*", "k_sink"),
            param("uint16_t*", "v_sink"),
            param("uint16_t*", "k_tail"),
            param("uint16_t*", "v_tail"),
            param("uint16_t*", "k_pending"),
            param("uint16_t*", "v_pending"),
            param("uint32_t*", "status"),
        ],
        grid: ["chunk_tokens".into(), "kv_heads".into(), "1".into()],
        block: STORE_THREADS,
        dynamic_shared_bytes: 0,
    }
}

fn step_encoder_entry(name: &str, threads: u32) -> KernelEntry {
    KernelEntry {
        name: name.to_string(),
        params: vec![
            param("const uint16_t*", "pending"),
            param("const int32_t*", "slots"),
            param("const int32_t*", "seq_lens"),
            param("uint8_t*", "pool"),
            param("const int32_t*", "page_table"),
            param("int32_t", "max_pages"),
            param("const double*", "t0"),
            param("const double*", "t1"),
            param("const double*", "t2"),
            param("const double*", "t3"),
            param("const double*", "t4"),
            param("uint32_t*", "status"),
        ],
        grid: ["n".into(), "kv_heads".into(), "1".into()],
        block: threads,
        dynamic_shared_bytes: 0,
    }
}

fn step_kernels(names: &UnitCtx, encoders: &[EncoderCtx], k: bool, v: bool) -> CodebookStepKernels {
    let mut store = store_entry(&names.step_store_name);
    store.params = vec![
        param("const uint16_t*", "k_pre"),
        param("const uint16_t*", "k_post"),
        param("const uint16_t*", "v"),
        param("const int32_t*", "slots"),
        param("const int32_t*", "seq_lens"),
        param("uint8_t*", "k_pool"),
        param("uint8_t*", "v_pool"),
        param("const int32_t*", "page_table"),
        param("int32_t", "max_pages"),
        param("uint16_t*", "k_sink"),
        param("uint16_t*", "v_sink"),
        param("uint16_t*", "k_tail"),
        param("uint16_t*", "v_tail"),
        param("uint16_t*", "k_pending"),
        param("uint16_t*", "v_pending"),
        param("uint32_t*", "status"),
    ];
    store.grid = ["n".into(), "kv_heads".into(), "1".into()];
    let mut encoders = encoders
        .iter()
        .map(|e| step_encoder_entry(&e.step_name, e.threads));
    let encode_k = if k { encoders.next() } else { None };
    let encode_v = if v { encoders.next() } else { None };
    CodebookStepKernels {
        store,
        encode_k,
        encode_v,
        commit: KernelEntry {
            name: names.step_commit_name.clone(),
            params: vec![
                param("const int32_t*", "slots"),
                param("int32_t", "n"),
                param("int32_t*", "seq_lens"),
                param("const uint32_t*", "status"),
            ],
            grid: ["ceil(n / 128)".into(), "1".into(), "1".into()],
            block: 128,
            dynamic_shared_bytes: 0,
        },
        set_length: KernelEntry {
            name: names.set_length_name.clone(),
            params: vec![
                param("int32_t", "slot"),
                param("int32_t", "len"),
                param("int32_t", "begin"),
                param("int32_t*", "seq_lens"),
                param("uint32_t*", "status"),
            ],
            grid: ["1".into(), "1".into(), "1".into()],
            block: 1,
            dynamic_shared_bytes: 0,
        },
    }
}

/// Threads of a side's page encoder, `None` for an FP16 side.
fn encoder_threads(side: &SideLayout) -> Option<u32> {
    match side.kind {
        SideKind::Fp16 => None,
        SideKind::Rope { .. } | SideKind::Additive { .. } => Some(32 * ENCODE_WARPS),
    }
}

/// The cache-filling kernels of a codebook scheme for `kv_heads` heads of `head_dim` channels
/// handed in `dtype`.
pub fn codebook_encode_kernels(
    spec: &SchemeSpec,
    head_dim: u32,
    dtype: Dtype,
    kv_heads: u32,
) -> Result<CodebookEncodeKernels, CodegenError> {
    let layout = DeviceLayout::new(spec, kv_heads as usize, head_dim as usize)?;
    if let Some(what) = unsupported(spec, &layout) {
        return Err(CodegenError::Unsupported {
            family: "codebook encode",
            what,
        });
    }
    let id = stable_id(&format!(
        "codebook-encode|{spec}|{head_dim}|{dtype:?}|{kv_heads}"
    ));
    let mut encoders = Vec::new();
    let mut entry = |side: &SideLayout, name: &'static str, which: &str| {
        encoder_threads(side).map(|threads| {
            let e = EncoderCtx {
                name: format!("kvq_cb_encode_{which}_{id}"),
                step_name: format!("kvq_cb_step_encode_{which}_{id}"),
                side: name,
                threads,
            };
            let k = encoder_entry(&e.name, threads);
            encoders.push(e);
            k
        })
    };
    let encode_k = entry(&layout.k, "KSide", "k");
    let encode_v = entry(&layout.v, "VSide", "v");
    let ctx = UnitCtx {
        dtype: match dtype {
            Dtype::F16 => "f16".into(),
            Dtype::Bf16 => "bf16".into(),
        },
        head_dim,
        page: spec.page,
        sink: spec.sink,
        encode_warps: ENCODE_WARPS,
        encode_tokens: rope_tokens(&layout.k),
        store_threads: STORE_THREADS,
        store_name: format!("kvq_cb_store_{id}"),
        step_store_name: format!("kvq_cb_step_store_{id}"),
        step_commit_name: format!("kvq_cb_step_commit_{id}"),
        set_length_name: format!("kvq_cb_set_length_{id}"),
        sides: vec![side_ctx("KSide", &layout.k), side_ctx("VSide", &layout.v)],
        encoders,
    };
    let source = render("codebook_encode.cu.tera", &ctx)?;
    let steps = step_kernels(&ctx, &ctx.encoders, encode_k.is_some(), encode_v.is_some());
    Ok(CodebookEncodeKernels {
        scheme: spec.to_string(),
        head_dim,
        dtype,
        source,
        store: store_entry(&ctx.store_name),
        encode_k,
        encode_v,
        steps,
        layout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> SchemeSpec {
        SchemeSpec::parse(text).unwrap()
    }

    const COMMVQ2: &str = "k = codebook(rope_commutative, levels = 64, residuals = 21, pairs_per_code = 64, span = token), \
                           v = codebook(additive, rows = 256)";

    #[test]
    fn a_coded_side_gets_an_encoder_an_fp16_side_none() {
        let both = codebook_encode_kernels(&spec(COMMVQ2), 128, Dtype::F16, 8).unwrap();
        let (k, v) = (both.encode_k.unwrap(), both.encode_v.unwrap());
        assert_eq!((k.block, v.block), (32 * ENCODE_WARPS, 32 * ENCODE_WARPS));
        assert!(both.source.contains("ENCODE_TOKENS = 4;"));
        assert!(both.source.contains(&k.name) && both.source.contains(&v.name));
        assert!(both.source.contains(&both.store.name));
        assert!(both.source.contains("TOKEN_SCALE = true"));
        let keys_only = codebook_encode_kernels(
            &spec("k = fp16, v = codebook(additive, rows = 64), page = 32"),
            64,
            Dtype::Bf16,
            2,
        )
        .unwrap();
        assert!(keys_only.encode_k.is_none());
        assert_eq!(keys_only.encode_v.unwrap().block, 32 * ENCODE_WARPS);
        assert!(keys_only.source.contains("KvqDtype::Bf16"));
    }

    #[test]
    fn the_unit_is_thin() {
        let k = codebook_encode_kernels(&spec(COMMVQ2), 128, Dtype::F16, 8).unwrap();
        // Constants, side traits and ten thin entry points (chunk and step forms).
        assert!(k.source.lines().count() <= 120, "{}", k.source);
        assert!(!k.source.contains("{%") && !k.source.contains("{{"));
        assert_eq!(k.store.params.len(), 19);
        assert_eq!(k.encode_k.unwrap().params.len(), 16);
        let st = &k.steps;
        assert_eq!(st.store.params.len(), 16);
        assert_eq!(st.encode_k.as_ref().unwrap().params.len(), 12);
        assert_eq!(st.encode_v.as_ref().unwrap().params.len(), 12);
        for e in [&st.store, &st.commit, &st.set_length] {
            assert!(
                k.source.contains(&format!(" {}(", e.name)),
                "{} missing",
                e.name
            );
        }
    }

    #[test]
    fn shapes_the_encoder_cannot_take_are_typed_errors() {
        let huge = spec(
            "k = codebook(rope_commutative, levels = 4, residuals = 15, pairs_per_code = 2), v = fp16",
        );
        let e = codebook_encode_kernels(&huge, 128, Dtype::F16, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("shared memory"), "{e}");
        let xq = spec("k = int(2, channel), v = int(2, token), source = x(latent)");
        assert!(codebook_encode_kernels(&xq, 128, Dtype::F16, 2).is_err());
    }
}
