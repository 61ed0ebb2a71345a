//! The cache-maintenance kernels of the integer and FP16 schemes: append, commit, prefill copy, and
//! the page quantizers (from a prefill's input, or from the tail ring when an append fills a page).

use crate::context::{CodeAxis, TensorCtx, TensorKind};
use crate::decode::KernelEntry;
use crate::quantizer::{fold_shape, register_shape, QuantizerForm, QuantizerForms};
use crate::templates::render;
use crate::{CodegenError, Dtype};
use kvq_spec::{CacheSource, SchemeSpec, TensorQuant};
use serde::Serialize;

/// The page quantizer of one integer tensor as `cache.cu.tera` renders its traits struct
/// (kvq/quantize.cuh lists the members) and its two entry points.
#[derive(Debug, Clone, Serialize)]
struct QuantizerCtx {
    /// The traits struct the unit defines (`KQuant` / `VQuant`) and the tensor's layout struct
    /// it extends (`KTensor` / `VTensor`).
    name: &'static str,
    tensor: &'static str,
    /// The tensor's prefix, "k" or "v".
    #[serde(skip)]
    prefix: &'static str,
    form: QuantizerForm,
    /// The kernel's block and its `__launch_bounds__` minimum of CTAs per SM.
    threads: u32,
    min_blocks: u32,
    /// Register forms: rows per thread.
    reg_iter: u32,
    /// Naive/tiled forms: row classes and rows per class of Kitty's score fold.
    fold_rows: u32,
    fold_iter: u32,
    token_warp_reduce: bool,
    lanes_per_group: usize,
    fast_pack: bool,
    needs_code_buffer: bool,
    /// The block's alignment gaps as the C++ type `KvqGaps<KvqGap<offset, len>, …>`.
    padding: String,
    from_input_name: String,
    from_ring_name: String,
}

/// Threads of a naive or tiled page quantizer.
const QUANTIZER_THREADS: u32 = 256;

impl QuantizerCtx {
    fn new(
        (name, tensor): (&'static str, &'static str),
        t: &TensorCtx,
        form: QuantizerForm,
        head_dim: u32,
        page: u32,
        names: (String, String),
    ) -> Self {
        let (reg_threads, reg_iter) = register_shape(head_dim, page).unwrap_or((0, 0));
        let (fold_rows, fold_iter) = fold_shape(page);
        // Registers per thread the register forms fit in without spilling (page data 32, the rest
        // parameters and packing), measured with ptxas: more CTAs per SM hide more load latency.
        let budget = match (t.axis, t.boost) {
            (CodeAxis::Token, _) => 48,
            (_, false) => 80,
            (_, true) => 84,
        };
        let (threads, min_blocks) = if form.in_registers() && reg_threads > 0 {
            let min_blocks = (65_536 / (reg_threads * budget)).clamp(1, 2048 / reg_threads);
            (reg_threads, min_blocks)
        } else {
            (QUANTIZER_THREADS, 1)
        };
        let gaps: Vec<String> = t
            .padding
            .iter()
            .map(|[offset, len]| format!("KvqGap<{offset}, {len}>"))
            .collect();
        QuantizerCtx {
            name,
            tensor,
            prefix: t.prefix,
            form,
            threads,
            min_blocks,
            reg_iter,
            fold_rows,
            fold_iter,
            token_warp_reduce: t.token_warp_reduce,
            lanes_per_group: t.lanes_per_group,
            fast_pack: t.fast_pack,
            needs_code_buffer: t.needs_code_buffer,
            padding: format!("KvqGaps<{}>", gaps.join(", ")),
            from_input_name: names.0,
            from_ring_name: names.1,
        }
    }
}

/// Everything `cache.cu.tera` renders from.
#[derive(Debug, Clone, Serialize)]
struct CacheCtx {
    scheme_text: String,
    head_dim: u32,
    /// Element type of the K/V the engine hands in (the cache's FP16 regions are always f16).
    io: Dtype,
    page: u32,
    sink: u32,
    k: TensorCtx,
    v: TensorCtx,
    /// The integer tensors' page quantizers (none for FP16 tensors).
    quantizers: Vec<QuantizerCtx>,
    append_name: String,
    commit_name: String,
    prefill_copy_name: String,
}

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
    /// The page quantizers' forms this source was rendered with.
    pub quantizer_forms: QuantizerForms,
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

fn kernel_id(spec: &SchemeSpec, head_dim: u32, dtype: Dtype, forms: QuantizerForms) -> String {
    let key = format!("cache|{spec}|{head_dim}|{dtype}|{}|{}", forms.k, forms.v);
    let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// Dynamic shared memory of a page quantizer of tensor `c`. Register forms use a few KB of
/// static shared memory only. The others mirror `kvq_quantize_with` in kvq/cache.cuh: the staged
/// page (tiled), the code buffer, min/max partials, boost scores, f16 scales and zeros, f32
/// (scale, reciprocal, zero) per group, and the boost map.
fn quantizer_shared_bytes(q: &QuantizerCtx, c: &TensorCtx, head_dim: usize, page: usize) -> u32 {
    if q.form.in_registers() {
        return 0;
    }
    let partials = c.scale_count.max(QUANTIZER_THREADS as usize);
    let staged = if q.form == QuantizerForm::Tiled {
        page * head_dim * 2
    } else {
        0
    };
    let codes = if c.needs_code_buffer {
        page * head_dim
    } else {
        0
    };
    // Boost ranks: max(head_dim, 256) ints, and ceil(head_dim / 32) flag words.
    let ranks = if c.boost {
        4 * head_dim.max(256) + 4 * head_dim.div_ceil(32)
    } else {
        0
    };
    let smem = staged
        + codes
        + 2 * partials * 4
        + head_dim * 4
        + 4 * c.scale_count
        + 12 * c.scale_count
        + ranks
        + head_dim;
    smem as u32
}

/// Renders the cache kernels for a scheme, head_dim and input dtype, with each tensor's default
/// page quantizer form ([`QuantizerForms::default_for`]).
pub fn cache_kernels(
    spec: &SchemeSpec,
    head_dim: u32,
    input_dtype: Dtype,
) -> Result<CacheKernels, CodegenError> {
    cache_kernels_with(
        spec,
        head_dim,
        input_dtype,
        QuantizerForms::default_for(spec, head_dim),
    )
}

/// Renders the cache kernels with the given page quantizer forms (the tuner's choice); a form a
/// tensor's layout does not support is an [`CodegenError::Unsupported`].
pub fn cache_kernels_with(
    spec: &SchemeSpec,
    head_dim: u32,
    input_dtype: Dtype,
    forms: QuantizerForms,
) -> Result<CacheKernels, CodegenError> {
    if let CacheSource::X(_) = spec.source {
        return Err(CodegenError::Unsupported {
            family: "cache",
            what: format!(
                "`{spec}` (XQuant latents: no GPU cache writes yet; the CPU reference builds them)"
            ),
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
    // Narrower rows than 64 channels but 32's would leave the page quantizers' warp-per-row
    // paths without a channel a lane; no model has them.
    if head_dim < 64 && head_dim != 32 {
        return Err(CodegenError::Unsupported {
            family: "cache",
            what: format!(
                "head_dim {head_dim}: the cache kernels serve 32 and the multiples of 16 from 64 \
                 to 256"
            ),
        });
    }
    let d = head_dim as usize;
    for (name, t, form) in [("k", &spec.k, forms.k), ("v", &spec.v, forms.v)] {
        if t.is_quantized() && !form.supports(t, head_dim, spec.page) {
            return Err(CodegenError::Unsupported {
                family: "page quantizer",
                what: format!(
                    "the {form} form of {name} = {t} at head_dim {head_dim}, page {}",
                    spec.page
                ),
            });
        }
    }
    let k = TensorCtx::new("k", spec, &spec.k, d)?;
    let v = TensorCtx::new("v", spec, &spec.v, d)?;
    let id = kernel_id(spec, head_dim, input_dtype, forms);
    let quantizers = [
        (("KQuant", "KTensor"), &k, forms.k),
        (("VQuant", "VTensor"), &v, forms.v),
    ]
    .into_iter()
    .filter(|(_, t, _)| t.kind == TensorKind::Int)
    .map(|(names, t, form)| {
        let entry = |what: &str| format!("{}_quantize_{what}_{id}", t.prefix);
        QuantizerCtx::new(
            names,
            t,
            form,
            head_dim,
            spec.page,
            (entry("input"), entry("ring")),
        )
    })
    .collect();
    let ctx = CacheCtx {
        scheme_text: spec.to_string(),
        head_dim,
        io: input_dtype,
        page: spec.page,
        sink: spec.sink,
        k,
        v,
        quantizers,
        append_name: format!("kvq_append_{id}"),
        commit_name: format!("kvq_commit_{id}"),
        prefill_copy_name: format!("kvq_prefill_copy_{id}"),
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
        param("int32_t", "stride"),
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
    let page_quantizers = |t: &TensorCtx| {
        let q = ctx.quantizers.iter().find(|q| q.prefix == t.prefix)?;
        let smem = quantizer_shared_bytes(q, t, d, spec.page as usize);
        Some(PageQuantizers {
            from_input: KernelEntry {
                name: q.from_input_name.clone(),
                params: vec![
                    param("const uint16_t*", "x"),
                    param("const int32_t*", "jobs"),
                    param("const int32_t*", "page_table"),
                    param("uint8_t*", "pool"),
                ],
                grid: [
                    "kv_heads".into(),
                    "jobs (at most 65535 a launch)".into(),
                    "1".into(),
                ],
                block: q.threads,
                dynamic_shared_bytes: smem,
            },
            from_ring: KernelEntry {
                name: q.from_ring_name.clone(),
                params: vec![
                    param("const int32_t*", "slots"),
                    param("const int32_t*", "seq_lens"),
                    param("uint8_t*", "pool"),
                    param("const int32_t*", "page_table"),
                    param("int32_t", "max_pages"),
                    param("const uint16_t*", "tail"),
                ],
                grid: ["n".into(), "kv_heads".into(), "1".into()],
                block: q.threads,
                dynamic_shared_bytes: smem,
            },
        })
    };
    Ok(CacheKernels {
        scheme: spec.to_string(),
        head_dim,
        input_dtype,
        quantizer_forms: forms,
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
        k_quantizers: page_quantizers(&ctx.k),
        v_quantizers: page_quantizers(&ctx.v),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_dims_below_64_but_32_are_typed_errors() {
        let spec =
            SchemeSpec::parse("k = int(2, channel), v = int(2, token), local = 128").unwrap();
        assert!(cache_kernels(&spec, 32, Dtype::F16).is_ok());
        for head_dim in [16, 48] {
            let e = cache_kernels(&spec, head_dim, Dtype::F16).unwrap_err();
            assert!(
                matches!(
                    e,
                    CodegenError::Unsupported {
                        family: "cache",
                        ..
                    }
                ),
                "{e}"
            );
            assert_eq!(
                e.to_string(),
                format!(
                    "no cache kernel for head_dim {head_dim}: the cache kernels serve 32 and the \
                     multiples of 16 from 64 to 256"
                )
            );
        }
    }
}
