//! `kvq._kvq`: the Rust half of the Python package. It wraps kvq-capi's Rust API (the same plans
//! and statuses the C ABI returns) in Python classes and exceptions; `kvq/__init__.py` re-exports
//! them.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use std::ffi::c_void;

mod reference;

use kvq_capi::Dtype;
use kvq_capi::{
    Failure, KvqCache, KvqPlan, KvqPlanLimits, KvqStatus, KVQ_DTYPE_BF16, KVQ_DTYPE_F16,
};

create_exception!(
    kvq,
    KvqError,
    PyException,
    "Base of every error kvq raises."
);
create_exception!(
    kvq,
    InvalidArgument,
    KvqError,
    "An argument is out of range or inconsistent with another (the message names it)."
);
create_exception!(
    kvq,
    InvalidScheme,
    KvqError,
    "Scheme text that does not parse or validate, or a name that is no built-in."
);
create_exception!(
    kvq,
    UnsupportedScheme,
    KvqError,
    "A valid scheme this surface has no kernels for (e.g. calibrated scores over XQuant latents)."
);
create_exception!(
    kvq,
    UnsupportedShape,
    KvqError,
    "A shape the fast kernels do not serve; kvq never falls back to a slow kernel silently."
);
create_exception!(
    kvq,
    CudaError,
    KvqError,
    "The CUDA driver or the GPU failed or is missing (the message names the call and the fix)."
);
create_exception!(
    kvq,
    CompileError,
    KvqError,
    "NVRTC is missing or failed to compile a kernel, or the kernel cache could not be used."
);
create_exception!(
    kvq,
    InternalError,
    KvqError,
    "A bug in kvq: please report the message."
);

/// The Python exception of a failure's status.
fn raise(f: Failure) -> PyErr {
    match f.status {
        KvqStatus::InvalidArgument => InvalidArgument::new_err(f.message),
        KvqStatus::InvalidScheme => InvalidScheme::new_err(f.message),
        KvqStatus::UnsupportedScheme => UnsupportedScheme::new_err(f.message),
        KvqStatus::UnsupportedShape => UnsupportedShape::new_err(f.message),
        KvqStatus::Cuda => CudaError::new_err(f.message),
        KvqStatus::Compile => CompileError::new_err(f.message),
        KvqStatus::Ok | KvqStatus::Internal => InternalError::new_err(f.message),
    }
}

/// A C call's status as a Python result: the thread's message in the exception its status names.
fn status(s: KvqStatus) -> PyResult<()> {
    if s == KvqStatus::Ok {
        return Ok(());
    }
    // SAFETY: the message is the calling thread's, NUL-terminated, valid until its next call.
    let message = unsafe { std::ffi::CStr::from_ptr(kvq_capi::kvq_last_error_message()) }
        .to_string_lossy()
        .into_owned();
    Err(raise(Failure::new(s, message)))
}

/// The plan's fourteen buffer addresses in order (the last six 0 where the scheme has no use for
/// them), as the C struct.
fn kvq_cache(p: [u64; BUFFERS]) -> KvqCache {
    let a = |i: usize| p[i] as *mut c_void;
    KvqCache {
        k_pool: a(0),
        v_pool: a(1),
        k_sink: a(2),
        v_sink: a(3),
        k_tail: a(4),
        v_tail: a(5),
        seq_lens: a(6),
        page_table: a(7),
        k_pending: a(8),
        v_pending: a(9),
        status: a(10),
        codebooks: a(11),
        xquant_weights: a(12),
        xquant_accumulator: a(13),
    }
}

/// Buffers of every plan (`KvqCache`'s fields).
const BUFFERS: usize = 14;

/// `float16`/`f16`/`half` or `bfloat16`/`bf16`, as text or as anything whose `str()` ends with
/// one of them (`torch.float16`).
fn dtype_code(dtype: &Bound<'_, PyAny>) -> PyResult<u32> {
    let text = dtype.str()?.to_string();
    let name = text
        .rsplit('.')
        .next()
        .unwrap_or(&text)
        .to_ascii_lowercase();
    match name.as_str() {
        "float16" | "f16" | "half" => Ok(KVQ_DTYPE_F16),
        "bfloat16" | "bf16" => Ok(KVQ_DTYPE_BF16),
        _ => Err(InvalidArgument::new_err(format!(
            "dtype {text:?} (expected float16 or bfloat16, as text or a torch dtype)"
        ))),
    }
}

/// A prefill's prompt count, once its slots and token counts agree.
fn prompt_count(slots: &[i32], tokens: &[u32]) -> PyResult<u32> {
    if slots.len() != tokens.len() {
        return Err(InvalidArgument::new_err(format!(
            "{} slots but {} token counts",
            slots.len(),
            tokens.len()
        )));
    }
    u32::try_from(slots.len())
        .map_err(|_| InvalidArgument::new_err(format!("{} prompts", slots.len())))
}

/// A limit as u32, or InvalidArgument naming it.
fn limit(name: &str, value: i64) -> PyResult<u32> {
    u32::try_from(value).map_err(|_| {
        InvalidArgument::new_err(format!("{name} = {value} (expected 1 to {})", u32::MAX))
    })
}

/// One device buffer an engine allocates for a plan.
#[pyclass(frozen, module = "kvq", get_all)]
struct Buffer {
    /// The buffer's name, e.g. "k_pool".
    name: String,
    /// Bytes to allocate (0: the scheme does not use it).
    nbytes: u64,
    /// Alignment the kernels need, in bytes.
    alignment: u64,
    /// How the buffer is indexed.
    layout: String,
}

#[pymethods]
impl Buffer {
    fn __repr__(&self) -> String {
        format!(
            "Buffer(name={:?}, nbytes={}, alignment={})",
            self.name, self.nbytes, self.alignment
        )
    }
}

/// A scheme and shape with limits, checked once: which device buffers an engine allocates for
/// kvq's kernels, and how large each is. Needs no GPU; immutable, so threads may share it.
#[pyclass(frozen, module = "kvq")]
struct Plan {
    plan: KvqPlan,
}

#[pymethods]
impl Plan {
    #[new]
    #[pyo3(signature = (scheme, *, head_dim, q_heads, kv_heads, max_seqs, max_seq_len, pool_pages, dtype = None, max_q_len = 1, rope_theta = 0.0, d_model = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        scheme: &str,
        head_dim: i64,
        q_heads: i64,
        kv_heads: i64,
        max_seqs: i64,
        max_seq_len: i64,
        pool_pages: i64,
        dtype: Option<&Bound<'_, PyAny>>,
        max_q_len: i64,
        rope_theta: f64,
        d_model: i64,
    ) -> PyResult<Plan> {
        let limits = KvqPlanLimits {
            head_dim: limit("head_dim", head_dim)?,
            q_heads: limit("q_heads", q_heads)?,
            kv_heads: limit("kv_heads", kv_heads)?,
            dtype: match dtype {
                Some(d) => dtype_code(d)?,
                None => KVQ_DTYPE_F16,
            },
            max_seqs: limit("max_seqs", max_seqs)?,
            max_seq_len: limit("max_seq_len", max_seq_len)?,
            pool_pages: limit("pool_pages", pool_pages)?,
            max_q_len: limit("max_q_len", max_q_len)?,
            rope_theta,
            d_model: u32::try_from(d_model).map_err(|_| {
                InvalidArgument::new_err(format!(
                    "d_model = {d_model} (expected 0 to {}; XQuant schemes need the model's \
                     hidden size)",
                    u32::MAX
                ))
            })?,
        };
        KvqPlan::new(scheme, &limits)
            .map(|plan| Plan { plan })
            .map_err(raise)
    }

    /// The scheme as canonical scheme text.
    #[getter]
    fn scheme(&self) -> String {
        self.plan.spec().to_string()
    }

    /// "float16" or "bfloat16".
    #[getter]
    fn dtype(&self) -> &'static str {
        match self.plan.dtype() {
            Dtype::Bf16 => "bfloat16",
            Dtype::F16 => "float16",
        }
    }

    /// Channels per head.
    #[getter]
    fn head_dim(&self) -> u32 {
        self.plan.limits().head_dim
    }

    /// Query heads per sequence.
    #[getter]
    fn q_heads(&self) -> u32 {
        self.plan.limits().q_heads
    }

    /// KV heads per sequence.
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.plan.limits().kv_heads
    }

    /// Sequence slots.
    #[getter]
    fn max_seqs(&self) -> u32 {
        self.plan.limits().max_seqs
    }

    /// Longest sequence, in tokens.
    #[getter]
    fn max_seq_len(&self) -> u32 {
        self.plan.limits().max_seq_len
    }

    /// Pages in the pool.
    #[getter]
    fn pool_pages(&self) -> u32 {
        self.plan.limits().pool_pages
    }

    /// Most query tokens a sequence in one step.
    #[getter]
    fn max_q_len(&self) -> u32 {
        self.plan.limits().max_q_len
    }

    /// Tokens of one page.
    #[getter]
    fn page_tokens(&self) -> u32 {
        self.plan.info().page_tokens
    }

    /// Columns of the page (block) table.
    #[getter]
    fn max_pages_per_seq(&self) -> u32 {
        self.plan.info().max_pages_per_seq
    }

    /// FP16 sink tokens a sequence keeps before its first page.
    #[getter]
    fn sink_tokens(&self) -> u32 {
        self.plan.info().sink_tokens
    }

    /// The cache lengths up to `tokens` at which a page of K or V fills and is quantized, in
    /// order: a step that should show its tokens the cache as one-token decoding does ends just
    /// before each and takes the filling token alone (`kvq.hf`'s teacher forcing).
    fn page_fill_lengths(&self, tokens: u32) -> Vec<u32> {
        kvq::reference::regions::page_fill_lengths(self.plan.spec(), tokens as usize)
            .into_iter()
            .map(|n| n as u32)
            .collect()
    }

    /// Bytes of one pool page (K and V of every KV head).
    #[getter]
    fn page_bytes(&self) -> u64 {
        self.plan.info().page_bytes
    }

    /// Bytes of one sequence slot's FP16 state.
    #[getter]
    fn state_bytes_per_seq(&self) -> u64 {
        self.plan.info().state_bytes_per_seq
    }

    /// Bytes of every buffer together.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.plan.info().total_bytes
    }

    /// The buffers to allocate, in the order the calls take them.
    #[getter]
    fn buffers(&self) -> PyResult<Vec<Buffer>> {
        (0..self.plan.buffer_count())
            .map(|i| {
                let b = self.plan.buffer(i).ok_or_else(|| {
                    InternalError::new_err(format!("buffer {i} of {}", self.plan.buffer_count()))
                })?;
                // SAFETY: a plan's buffer names and layouts are NUL-terminated static strings.
                let text = |p| {
                    unsafe { std::ffi::CStr::from_ptr(p) }
                        .to_string_lossy()
                        .into_owned()
                };
                Ok(Buffer {
                    name: text(b.name),
                    nbytes: b.bytes,
                    alignment: b.alignment,
                    layout: text(b.layout),
                })
            })
            .collect()
    }

    /// Compiles (or loads from the disk cache) the plan's kernels on CUDA device `device` now, so
    /// that no later call compiles (call it before capturing a CUDA graph).
    fn load(&self, py: Python<'_>, device: i32) -> PyResult<()> {
        let plan = &self.plan;
        status(py.detach(|| unsafe { kvq_capi::kvq_plan_load(plan, device) }))
    }

    /// Bytes of the workspace `prefill` and `attend` take on CUDA device `device` (loads the
    /// kernels there first).
    fn workspace_bytes(&self, py: Python<'_>, device: i32) -> PyResult<u64> {
        let plan = &self.plan;
        let mut bytes = 0u64;
        status(
            py.detach(|| unsafe { kvq_capi::kvq_plan_workspace_bytes(plan, device, &mut bytes) }),
        )?;
        Ok(bytes)
    }

    /// The step calls on one cache's buffers (`cache`, the plan's fourteen in order, as device
    /// addresses; 0 for a buffer of 0 bytes) and workspace, bound once: `kvq.engine.PagedCache`
    /// calls them with only a step's own addresses.
    fn _steps(slf: Py<Plan>, cache: [u64; BUFFERS], workspace: u64) -> Steps {
        Steps {
            plan: slf,
            cache,
            workspace,
        }
    }

    /// Whether prefill and append take the keys before RoPE too (`k_pre_rope`): codebook schemes
    /// with RoPE-commutative keys, which code keys before RoPE and rotate them in the decode.
    #[getter]
    fn takes_pre_rope_keys(&self) -> bool {
        self.plan.takes_pre_rope_keys()
    }

    /// Whether the cache holds the layer input's latents (XQuant plans: `source = x(...)`), so
    /// that its writes take X (`d_model` wide) instead of K and V.
    #[getter]
    fn takes_layer_input(&self) -> bool {
        self.plan.xquant_sizes().is_some()
    }

    /// Whether the writes also take the accumulator X̂ the engine carries through the layers
    /// (XQuant-CL: `source = x(cross_layer)`), and replace it with the layer's.
    #[getter]
    fn takes_accumulator(&self) -> bool {
        self.plan
            .xquant_sizes()
            .is_some_and(|x| x.accumulator_bytes > 0)
    }

    /// The layer input's width the plan was made with (`d_model=`; 0 where the scheme needs none).
    #[getter]
    fn d_model(&self) -> u32 {
        self.plan.limits().d_model
    }

    /// The RoPE base the plan was made with (`rope_theta=`; 0 where the scheme needs none).
    #[getter]
    fn rope_theta(&self) -> f64 {
        self.plan.limits().rope_theta
    }

    /// `kvq_merge` on device addresses (`lse` 0: not written).
    #[allow(clippy::too_many_arguments)]
    fn _merge(
        &self,
        py: Python<'_>,
        stream: u64,
        out_parts: u64,
        lse_parts: u64,
        parts: u32,
        rows: u32,
        out: u64,
        lse: u64,
    ) -> PyResult<()> {
        let plan = &self.plan;
        status(py.detach(|| unsafe {
            kvq_capi::kvq_merge(
                plan,
                stream as *mut c_void,
                out_parts as *const c_void,
                lse_parts as *const f32,
                parts,
                rows,
                out as *mut c_void,
                lse as *mut f32,
            )
        }))
    }

    fn __repr__(&self) -> String {
        let l = self.plan.limits();
        format!(
            "Plan({:?}, head_dim={}, q_heads={}, kv_heads={}, dtype={:?}, max_seqs={}, \
             max_seq_len={}, pool_pages={}, max_q_len={})",
            self.scheme(),
            l.head_dim,
            l.q_heads,
            l.kv_heads,
            self.dtype(),
            l.max_seqs,
            l.max_seq_len,
            l.pool_pages,
            l.max_q_len
        )
    }
}

/// A plan bound to one cache's buffers and workspace (`Plan._steps`): `kvq_prefill`, `kvq_append`
/// and `kvq_attend` with only a call's own arguments to convert (the eager hot path of
/// `kvq.engine.PagedCache`, and what its torch custom ops call).
#[pyclass(frozen, module = "kvq")]
struct Steps {
    plan: Py<Plan>,
    cache: [u64; BUFFERS],
    workspace: u64,
}

#[pymethods]
impl Steps {
    /// `kvq_prefill_prerope` of prompts packed back to back (`slots` and `tokens` host lists, `k`,
    /// `v` and `k_pre_rope` device addresses; `k_pre_rope` 0 where the plan does not take it).
    #[pyo3(signature = (stream, slots, tokens, k, v, k_pre_rope = 0))]
    #[allow(clippy::too_many_arguments)]
    fn prefill(
        &self,
        py: Python<'_>,
        stream: u64,
        slots: Vec<i32>,
        tokens: Vec<u32>,
        k: u64,
        v: u64,
        k_pre_rope: u64,
    ) -> PyResult<()> {
        let n = prompt_count(&slots, &tokens)?;
        let (plan, cache, workspace) = (&self.plan.get().plan, self.cache, self.workspace);
        status(py.detach(|| unsafe {
            kvq_capi::kvq_prefill_prerope(
                plan,
                &kvq_cache(cache),
                stream as *mut c_void,
                n,
                slots.as_ptr(),
                tokens.as_ptr(),
                k_pre_rope as *const c_void,
                k as *const c_void,
                v as *const c_void,
                workspace as *mut c_void,
            )
        }))
    }

    /// `kvq_append_prerope` of `n` sequences' `q_len` tokens (device addresses; `k_pre_rope` 0
    /// where the plan does not take it).
    #[pyo3(signature = (stream, n, q_len, slots, k_new, v_new, k_pre_rope = 0))]
    #[allow(clippy::too_many_arguments)]
    fn append(
        &self,
        py: Python<'_>,
        stream: u64,
        n: u32,
        q_len: u32,
        slots: u64,
        k_new: u64,
        v_new: u64,
        k_pre_rope: u64,
    ) -> PyResult<()> {
        let (plan, cache) = (&self.plan.get().plan, self.cache);
        status(py.detach(|| unsafe {
            kvq_capi::kvq_append_prerope(
                plan,
                &kvq_cache(cache),
                stream as *mut c_void,
                n,
                q_len,
                slots as *const i32,
                k_pre_rope as *const c_void,
                k_new as *const c_void,
                v_new as *const c_void,
            )
        }))
    }

    /// `kvq_attend` of `n` sequences' `q_len` query tokens (device addresses; `lse` 0: not
    /// written).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        py: Python<'_>,
        stream: u64,
        n: u32,
        q_len: u32,
        slots: u64,
        q: u64,
        out: u64,
        lse: u64,
    ) -> PyResult<()> {
        let (plan, cache, workspace) = (&self.plan.get().plan, self.cache, self.workspace);
        status(py.detach(|| unsafe {
            kvq_capi::kvq_attend(
                plan,
                &kvq_cache(cache),
                stream as *mut c_void,
                n,
                q_len,
                slots as *const i32,
                q as *const c_void,
                out as *mut c_void,
                lse as *mut f32,
                workspace as *mut c_void,
            )
        }))
    }

    /// `kvq_codebooks_load_bytes`: a `kvq-codebooks-1` file's bytes into the cache's `codebooks`
    /// buffer.
    fn codebooks_load(&self, py: Python<'_>, stream: u64, data: &[u8]) -> PyResult<()> {
        let (plan, cache) = (&self.plan.get().plan, self.cache);
        status(py.detach(|| unsafe {
            kvq_capi::kvq_codebooks_load_bytes(
                plan,
                &kvq_cache(cache),
                stream as *mut c_void,
                data.as_ptr(),
                data.len(),
            )
        }))
    }

    /// `kvq_xquant_weights_load_bytes`: a `kvq-projections-1` file's bytes into the cache's
    /// `xquant_weights` buffer.
    fn xquant_weights_load(&self, py: Python<'_>, stream: u64, data: &[u8]) -> PyResult<()> {
        let (plan, cache) = (&self.plan.get().plan, self.cache);
        status(py.detach(|| unsafe {
            kvq_capi::kvq_xquant_weights_load_bytes(
                plan,
                &kvq_cache(cache),
                stream as *mut c_void,
                data.as_ptr(),
                data.len(),
            )
        }))
    }

    /// `kvq_xquant_prefill` of prompts' layer input packed back to back (`slots` and `tokens`
    /// host lists, `x` a device address).
    fn xquant_prefill(
        &self,
        py: Python<'_>,
        stream: u64,
        slots: Vec<i32>,
        tokens: Vec<u32>,
        x: u64,
    ) -> PyResult<()> {
        let n = prompt_count(&slots, &tokens)?;
        let (plan, cache, workspace) = (&self.plan.get().plan, self.cache, self.workspace);
        status(py.detach(|| unsafe {
            kvq_capi::kvq_xquant_prefill(
                plan,
                &kvq_cache(cache),
                stream as *mut c_void,
                n,
                slots.as_ptr(),
                tokens.as_ptr(),
                x as *const c_void,
                workspace as *mut c_void,
            )
        }))
    }

    /// `kvq_xquant_append` of one token's layer input for each of `n` sequences (device
    /// addresses).
    fn xquant_append(
        &self,
        py: Python<'_>,
        stream: u64,
        n: u32,
        slots: u64,
        x: u64,
    ) -> PyResult<()> {
        let (plan, cache, workspace) = (&self.plan.get().plan, self.cache, self.workspace);
        status(py.detach(|| unsafe {
            kvq_capi::kvq_xquant_append(
                plan,
                &kvq_cache(cache),
                stream as *mut c_void,
                n,
                slots as *const i32,
                x as *const c_void,
                workspace as *mut c_void,
            )
        }))
    }

    /// `kvq_xquant_prefill_cross_layer`: as `xquant_prefill`, with the accumulator `x_hat` (a
    /// device address of `x`'s size, replaced in place).
    #[allow(clippy::too_many_arguments)]
    fn xquant_prefill_cross_layer(
        &self,
        py: Python<'_>,
        stream: u64,
        slots: Vec<i32>,
        tokens: Vec<u32>,
        x: u64,
        x_hat: u64,
    ) -> PyResult<()> {
        let n = prompt_count(&slots, &tokens)?;
        let (plan, cache, workspace) = (&self.plan.get().plan, self.cache, self.workspace);
        status(py.detach(|| unsafe {
            kvq_capi::kvq_xquant_prefill_cross_layer(
                plan,
                &kvq_cache(cache),
                stream as *mut c_void,
                n,
                slots.as_ptr(),
                tokens.as_ptr(),
                x as *const c_void,
                x_hat as *mut c_void,
                workspace as *mut c_void,
            )
        }))
    }

    /// `kvq_xquant_append_cross_layer`: as `xquant_append`, with the accumulator `x_hat`.
    fn xquant_append_cross_layer(
        &self,
        py: Python<'_>,
        stream: u64,
        n: u32,
        slots: u64,
        x: u64,
        x_hat: u64,
    ) -> PyResult<()> {
        let (plan, cache, workspace) = (&self.plan.get().plan, self.cache, self.workspace);
        status(py.detach(|| unsafe {
            kvq_capi::kvq_xquant_append_cross_layer(
                plan,
                &kvq_cache(cache),
                stream as *mut c_void,
                n,
                slots as *const i32,
                x as *const c_void,
                x_hat as *mut c_void,
                workspace as *mut c_void,
            )
        }))
    }

    /// `kvq_cache_check`: waits for `stream` and raises what the encoders refused since the last
    /// check (clearing it).
    fn check(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let (plan, cache) = (&self.plan.get().plan, self.cache);
        status(py.detach(|| unsafe {
            kvq_capi::kvq_cache_check(plan, &kvq_cache(cache), stream as *mut c_void)
        }))
    }
}

/// The built-in schemes' names, and whether each has GPU kernels.
#[pyfunction]
fn builtin_schemes() -> Vec<(&'static str, bool)> {
    kvq_capi::builtin_schemes()
}

#[pymodule]
fn _kvq(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Plan>()?;
    m.add_class::<Buffer>()?;
    m.add_class::<Steps>()?;
    m.add_function(wrap_pyfunction!(builtin_schemes, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_reference_every_token, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_reference_codebooks, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_reference_codebook_attend, m)?)?;
    m.add_function(wrap_pyfunction!(reference::xquant_projections, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_reference_xquant_attend, m)?)?;
    m.add_function(wrap_pyfunction!(
        reference::_reference_xquant_cross_layer_attend,
        m
    )?)?;
    m.add("KvqError", py.get_type::<KvqError>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("InvalidScheme", py.get_type::<InvalidScheme>())?;
    m.add("UnsupportedScheme", py.get_type::<UnsupportedScheme>())?;
    m.add("UnsupportedShape", py.get_type::<UnsupportedShape>())?;
    m.add("CudaError", py.get_type::<CudaError>())?;
    m.add("CompileError", py.get_type::<CompileError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}
