//! Plans: a scheme and a shape with its limits, checked once, that say what device memory an engine
//! must give kvq's kernels. Making a plan needs no GPU; a plan is immutable, so one plan may be
//! read from any number of threads at once.

use std::ffi::{c_char, CStr, CString};

use kvq::codegen::{
    codebook_encode_kernels, codebook_kernels, decode_kernels, has_xquant_kernel, latent_spec,
    xquant_kernels, CodegenError, Dtype, KernelShape, RebuildMma, RebuildPrecision, TuneParams,
    MAX_GQA,
};
use kvq::reference::xquant::latent_store_width;
use kvq::runtime::codebook::CodebookSizes;
use kvq::runtime::xquant::XQuantWeightsLayout;
use kvq::runtime::{CacheConfig, CacheSizes};
use kvq::SchemeSpec;
use kvq::{CacheSource, XSource};
use kvq::{Codebook, TensorQuant};

use crate::gpu::PlanGpus;
use crate::status::{call, Failure, KvqStatus};

/// Query and output element type: `half`.
pub const KVQ_DTYPE_F16: u32 = 0;
/// Query and output element type: `__nv_bfloat16`.
pub const KVQ_DTYPE_BF16: u32 = 1;

/// Alignment, in bytes, every buffer of a plan needs (what `cudaMalloc` returns).
pub const KVQ_BUFFER_ALIGNMENT: u64 = 256;

/// The shape and limits a plan is made for. Every field must be set; none but `rope_theta` and
/// `d_model` may be 0.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvqPlanLimits {
    /// Channels per head: 64 to 256 in multiples of 16.
    pub head_dim: u32,
    /// Query heads per sequence.
    pub q_heads: u32,
    /// KV heads per sequence; divides `q_heads`.
    pub kv_heads: u32,
    /// `KVQ_DTYPE_F16` or `KVQ_DTYPE_BF16`: the element type of queries, outputs and new K/V.
    pub dtype: u32,
    /// Sequence slots: sequences that hold FP16 state (sink and tail windows) at once.
    pub max_seqs: u32,
    /// Longest sequence, in tokens.
    pub max_seq_len: u32,
    /// Pages in the engine's page pool (each holds one page of K and V for every KV head).
    pub pool_pages: u32,
    /// Most query tokens a sequence in one step (1: decode only; more: speculative-decoding
    /// verification, each token seeing the tokens up to itself). Codebook schemes take 1.
    pub max_q_len: u32,
    /// RoPE base of the model's keys (e.g. 500000 for LLaMA-3). Codebook schemes with
    /// RoPE-commutative keys need it: they code keys before RoPE and rotate them in the decode.
    /// XQuant schemes rebuild keys from latents and rotate them in the decode: they need it too.
    /// Other schemes ignore it (0 is fine).
    pub rope_theta: f64,
    /// Width of the layer input X (the model's hidden size). XQuant schemes (`source =
    /// x(latent)`) cache X's latents instead of K and V and take X in their writes
    /// (`kvq_xquant_prefill`, `kvq_xquant_append`); other schemes ignore it (0 is fine).
    pub d_model: u32,
}

/// Sizes that follow from a plan.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvqPlanInfo {
    /// Tokens of one page (the scheme's quantization group along tokens).
    pub page_tokens: u32,
    /// Columns of the page (block) table: logical pages of the longest sequence.
    pub max_pages_per_seq: u32,
    /// FP16 sink tokens a sequence keeps before its first page.
    pub sink_tokens: u32,
    /// Bytes of one K page block of one KV head.
    pub k_block_bytes: u64,
    /// Bytes of one V page block of one KV head.
    pub v_block_bytes: u64,
    /// Bytes of one pool page: K and V blocks of every KV head.
    pub page_bytes: u64,
    /// Bytes of one sequence slot's FP16 state (sinks and tail rings of K and V).
    pub state_bytes_per_seq: u64,
    /// Bytes of every buffer of the plan together.
    pub total_bytes: u64,
}

/// One device buffer an engine allocates for a plan and hands to every call.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvqBuffer {
    /// The buffer's name, e.g. `"k_pool"` (static storage).
    pub name: *const c_char,
    /// Bytes to allocate. 0: the scheme does not use this buffer (pass any pointer, or NULL).
    pub bytes: u64,
    /// Alignment the kernels need, in bytes.
    pub alignment: u64,
    /// How the buffer is indexed (static storage).
    pub layout: *const c_char,
}

/// A checked scheme, shape and limits: what memory the engine must give kvq's kernels, and the
/// kernels loaded for it on each GPU it has run on. Opaque to C.
#[derive(Debug)]
pub struct KvqPlan {
    spec: SchemeSpec,
    limits: KvqPlanLimits,
    dtype: Dtype,
    sizes: CacheSizes,
    scheme_text: CString,
    /// A codebook scheme's own sizes (pending rings, status words, codebook buffer).
    codebook: Option<CodebookSizes>,
    /// An XQuant scheme's own sizes (latent store heads, packed projections).
    xquant: Option<XQuantSizes>,
    pub(crate) loaded: PlanGpus,
}

/// The buffers of every plan, in the order `kvq_plan_buffer` numbers them (and `KvqCache` holds
/// them).
const BUFFERS: [(&CStr, &CStr); 14] = [
    (
        c"k_pool",
        c"[pool page][kv_head][k_block_bytes] bytes: K page blocks (docs/LAYOUT.md)",
    ),
    (
        c"v_pool",
        c"[pool page][kv_head][v_block_bytes] bytes: V page blocks (docs/LAYOUT.md)",
    ),
    (
        c"k_sink",
        c"[sequence slot][kv_head][sink_tokens][head_dim] f16: K's FP16 sink tokens",
    ),
    (
        c"v_sink",
        c"[sequence slot][kv_head][sink_tokens][head_dim] f16: V's FP16 sink tokens",
    ),
    (
        c"k_tail",
        c"[sequence slot][kv_head][ring][head_dim] f16: K's FP16 local window and open page",
    ),
    (
        c"v_tail",
        c"[sequence slot][kv_head][ring][head_dim] f16: V's FP16 local window and open page",
    ),
    (
        c"seq_lens",
        c"[sequence slot] i32: tokens each slot holds, kept by kvq_prefill and kvq_append",
    ),
    (
        c"page_table",
        c"[sequence slot][max_pages_per_seq] i32: the engine's block table, pool page of each \
          logical page (written by the engine before a call fills the page)",
    ),
    (
        c"k_pending",
        c"[sequence slot][kv_head][ring][head_dim] 16-bit: codebook schemes' K inputs not yet coded",
    ),
    (
        c"v_pending",
        c"[sequence slot][kv_head][ring][head_dim] 16-bit: codebook schemes' V inputs not yet coded",
    ),
    (
        c"status",
        c"[sequence slot][4] u32, zeroed by the engine once: what a codebook scheme's encoders \
          found wrong (read by kvq_cache_check)",
    ),
    (
        c"codebooks",
        c"one layer's codebooks and encoder tables, written by kvq_codebooks_load",
    ),
    (
        c"xquant_weights",
        c"one layer's XQuant projections (up_k, up_v, down, RoPE frequencies; XQuant-CL's lift \
          matrix), written by kvq_xquant_weights_load",
    ),
    (
        c"xquant_accumulator",
        c"[2][sequence slot][max_seq_len][latent width] f16: XQuant-CL's accumulator latents of \
          every token (K's, then V's), written by the cross-layer prefill and append",
    ),
];

/// What an XQuant plan keeps beside the integer sizes of its latent store.
#[derive(Debug, Clone, Copy)]
pub struct XQuantSizes {
    /// The packed projections' layout (buffer `xquant_weights`).
    pub weights: XQuantWeightsLayout,
    /// Heads of the latent store (the page blocks' "KV heads"): `rank / store_width`.
    pub store_heads: usize,
    /// Channels a store head.
    pub store_width: usize,
    /// XQuant-CL's accumulator latents (buffer `xquant_accumulator`; 0 for `x(latent)`).
    pub accumulator_bytes: usize,
}

impl KvqPlan {
    /// Checks `scheme` (a built-in's name such as `kivi2`, or scheme text) against `limits`.
    pub fn new(scheme: &str, limits: &KvqPlanLimits) -> Result<KvqPlan, Failure> {
        let spec = resolve_scheme(scheme)?;
        let dtype = check_limits(limits)?;
        let shape = KernelShape::new(limits.head_dim, limits.q_heads / limits.kv_heads, dtype);
        if is_codebook(&spec) {
            return Self::codebook(spec, limits, dtype, &shape);
        }
        if matches!(spec.source, CacheSource::X(_)) {
            return Self::xquant(spec, limits, dtype, &shape);
        }
        check_fast_kernel(&spec, &shape)?;
        // The shape passed check_fast_kernel; what is left to fail is sizes past the address space.
        let heads = (limits.kv_heads as usize, limits.head_dim as usize);
        let sizes = integer_store(&spec, &spec, limits, heads, dtype)?;
        Self::assemble(spec, limits, dtype, sizes, None, None)
    }

    /// The plan of `spec` with its sizes, an integer plan's where `codebook` and `xquant` are
    /// `None`.
    fn assemble(
        spec: SchemeSpec,
        limits: &KvqPlanLimits,
        dtype: Dtype,
        sizes: CacheSizes,
        codebook: Option<CodebookSizes>,
        xquant: Option<XQuantSizes>,
    ) -> Result<KvqPlan, Failure> {
        let scheme_text = scheme_text(&spec)?;
        Ok(KvqPlan {
            spec,
            limits: *limits,
            dtype,
            sizes,
            scheme_text,
            codebook,
            xquant,
            loaded: PlanGpus::default(),
        })
    }

    /// A plan of an XQuant scheme: the decode generated once to check the shape, the latent
    /// store sized as the integer plan of its latents at `rank / store_width` heads of
    /// `store_width`, the projections' buffer by [`XQuantWeightsLayout`].
    fn xquant(
        spec: SchemeSpec,
        limits: &KvqPlanLimits,
        dtype: Dtype,
        shape: &KernelShape,
    ) -> Result<KvqPlan, Failure> {
        let refuse = |status, what: String| Err(Failure::new(status, what));
        if !has_xquant_kernel(&spec) {
            return refuse(
                KvqStatus::UnsupportedScheme,
                format!("no GPU kernel for `{spec}` (XQuant takes plain int(...) latents)"),
            );
        }
        if limits.d_model == 0 {
            return Err(Failure::argument(format!(
                "limits.d_model is 0: `{spec}` caches the layer input's latents, so it needs the \
                 model's hidden size"
            )));
        }
        check_rope_base(limits, &spec, "rebuilds keys from latents")?;
        check_one_query_token(limits, "XQuant schemes")?;
        let (kv_heads, head_dim) = (limits.kv_heads as usize, limits.head_dim as usize);
        let cross_layer = matches!(spec.source, CacheSource::X(XSource::CrossLayer));
        let weights =
            XQuantWeightsLayout::new(kv_heads, head_dim, limits.d_model as usize, cross_layer)
                .ok_or_else(|| {
                    Failure::argument("the projections' sizes pass the address space")
                })?;
        let mma = (RebuildPrecision::F16, RebuildMma::Sync);
        xquant_kernels(&spec, shape, limits.kv_heads, limits.d_model, mma)
            .map_err(|e| generation_refused(&spec, limits.head_dim, e))?;
        let store_width = latent_store_width(&spec, weights.rank)
            .map_err(|e| Failure::new(KvqStatus::UnsupportedShape, format!("`{spec}`: {e}")))?;
        let store_heads = weights.rank / store_width;
        // The latents arrive as f16 rows, whatever the plan's dtype.
        let sizes = integer_store(
            &spec,
            &latent_spec(&spec),
            limits,
            (store_heads, store_width),
            Dtype::F16,
        )?;
        // The kernels index the accumulator's rows (slot · max_seq_len + position) in 32 bits.
        let token_slots = limits.max_seqs as u64 * limits.max_seq_len as u64;
        let accumulator_bytes = match cross_layer {
            false => Some(0),
            true if i32::try_from(token_slots).is_err() => None,
            true => (4 * weights.rank).checked_mul(token_slots as usize),
        }
        .ok_or_else(|| {
            Failure::argument(format!(
                "`{spec}`: {} slots of {} tokens pass the accumulator's 32-bit row index",
                limits.max_seqs, limits.max_seq_len
            ))
        })?;
        let xquant = XQuantSizes {
            weights,
            store_heads,
            store_width,
            accumulator_bytes,
        };
        Self::assemble(spec, limits, dtype, sizes, None, Some(xquant))
    }

    /// A plan of a codebook scheme: its kernels generated once to check the shape, its sizes
    /// from the device layout.
    fn codebook(
        spec: SchemeSpec,
        limits: &KvqPlanLimits,
        dtype: Dtype,
        shape: &KernelShape,
    ) -> Result<KvqPlan, Failure> {
        check_one_query_token(limits, "codebook schemes")?;
        let rope = matches!(
            spec.k,
            TensorQuant::Codebook(c) if matches!(c.codebook, Codebook::RopeCommutative { .. })
        );
        if rope {
            check_rope_base(limits, &spec, "codes keys before RoPE")?;
        }
        let generated = codebook_kernels(&spec, shape, limits.kv_heads)
            .and_then(|_| codebook_encode_kernels(&spec, limits.head_dim, dtype, limits.kv_heads));
        generated.map_err(|e| generation_refused(&spec, limits.head_dim, e))?;
        let sizes = CodebookSizes::new(
            &spec,
            limits.kv_heads as usize,
            limits.head_dim as usize,
            limits.max_seqs as usize,
            limits.pool_pages as usize,
            limits.max_seq_len as usize,
        )
        .map_err(|e| Failure::argument(format!("{e} (scheme `{spec}`)")))?;
        Self::assemble(spec, limits, dtype, sizes.cache, Some(sizes), None)
    }

    /// A codebook scheme's own sizes, `None` for the integer schemes and FP16.
    pub fn codebook_sizes(&self) -> Option<&CodebookSizes> {
        self.codebook.as_ref()
    }

    /// An XQuant scheme's own sizes, `None` for the others.
    pub fn xquant_sizes(&self) -> Option<&XQuantSizes> {
        self.xquant.as_ref()
    }

    /// Heads of the page blocks: the KV heads, or an XQuant plan's latent store heads.
    pub fn store_heads(&self) -> usize {
        self.xquant
            .as_ref()
            .map_or(self.limits.kv_heads as usize, |x| x.store_heads)
    }

    /// Whether the plan codes keys before RoPE (RoPE-commutative codebooks), so that its prefill
    /// and append take the keys before RoPE too (`kvq_prefill_prerope`, `kvq_append_prerope`).
    pub fn takes_pre_rope_keys(&self) -> bool {
        self.codebook.as_ref().is_some_and(|c| {
            matches!(
                c.layout.k.kind,
                kvq::reference::commvq::device::SideKind::Rope { .. }
            )
        })
    }

    /// The scheme, validated.
    pub fn spec(&self) -> &SchemeSpec {
        &self.spec
    }

    /// The element type of queries, outputs and new K/V (`limits.dtype`, checked).
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The limits the plan was made with.
    pub fn limits(&self) -> &KvqPlanLimits {
        &self.limits
    }

    /// Sizes of every buffer (the same function [`kvq::runtime::PagedKvCache`] allocates with).
    pub fn sizes(&self) -> &CacheSizes {
        &self.sizes
    }

    /// Buffer `index` of [`Self::buffer_count`].
    pub fn buffer(&self, index: usize) -> Option<KvqBuffer> {
        let s = &self.sizes;
        let cb = self.codebook.as_ref();
        let bytes = [
            s.k_pool_bytes,
            s.v_pool_bytes,
            2 * s.k_sink_halves,
            2 * s.v_sink_halves,
            2 * s.k_tail_halves,
            2 * s.v_tail_halves,
            4 * self.limits.max_seqs as usize,
            4 * s.page_table_entries,
            cb.map_or(0, |c| 2 * c.k_pending_halves),
            cb.map_or(0, |c| 2 * c.v_pending_halves),
            cb.map_or(0, |c| 4 * c.status_words),
            cb.map_or(0, |c| c.codebooks.bytes),
            self.xquant.as_ref().map_or(0, |x| x.weights.bytes),
            self.xquant.as_ref().map_or(0, |x| x.accumulator_bytes),
        ];
        let (name, layout) = BUFFERS.get(index)?;
        Some(KvqBuffer {
            name: name.as_ptr(),
            bytes: bytes[index] as u64,
            alignment: KVQ_BUFFER_ALIGNMENT,
            layout: layout.as_ptr(),
        })
    }

    /// Buffers an engine allocates for this plan.
    pub fn buffer_count(&self) -> usize {
        BUFFERS.len()
    }

    /// Sizes that follow from the plan.
    pub fn info(&self) -> KvqPlanInfo {
        let s = &self.sizes;
        let kv_heads = self.store_heads();
        let total: u64 = (0..self.buffer_count())
            .filter_map(|i| self.buffer(i))
            .map(|b| b.bytes)
            .sum();
        KvqPlanInfo {
            page_tokens: s.page_tokens as u32,
            max_pages_per_seq: s.max_pages as u32,
            sink_tokens: s.k_sink_tokens.max(s.v_sink_tokens) as u32,
            k_block_bytes: s.k_block_bytes as u64,
            v_block_bytes: s.v_block_bytes as u64,
            page_bytes: s.page_bytes(kv_heads) as u64,
            state_bytes_per_seq: (s.fp16_state_bytes() / self.limits.max_seqs as usize) as u64,
            total_bytes: total,
        }
    }
}

/// The built-in schemes' names, each with whether it has GPU kernels (whether a plan takes it).
pub fn builtin_schemes() -> Vec<(&'static str, bool)> {
    kvq::schemes::BUILTIN
        .iter()
        .map(|b| {
            let xquant = has_xquant_kernel(&b.spec);
            let gpu = kvq::codegen::has_decode_kernel(&b.spec)
                || kvq::codegen::has_codebook_kernel(&b.spec)
                || xquant;
            (b.name, gpu)
        })
        .collect()
}

/// Whether `spec` codes either side with codebooks (CommVQ and custom codebook schemes).
pub(crate) fn is_codebook(spec: &SchemeSpec) -> bool {
    [spec.k, spec.v]
        .iter()
        .any(|t| matches!(t, TensorQuant::Codebook(_)))
}

/// The sizes of an integer page store of `store_spec` (`spec`'s, or its latents') at `heads` ×
/// `head_dim` = `(heads, head_dim)` for `limits`' sequences, pages and tokens, taking inputs of
/// `input_dtype`.
fn integer_store(
    spec: &SchemeSpec,
    store_spec: &SchemeSpec,
    limits: &KvqPlanLimits,
    (heads, head_dim): (usize, usize),
    input_dtype: Dtype,
) -> Result<CacheSizes, Failure> {
    let cfg = CacheConfig {
        kv_heads: heads,
        head_dim,
        max_seqs: limits.max_seqs as usize,
        pool_pages: limits.pool_pages as usize,
        max_tokens: limits.max_seq_len as usize,
        input_dtype,
    };
    CacheSizes::new(store_spec, &cfg)
        .map_err(|e| Failure::argument(format!("{e} (scheme `{spec}`)")))
}

/// Refuses a `max_q_len` other than 1 for `family`, which decodes one query token a step.
fn check_one_query_token(limits: &KvqPlanLimits, family: &str) -> Result<(), Failure> {
    if limits.max_q_len == 1 {
        return Ok(());
    }
    Err(Failure::new(
        KvqStatus::UnsupportedShape,
        format!(
            "limits.max_q_len is {}: {family} decode one query token a sequence a step (set \
             max_q_len = 1)",
            limits.max_q_len
        ),
    ))
}

/// Refuses a RoPE base that is not a finite number past 1 for `spec`, which `does` (and rotates
/// the keys in the decode).
fn check_rope_base(limits: &KvqPlanLimits, spec: &SchemeSpec, does: &str) -> Result<(), Failure> {
    let theta = limits.rope_theta;
    if theta.is_finite() && theta > 1.0 {
        return Ok(());
    }
    Err(Failure::argument(format!(
        "limits.rope_theta is {theta}: `{spec}` {does} and rotates them in the decode, so it \
         needs the model's RoPE base (e.g. 10000 or 500000)"
    )))
}

/// A built-in's name or scheme text, validated.
fn resolve_scheme(scheme: &str) -> Result<SchemeSpec, Failure> {
    kvq::schemes::resolve(scheme).map_err(|why| Failure::new(KvqStatus::InvalidScheme, why))
}

/// Checks that no limit is 0 and that the heads divide; returns the dtype.
fn check_limits(l: &KvqPlanLimits) -> Result<Dtype, Failure> {
    for (name, value) in [
        ("head_dim", l.head_dim),
        ("q_heads", l.q_heads),
        ("kv_heads", l.kv_heads),
        ("max_seqs", l.max_seqs),
        ("max_seq_len", l.max_seq_len),
        ("pool_pages", l.pool_pages),
        ("max_q_len", l.max_q_len),
    ] {
        if value == 0 {
            return Err(Failure::argument(format!(
                "limits.{name} is 0 (every limit must be at least 1)"
            )));
        }
    }
    if !(l.rope_theta.is_finite() && l.rope_theta >= 0.0) {
        return Err(Failure::argument(format!(
            "limits.rope_theta is {} (expected the model's RoPE base, or 0 where the scheme needs none)",
            l.rope_theta
        )));
    }
    if l.max_q_len > l.max_seq_len {
        return Err(Failure::argument(format!(
            "limits.max_q_len ({}) is longer than limits.max_seq_len ({})",
            l.max_q_len, l.max_seq_len
        )));
    }
    if l.q_heads % l.kv_heads != 0 {
        return Err(Failure::argument(format!(
            "limits.q_heads ({}) is not a multiple of limits.kv_heads ({})",
            l.q_heads, l.kv_heads
        )));
    }
    let gqa = l.q_heads / l.kv_heads;
    if gqa > MAX_GQA {
        return Err(Failure::new(
            KvqStatus::UnsupportedShape,
            format!("{gqa} query heads a KV head (the kernels take at most {MAX_GQA})"),
        ));
    }
    match l.dtype {
        KVQ_DTYPE_F16 => Ok(Dtype::F16),
        KVQ_DTYPE_BF16 => Ok(Dtype::Bf16),
        other => Err(Failure::argument(format!(
            "limits.dtype is {other} (expected KVQ_DTYPE_F16 = 0 or KVQ_DTYPE_BF16 = 1)"
        ))),
    }
}

/// Refuses a scheme without a GPU kernel, and a shape the tensor-core kernel does not serve.
fn check_fast_kernel(spec: &SchemeSpec, shape: &KernelShape) -> Result<(), Failure> {
    let tune = TuneParams::default_for(spec, shape);
    match decode_kernels(spec, shape, &tune) {
        Ok(kernels) => match kernels.slow_path {
            None => Ok(()),
            Some(why) => Err(Failure::new(
                KvqStatus::UnsupportedShape,
                format!(
                    "no tensor-core kernel for `{spec}` at head_dim {} ({why}); kvq does not fall \
                     back to its generic kernel behind an engine's back",
                    shape.head_dim
                ),
            )),
        },
        Err(CodegenError::Unsupported { what, .. }) => Err(Failure::new(
            KvqStatus::UnsupportedScheme,
            format!("no GPU kernel for {what}"),
        )),
        Err(e @ (CodegenError::Shape(_) | CodegenError::SchemeShape(_))) => Err(Failure::new(
            KvqStatus::UnsupportedShape,
            format!("`{spec}` at head_dim {}: {e}", shape.head_dim),
        )),
        Err(e) => Err(Failure::new(KvqStatus::Internal, e.to_string())),
    }
}

/// Why a family's kernels could not be generated for a plan: a scheme it has no kernel for, or a
/// shape its kernel does not take.
fn generation_refused(spec: &SchemeSpec, head_dim: u32, e: CodegenError) -> Failure {
    match e {
        CodegenError::Unsupported { what, .. } => Failure::new(
            KvqStatus::UnsupportedScheme,
            format!("no GPU kernel for `{spec}`: {what}"),
        ),
        e => Failure::new(
            KvqStatus::UnsupportedShape,
            format!("`{spec}` at head_dim {head_dim}: {e}"),
        ),
    }
}

/// The scheme's canonical text as the C string `kvq_plan_scheme` returns.
fn scheme_text(spec: &SchemeSpec) -> Result<CString, Failure> {
    CString::new(spec.to_string())
        .map_err(|_| Failure::new(KvqStatus::Internal, "scheme text with a NUL byte"))
}

/// Reads a C string argument; null or non-UTF-8 is an error naming `what`.
///
/// # Safety
/// A non-null `ptr` points at a NUL-terminated string.
pub(crate) unsafe fn c_str<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if ptr.is_null() {
        return Err(Failure::argument(format!("{what} is NULL")));
    }
    CStr::from_ptr(ptr)
        .to_str()
        .map_err(|e| Failure::argument(format!("{what} is not UTF-8: {e}")))
}

/// Reads a host byte-array argument (`len` bytes at `data`); null is an error naming `what`.
///
/// # Safety
/// A non-null `data` points at `len` readable bytes.
pub(crate) unsafe fn host_bytes<'a>(
    data: *const u8,
    len: usize,
    what: &str,
) -> Result<&'a [u8], Failure> {
    if data.is_null() {
        return Err(Failure::argument(format!("{what} is NULL")));
    }
    Ok(std::slice::from_raw_parts(data, len))
}

/// Reads an out-pointer argument; null is an error naming `what`.
///
/// # Safety
/// A non-null `ptr` points at writable storage for a `T`.
unsafe fn out_arg<'a, T>(ptr: *mut T, what: &str) -> Result<&'a mut T, Failure> {
    ptr.as_mut()
        .ok_or_else(|| Failure::argument(format!("{what} is NULL")))
}

/// Reads a pointer argument; null is an error naming `what`.
///
/// # Safety
/// A non-null `ptr` points at a valid `T`.
unsafe fn arg<'a, T>(ptr: *const T, what: &str) -> Result<&'a T, Failure> {
    ptr.as_ref()
        .ok_or_else(|| Failure::argument(format!("{what} is NULL")))
}

/// Makes a plan for `scheme` (a built-in's name, e.g. `"kivi2"`, or scheme text, e.g.
/// `"k = int(2, channel), v = int(2, token), sink = 32, local = 128"`) within `limits`, and stores
/// it in `*out` (set to NULL on failure). Needs no GPU. Free it with `kvq_plan_destroy`.
///
/// # Safety
/// `scheme` is NULL or a NUL-terminated string; `limits` is NULL or points at a `KvqPlanLimits`;
/// `out` is NULL or points at writable storage for a pointer.
#[no_mangle]
pub unsafe extern "C" fn kvq_plan_create(
    scheme: *const c_char,
    limits: *const KvqPlanLimits,
    out: *mut *mut KvqPlan,
) -> KvqStatus {
    call(|| {
        let out = out_arg(out, "out")?;
        *out = std::ptr::null_mut();
        let plan = KvqPlan::new(c_str(scheme, "scheme")?, arg(limits, "limits")?)?;
        *out = Box::into_raw(Box::new(plan));
        Ok(())
    })
}

/// Frees a plan made by `kvq_plan_create` (NULL is ignored).
///
/// # Safety
/// `plan` is NULL or a plan from `kvq_plan_create` not yet destroyed, and no other thread uses it.
#[no_mangle]
pub unsafe extern "C" fn kvq_plan_destroy(plan: *mut KvqPlan) {
    if !plan.is_null() {
        drop(Box::from_raw(plan));
    }
}

/// Stores the sizes that follow from `plan` in `*out`.
///
/// # Safety
/// `plan` is NULL or a live plan; `out` is NULL or points at writable storage for a `KvqPlanInfo`.
#[no_mangle]
pub unsafe extern "C" fn kvq_plan_info(plan: *const KvqPlan, out: *mut KvqPlanInfo) -> KvqStatus {
    call(|| {
        let plan = arg(plan, "plan")?;
        let out = out_arg(out, "out")?;
        *out = plan.info();
        Ok(())
    })
}

/// Stores in `*count` how many buffers an engine allocates for `plan`.
///
/// # Safety
/// `plan` is NULL or a live plan; `count` is NULL or points at a writable `uint32_t`.
#[no_mangle]
pub unsafe extern "C" fn kvq_plan_buffer_count(plan: *const KvqPlan, count: *mut u32) -> KvqStatus {
    call(|| {
        let plan = arg(plan, "plan")?;
        let count = out_arg(count, "count")?;
        *count = plan.buffer_count() as u32;
        Ok(())
    })
}

/// Stores buffer `index` (0 up to the buffer count) of `plan` in `*out`.
///
/// # Safety
/// `plan` is NULL or a live plan; `out` is NULL or points at writable storage for a `KvqBuffer`.
#[no_mangle]
pub unsafe extern "C" fn kvq_plan_buffer(
    plan: *const KvqPlan,
    index: u32,
    out: *mut KvqBuffer,
) -> KvqStatus {
    call(|| {
        let plan = arg(plan, "plan")?;
        let out = out_arg(out, "out")?;
        *out = plan.buffer(index as usize).ok_or_else(|| {
            Failure::argument(format!(
                "buffer index {index} (the plan has {} buffers)",
                plan.buffer_count()
            ))
        })?;
        Ok(())
    })
}

/// The plan's scheme as canonical scheme text (valid while the plan lives), or NULL for a NULL plan.
///
/// # Safety
/// `plan` is NULL or a live plan.
#[no_mangle]
pub unsafe extern "C" fn kvq_plan_scheme(plan: *const KvqPlan) -> *const c_char {
    match plan.as_ref() {
        Some(p) => p.scheme_text.as_ptr(),
        None => std::ptr::null(),
    }
}
