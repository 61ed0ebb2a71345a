//! The cache-maintenance kernels of the integer and FP16 schemes: append, commit, prefill copy, and
//! the page quantizers (from a prefill's input, or from the tail ring when an append fills a page).

use crate::context::{CacheCtx, TensorCtx};
use crate::decode::KernelEntry;
use crate::templates::render;
use crate::{CodegenError, Dtype};
use kvq_spec::{CacheSource, SchemeSpec, TensorQuant};
use serde::Serialize;

/// A page quantizer of one tensor and the dynamic shared memory it needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PageQuantizers {
    /// Quantizes pages of a prefill's input: grid `(jobs, kv_heads)`.
    pub from_input: KernelEntry,
    /// Quantizes the page an append completes, from the tail ring: grid `(n, kv_heads)`.
    pub from_ring: KernelEntry,
}

/// Generated source of one scheme × head_dim × input dtype, and its entry points.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheKernels {
    pub scheme: String,
    pub head_dim: u32,
    pub input_dtype: Dtype,
    pub source: String,
    pub append: KernelEntry,
    pub commit: KernelEntry,
    pub prefill_copy: KernelEntry,
    /// `None` for FP16 tensors (append writes their pages directly).
    pub k_quantizers: Option<PageQuantizers>,
    pub v_quantizers: Option<PageQuantizers>,
}

fn param(ty: &str, name: &str) -> (String, String) {
    (ty.to_string(), name.to_string())
}

fn kernel_id(spec: &SchemeSpec, head_dim: u32, dtype: Dtype) -> String {
    let key = format!("cache|{spec}|{head_dim}|{dtype}");
    let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// Threads of a page quantizer (the template's `*_QTHREADS`).
const QUANTIZER_THREADS: usize = 256;

/// Bytes of dynamic shared memory a page quantizer of this tensor takes (mirrors the template's
/// carving in `*_quantize_staged`): raw values and codes of the page, min/max partials, boost
/// scores, f16 scales and zeros, f32 (scale, reciprocal, zero) per group, boost flags and map.
fn quantizer_smem(t: &TensorCtx, head_dim: usize, page: usize) -> u32 {
    let partials = t.scale_count.max(QUANTIZER_THREADS);
    let codes = if t.needs_code_buffer {
        page * head_dim
    } else {
        0
    };
    (page * head_dim * 2
        + codes
        + 2 * partials * 4
        + head_dim * 4
        + 4 * t.scale_count
        + 12 * t.scale_count
        + 2 * head_dim) as u32
}

/// Renders the cache kernels for a scheme, head_dim and input dtype.
pub fn cache_kernels(
    spec: &SchemeSpec,
    head_dim: u32,
    input_dtype: Dtype,
) -> Result<CacheKernels, CodegenError> {
    if let CacheSource::X(_) = spec.source {
        return Err(CodegenError::Unsupported {
            family: "cache",
            what: format!("`{spec}` (XQuant rematerialisation; the CPU reference covers it)"),
        });
    }
    if [spec.k, spec.v]
        .iter()
        .any(|t| matches!(t, TensorQuant::Codebook(_)))
    {
        return Err(CodegenError::Unsupported {
            family: "cache",
            what: format!("`{spec}` (codebook tensors; the CPU reference covers them)"),
        });
    }
    spec.check_shape(head_dim, 1)?;
    if head_dim > 256 {
        return Err(CodegenError::Shape(format!(
            "cache kernels stage a page in shared memory: head_dim {head_dim} > 256"
        )));
    }
    let d = head_dim as usize;
    let k = TensorCtx::new("k", spec, &spec.k, d)?;
    let v = TensorCtx::new("v", spec, &spec.v, d)?;
    let id = kernel_id(spec, head_dim, input_dtype);
    let ctx = CacheCtx {
        scheme_text: spec.to_string(),
        head_dim,
        dtype: input_dtype.to_string(),
        input_dtype: input_dtype.to_string(),
        page: spec.page,
        sink: spec.sink,
        k: k.clone(),
        v: v.clone(),
        append_name: format!("kvq_append_{id}"),
        commit_name: format!("kvq_commit_{id}"),
        prefill_copy_name: format!("kvq_prefill_copy_{id}"),
        quantize_input_name: format!("quantize_input_{id}"),
        quantize_ring_name: format!("quantize_ring_{id}"),
        input_is_bf16: input_dtype == Dtype::Bf16,
    };
    let source = render("cache.cu.tera", &ctx)?;
    let store_params = || {
        vec![
            param("uint8_t*", "k_pool"),
            param("uint8_t*", "v_pool"),
            param("const int32_t*", "page_table"),
            param("int32_t", "max_pages"),
            param("uint16_t*", "k_sink"),
            param("uint16_t*", "v_sink"),
            param("uint16_t*", "k_tail"),
            param("uint16_t*", "v_tail"),
        ]
    };
    let mut append_params = vec![
        param("const uint16_t*", "k_new"),
        param("const uint16_t*", "v_new"),
        param("const int32_t*", "slots"),
        param("const int32_t*", "seq_lens"),
    ];
    append_params.extend(store_params());
    let mut copy_params = vec![
        param("const uint16_t*", "k_in"),
        param("const uint16_t*", "v_in"),
        param("int32_t", "tokens"),
        param("int32_t", "slot"),
    ];
    copy_params.extend(store_params());
    let quantizers = |t: &TensorCtx| {
        (t.kind == "int").then(|| {
            let smem = quantizer_smem(t, d, spec.page as usize);
            PageQuantizers {
                from_input: KernelEntry {
                    name: format!("{}_{}", t.prefix, ctx.quantize_input_name),
                    params: vec![
                        param("const uint16_t*", "x"),
                        param("const int32_t*", "jobs"),
                        param("uint8_t*", "pool"),
                    ],
                    grid: ["jobs".into(), "kv_heads".into(), "1".into()],
                    block: QUANTIZER_THREADS as u32,
                    dynamic_shared_bytes: smem,
                },
                from_ring: KernelEntry {
                    name: format!("{}_{}", t.prefix, ctx.quantize_ring_name),
                    params: vec![
                        param("const int32_t*", "slots"),
                        param("const int32_t*", "seq_lens"),
                        param("uint8_t*", "pool"),
                        param("const int32_t*", "page_table"),
                        param("int32_t", "max_pages"),
                        param("const uint16_t*", "tail"),
                    ],
                    grid: ["n".into(), "kv_heads".into(), "1".into()],
                    block: QUANTIZER_THREADS as u32,
                    dynamic_shared_bytes: smem,
                },
            }
        })
    };
    Ok(CacheKernels {
        scheme: spec.to_string(),
        head_dim,
        input_dtype,
        append: KernelEntry {
            name: ctx.append_name.clone(),
            params: append_params,
            grid: ["n".into(), "kv_heads".into(), "1".into()],
            block: 128,
            dynamic_shared_bytes: 0,
        },
        commit: KernelEntry {
            name: ctx.commit_name.clone(),
            params: vec![
                param("const int32_t*", "slots"),
                param("int32_t", "n"),
                param("int32_t*", "seq_lens"),
            ],
            grid: ["ceil(n / 128)".into(), "1".into(), "1".into()],
            block: 128,
            dynamic_shared_bytes: 0,
        },
        prefill_copy: KernelEntry {
            name: ctx.prefill_copy_name.clone(),
            params: copy_params,
            grid: ["tokens".into(), "kv_heads".into(), "1".into()],
            block: 128,
            dynamic_shared_bytes: 0,
        },
        k_quantizers: quantizers(&k),
        v_quantizers: quantizers(&v),
        source,
    })
}
