//! The calls of a decoding step on an engine's own cache: `kvq_prefill` (prompts into empty
//! sequence slots), `kvq_append` (a step's new tokens) and `kvq_attend` (a step's query tokens,
//! causal among themselves: output and LSE). All run on the caller's stream and memory and allocate nothing;
//! `kvq_append` and `kvq_attend` take their sequence slots in device memory and never synchronise
//! with the host, so a CUDA graph can capture them (after `kvq_plan_load`).

use std::ffi::c_void;

use std::sync::Arc;

use kvq::runtime::codebook::{CodebookPtrs, StepInputs};
use kvq::runtime::cudarc::driver::CudaStream;
use kvq::runtime::device::RestoreContext;
use kvq::runtime::xquant::XQuantPtrs;
use kvq::runtime::CachePtrs;

use crate::gpu::{
    codebook_plan_kernels, plan_kernels, stream_gpu, xquant_plan_kernels, PlanKernels,
};
use crate::plan::KvqPlan;
use crate::status::{call, Failure, KvqStatus};

/// A plan's buffers in the engine's memory (device pointers, each allocated as `kvq_plan_buffer`
/// says for the same index). A buffer of 0 bytes may be NULL.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvqCache {
    /// Buffer 0: K page blocks.
    pub k_pool: *mut c_void,
    /// Buffer 1: V page blocks.
    pub v_pool: *mut c_void,
    /// Buffer 2: K's FP16 sinks.
    pub k_sink: *mut c_void,
    /// Buffer 3: V's FP16 sinks.
    pub v_sink: *mut c_void,
    /// Buffer 4: K's FP16 tail rings.
    pub k_tail: *mut c_void,
    /// Buffer 5: V's FP16 tail rings.
    pub v_tail: *mut c_void,
    /// Buffer 6: tokens per sequence slot.
    pub seq_lens: *mut c_void,
    /// Buffer 7: the block table, `[sequence slot][max_pages_per_seq]` i32.
    pub page_table: *mut c_void,
    /// Buffer 8: codebook schemes' K inputs not yet coded (NULL for other schemes).
    pub k_pending: *mut c_void,
    /// Buffer 9: codebook schemes' V inputs not yet coded (NULL for other schemes).
    pub v_pending: *mut c_void,
    /// Buffer 10: codebook schemes' per-slot encoder status, zeroed once by the engine (NULL for
    /// other schemes).
    pub status: *mut c_void,
    /// Buffer 11: codebook schemes' codebooks, written by `kvq_codebooks_load` (NULL for other
    /// schemes).
    pub codebooks: *mut c_void,
    /// Buffer 12: XQuant schemes' projections, written by `kvq_xquant_weights_load` (NULL for
    /// other schemes).
    pub xquant_weights: *mut c_void,
    /// Buffer 13: XQuant-CL's accumulator latents of every token, written by
    /// `kvq_xquant_prefill_cross_layer` and `kvq_xquant_append_cross_layer` (NULL for other
    /// schemes).
    pub xquant_accumulator: *mut c_void,
}

/// Checks that every buffer the plan needs is set; an error names a NULL one.
fn check_buffers(plan: &KvqPlan, cache: &KvqCache) -> Result<(), Failure> {
    let fields = [
        cache.k_pool,
        cache.v_pool,
        cache.k_sink,
        cache.v_sink,
        cache.k_tail,
        cache.v_tail,
        cache.seq_lens,
        cache.page_table,
        cache.k_pending,
        cache.v_pending,
        cache.status,
        cache.codebooks,
        cache.xquant_weights,
        cache.xquant_accumulator,
    ];
    for (i, ptr) in fields.iter().enumerate() {
        let b = plan
            .buffer(i)
            .expect("the plan numbers every KvqCache field");
        if ptr.is_null() && b.bytes > 0 {
            // SAFETY: buffer names are static NUL-terminated strings.
            let name = unsafe { std::ffi::CStr::from_ptr(b.name) }.to_string_lossy();
            return Err(Failure::argument(format!("cache->{name} is NULL")));
        }
    }
    Ok(())
}

/// The cache's pointers for the integer kernels (an XQuant plan's: its latent store).
fn cache_ptrs(plan: &KvqPlan, cache: &KvqCache) -> Result<CachePtrs, Failure> {
    check_buffers(plan, cache)?;
    let l = plan.limits();
    let head_dim = plan
        .xquant_sizes()
        .map_or(l.head_dim as usize, |x| x.store_width);
    Ok(CachePtrs {
        kv_heads: plan.store_heads(),
        head_dim,
        max_pages: plan.sizes().max_pages,
        k_pool: cache.k_pool as u64,
        v_pool: cache.v_pool as u64,
        page_table: cache.page_table as u64,
        k_sink: cache.k_sink as u64,
        v_sink: cache.v_sink as u64,
        k_tail: cache.k_tail as u64,
        v_tail: cache.v_tail as u64,
        seq_lens: cache.seq_lens as u64,
    })
}

/// The cache's pointers for a codebook plan's kernels.
pub(crate) fn codebook_ptrs(plan: &KvqPlan, cache: &KvqCache) -> Result<CodebookPtrs, Failure> {
    check_buffers(plan, cache)?;
    Ok(CodebookPtrs {
        max_pages: plan.sizes().max_pages,
        rope_theta: plan.limits().rope_theta,
        k_pool: cache.k_pool as u64,
        v_pool: cache.v_pool as u64,
        page_table: cache.page_table as u64,
        k_sink: cache.k_sink as u64,
        v_sink: cache.v_sink as u64,
        k_tail: cache.k_tail as u64,
        v_tail: cache.v_tail as u64,
        seq_lens: cache.seq_lens as u64,
        k_pending: cache.k_pending as u64,
        v_pending: cache.v_pending as u64,
        status: cache.status as u64,
        codebooks: cache.codebooks as u64,
    })
}

/// A cache's pointers for the plan's family of kernels.
pub(crate) enum Ptrs {
    Integer(CachePtrs),
    Codebook(CodebookPtrs),
    XQuant(XQuantPtrs),
}

/// The plan and cache behind two argument pointers.
///
/// # Safety
/// Each pointer is NULL or valid.
pub(crate) unsafe fn plan_and_cache<'a>(
    plan: *const KvqPlan,
    cache: *const KvqCache,
) -> Result<(&'a KvqPlan, Ptrs), Failure> {
    let plan = unsafe { plan.as_ref() }.ok_or_else(|| Failure::argument("plan is NULL"))?;
    let cache = unsafe { cache.as_ref() }.ok_or_else(|| Failure::argument("cache is NULL"))?;
    let ptrs = if plan.codebook_sizes().is_some() {
        Ptrs::Codebook(codebook_ptrs(plan, cache)?)
    } else if plan.xquant_sizes().is_some() {
        Ptrs::XQuant(XQuantPtrs {
            latents: cache_ptrs(plan, cache)?,
            weights: cache.xquant_weights as u64,
            accumulator: cache.xquant_accumulator as u64,
        })
    } else {
        Ptrs::Integer(cache_ptrs(plan, cache)?)
    };
    Ok((plan, ptrs))
}

/// The error of a K/V write on an XQuant plan, which takes the layer input instead.
pub(crate) fn takes_x(plan: &KvqPlan, what: &str, instead: &str) -> Failure {
    Failure::argument(format!(
        "{what}: `{}` caches the layer input's latents, not K and V; call {instead} with X",
        plan.spec()
    ))
}

/// Checks the pre-RoPE keys argument against the plan: required exactly when it codes keys
/// before RoPE (`what` names the call for the message).
fn check_pre_rope(plan: &KvqPlan, k_pre_rope: *const c_void, what: &str) -> Result<(), Failure> {
    if plan.takes_pre_rope_keys() && k_pre_rope.is_null() {
        return Err(Failure::argument(format!(
            "{what}: `{}` codes keys before RoPE; call {what}_prerope with the keys before RoPE \
             beside those after it",
            plan.spec()
        )));
    }
    Ok(())
}

/// Checks a step's sequence count against the plan.
fn check_count(plan: &KvqPlan, n: u32, what: &str) -> Result<(), Failure> {
    let max = plan.limits().max_seqs;
    if n > max {
        return Err(Failure::argument(format!(
            "{what}: {n} sequences, more than the plan's max_seqs ({max})"
        )));
    }
    Ok(())
}

/// The checks of a step of `n` sequences of `q_len` query tokens: the counts against the plan,
/// then the pointers named with whether each is NULL (an empty step may pass NULLs). Whether the
/// step has any work.
pub(crate) fn check_step(
    plan: &KvqPlan,
    n: u32,
    q_len: u32,
    what: &str,
    pointers: &[(&str, bool)],
) -> Result<bool, Failure> {
    check_count(plan, n, what)?;
    check_q_len(plan, q_len, what)?;
    if n == 0 {
        return Ok(false);
    }
    match pointers.iter().find(|(_, null)| *null) {
        Some((name, _)) => Err(Failure::argument(format!("{what}: {name} is NULL"))),
        None => Ok(true),
    }
}

/// The plan's kernels on the GPU of `stream`, the stream borrowed for launches, and the guard that
/// gives the thread its current context back.
///
/// # Safety
/// As [`stream_gpu`].
unsafe fn step_gpu(
    plan: &KvqPlan,
    stream: *mut c_void,
) -> Result<(Arc<PlanKernels>, Arc<CudaStream>, RestoreContext), Failure> {
    let (gpu, stream, context) = unsafe { stream_gpu(stream) }?;
    Ok((plan_kernels(&gpu, plan)?, stream, context))
}

/// Checks a step's query tokens a sequence against the plan.
fn check_q_len(plan: &KvqPlan, q_len: u32, what: &str) -> Result<(), Failure> {
    let max = plan.limits().max_q_len;
    if q_len == 0 || q_len > max {
        return Err(Failure::argument(format!(
            "{what}: q_len {q_len} (expected 1 up to the plan's max_q_len, {max})"
        )));
    }
    Ok(())
}

/// Prefills `n` empty sequence slots with prompts packed back to back: `k` and `v` are
/// `[Σ tokens][kv_heads][head_dim]` in the plan's dtype, prompt `i` (`tokens[i]` tokens, into slot
/// `slots[i]`) after prompts `< i`. `slots` and `tokens` are host arrays of `n`. Each prompt's sink
/// and tail stay in FP16, its whole pages are quantized into the pool pages its block-table row
/// names (the engine writes those entries first), and its slot's length becomes its tokens; a
/// prompt of 0 tokens empties its slot (before appending to a new sequence). `workspace` is the
/// plan's workspace (`kvq_plan_workspace_bytes`). Runs on `stream` with no allocation; the job
/// list is copied from the host, so the call does not belong in a CUDA graph. A plan that codes
/// keys before RoPE (RoPE-commutative codebooks) takes `kvq_prefill_prerope` instead.
///
/// # Safety
/// `plan` and `cache` are NULL or valid; `slots` and `tokens` NULL or `n` readable values;
/// `stream` NULL or a live stream of the device's primary context; the device buffers that device's
/// memory of the plan's sizes, alive until the launches have run.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvq_prefill(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    n: u32,
    slots: *const i32,
    tokens: *const u32,
    k: *const c_void,
    v: *const c_void,
    workspace: *mut c_void,
) -> KvqStatus {
    let inputs = Inputs {
        k_pre_rope: std::ptr::null(),
        k,
        v,
    };
    call(|| unsafe {
        prefill(
            "kvq_prefill",
            plan,
            cache,
            stream,
            n,
            slots,
            tokens,
            inputs,
            workspace,
        )
    })
}

/// `kvq_prefill` for a plan that codes keys before RoPE (RoPE-commutative codebooks, e.g.
/// CommVQ): `k_pre_rope` holds the prompts' keys before RoPE, `k` the same keys after it (what
/// the FP16 sink and tail keep), both `[Σ tokens][kv_heads][head_dim]`. The encoders code every
/// page the prompt fills, bit for bit as kvq's CPU reference; a value that is NaN, infinite or
/// past f16's range, or a page whose scale overflows f16, leaves the slot empty and says so in its
/// status (`kvq_cache_check`). Other plans take it too (`k_pre_rope` is then not read).
///
/// # Safety
/// As `kvq_prefill`; `k_pre_rope` device memory of `k`'s size.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvq_prefill_prerope(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    n: u32,
    slots: *const i32,
    tokens: *const u32,
    k_pre_rope: *const c_void,
    k: *const c_void,
    v: *const c_void,
    workspace: *mut c_void,
) -> KvqStatus {
    let inputs = Inputs { k_pre_rope, k, v };
    call(|| unsafe {
        prefill(
            "kvq_prefill",
            plan,
            cache,
            stream,
            n,
            slots,
            tokens,
            inputs,
            workspace,
        )
    })
}

/// A step's new keys and values as the caller passed them.
#[derive(Clone, Copy)]
struct Inputs {
    k_pre_rope: *const c_void,
    k: *const c_void,
    v: *const c_void,
}

impl Inputs {
    fn step(&self) -> StepInputs {
        StepInputs {
            k_pre_rope: self.k_pre_rope as u64,
            k: self.k as u64,
            v: self.v as u64,
        }
    }
}

/// A prefill's `n` prompts as `(slot, tokens)`, each checked against the plan (a slot in range
/// and not repeated, no longer than `max_seq_len`).
///
/// # Safety
/// `slots` and `tokens` are NULL or `n` readable values.
pub(crate) unsafe fn read_prompts(
    plan: &KvqPlan,
    n: u32,
    slots: *const i32,
    tokens: *const u32,
) -> Result<Vec<(usize, usize)>, Failure> {
    if slots.is_null() || tokens.is_null() {
        return Err(Failure::argument("slots or tokens is NULL"));
    }
    // SAFETY: the caller vouches for `n` readable values each.
    let (slots, tokens) = unsafe {
        (
            std::slice::from_raw_parts(slots, n as usize),
            std::slice::from_raw_parts(tokens, n as usize),
        )
    };
    let l = plan.limits();
    let mut prompts = Vec::with_capacity(n as usize);
    for (i, (&slot, &t)) in slots.iter().zip(tokens).enumerate() {
        if slot < 0 || slot as u32 >= l.max_seqs {
            return Err(Failure::argument(format!(
                "slots[{i}] = {slot} (expected 0 up to max_seqs − 1 = {})",
                l.max_seqs - 1
            )));
        }
        if t > l.max_seq_len {
            return Err(Failure::argument(format!(
                "tokens[{i}] = {t}, longer than the plan's max_seq_len ({})",
                l.max_seq_len
            )));
        }
        if prompts.iter().any(|&(s, _)| s == slot as usize) {
            return Err(Failure::argument(format!(
                "slot {slot} appears twice among the prompts"
            )));
        }
        prompts.push((slot as usize, t as usize));
    }
    Ok(prompts)
}

/// `kvq_prefill` and `kvq_prefill_prerope`.
///
/// # Safety
/// As `kvq_prefill_prerope`.
#[allow(clippy::too_many_arguments)]
unsafe fn prefill(
    what: &str,
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    n: u32,
    slots: *const i32,
    tokens: *const u32,
    inputs: Inputs,
    workspace: *mut c_void,
) -> Result<(), Failure> {
    let (plan, ptrs) = unsafe { plan_and_cache(plan, cache) }?;
    if let Ptrs::XQuant(_) = ptrs {
        return Err(takes_x(plan, what, "kvq_xquant_prefill"));
    }
    check_count(plan, n, what)?;
    if n == 0 {
        return Ok(());
    }
    // SAFETY: forwarded.
    let prompts = unsafe { read_prompts(plan, n, slots, tokens) }?;
    let total: usize = prompts.iter().map(|p| p.1).sum();
    if total > 0 && (inputs.k.is_null() || inputs.v.is_null()) {
        return Err(Failure::argument("k or v is NULL"));
    }
    if total > 0 {
        check_pre_rope(plan, inputs.k_pre_rope, what)?;
    }
    if workspace.is_null() {
        return Err(Failure::argument("workspace is NULL"));
    }
    let (gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
    match ptrs {
        Ptrs::XQuant(_) => return Err(takes_x(plan, what, "kvq_xquant_prefill")),
        Ptrs::Codebook(p) => {
            let kernels = codebook_plan_kernels(&gpu, plan)?;
            // SAFETY: the caller vouches for the buffers; slots and lengths are checked above.
            unsafe {
                kernels
                    .steps
                    .prefill_raw(&stream, &p, &prompts, &inputs.step())
            }
        }
        Ptrs::Integer(ptrs) => {
            let kernels = plan_kernels(&gpu, plan)?;
            // SAFETY: the caller vouches for the buffers; the workspace holds the job list of any
            // prefill within the plan's limits (PlanKernels::load).
            unsafe {
                kernels.writer.prefill_raw(
                    &stream,
                    &ptrs,
                    &prompts,
                    inputs.k as u64,
                    inputs.v as u64,
                    workspace as u64,
                    kernels.workspace_bytes / 4,
                )
            }
        }
    }
    .map_err(Failure::runtime)
}

/// Appends `q_len` tokens' K and V to each of `n` sequences: `k_new`/`v_new` are
/// `[n][q_len][kv_heads][head_dim]` in the plan's dtype, sequence `i` for the slot `slots[i]` names
/// (`slots`: `n` i32 in device memory, distinct; −1 marks a padding sequence, skipped). Token by
/// token, each goes to position `seq_lens[slot]`; when it completes a page (after the sink and
/// local window), that page is quantized into the pool page the block table names for it; then
/// `seq_lens[slot]` grows by one. No host synchronisation, no allocation: capturable in a CUDA
/// graph. A plan that codes keys before RoPE takes `kvq_append_prerope` instead; in a codebook
/// plan a token the encoders refuse (see `kvq_prefill_prerope`) is not appended, and its slot takes
/// no more tokens until `kvq_cache_check` has reported it.
///
/// # Safety
/// As `kvq_prefill`; `slots` holds `n` device i32, each −1 or a slot below max_seqs whose
/// block-table row names the page its token completes.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvq_append(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    n: u32,
    q_len: u32,
    slots: *const i32,
    k_new: *const c_void,
    v_new: *const c_void,
) -> KvqStatus {
    let inputs = Inputs {
        k_pre_rope: std::ptr::null(),
        k: k_new,
        v: v_new,
    };
    call(|| unsafe { append("kvq_append", plan, cache, stream, n, q_len, slots, inputs) })
}

/// `kvq_append` for a plan that codes keys before RoPE: `k_pre_rope` holds the new keys before
/// RoPE, `k_new` after it, both `[n][q_len][kv_heads][head_dim]`. Capturable in a CUDA graph.
///
/// # Safety
/// As `kvq_append`; `k_pre_rope` device memory of `k_new`'s size.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvq_append_prerope(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    n: u32,
    q_len: u32,
    slots: *const i32,
    k_pre_rope: *const c_void,
    k_new: *const c_void,
    v_new: *const c_void,
) -> KvqStatus {
    let inputs = Inputs {
        k_pre_rope,
        k: k_new,
        v: v_new,
    };
    call(|| unsafe { append("kvq_append", plan, cache, stream, n, q_len, slots, inputs) })
}

/// `kvq_append` and `kvq_append_prerope`.
///
/// # Safety
/// As `kvq_append_prerope`.
#[allow(clippy::too_many_arguments)]
unsafe fn append(
    what: &str,
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    n: u32,
    q_len: u32,
    slots: *const i32,
    inputs: Inputs,
) -> Result<(), Failure> {
    let (plan, ptrs) = unsafe { plan_and_cache(plan, cache) }?;
    if let Ptrs::XQuant(_) = ptrs {
        return Err(takes_x(plan, what, "kvq_xquant_append"));
    }
    let pointers = [
        ("slots", slots.is_null()),
        ("k_new", inputs.k.is_null()),
        ("v_new", inputs.v.is_null()),
    ];
    if !check_step(plan, n, q_len, what, &pointers)? {
        return Ok(());
    }
    check_pre_rope(plan, inputs.k_pre_rope, what)?;
    let (gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
    match ptrs {
        Ptrs::XQuant(_) => return Err(takes_x(plan, what, "kvq_xquant_append")),
        Ptrs::Codebook(p) => {
            let kernels = codebook_plan_kernels(&gpu, plan)?;
            // SAFETY: the caller vouches for the buffers and slots (q_len is 1: the plan's limit).
            unsafe {
                kernels
                    .steps
                    .append_raw(&stream, &p, n as usize, slots as u64, &inputs.step())
            }
        }
        Ptrs::Integer(ptrs) => {
            let kernels = plan_kernels(&gpu, plan)?;
            // SAFETY: the caller vouches for the buffers and slots.
            unsafe {
                kernels.writer.append_raw(
                    &stream,
                    &ptrs,
                    n as usize,
                    q_len as usize,
                    slots as u64,
                    inputs.k as u64,
                    inputs.v as u64,
                )
            }
        }
    }
    .map_err(Failure::runtime)
}

/// Attention of `q_len` query tokens for each of `n` sequences (1: decode; more: a verification
/// step of speculative decoding): `q` and `out` are `[n][q_len][q_heads][head_dim]` in the plan's
/// dtype, sequence `i` for the slot `slots[i]` names (`slots`: `n` i32 in device memory; −1: a
/// padding sequence, whose rows are zeros). The step's tokens are the slot's last `q_len` (written
/// by this step's `kvq_append`), and token `j` attends causally to the slot's tokens up to itself,
/// as the cache holds them after the whole step. `lse` (NULL: not written) gets
/// `[n][q_len][q_heads]` f32, each row's `ln Σ exp(q·k/√head_dim)` for `kvq_merge`. `workspace`
/// is the plan's workspace. No host synchronisation, no allocation: capturable in a CUDA graph.
///
/// # Safety
/// As `kvq_append`; `q`, `out` and `lse` device memory of the sizes above.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvq_attend(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    n: u32,
    q_len: u32,
    slots: *const i32,
    q: *const c_void,
    out: *mut c_void,
    lse: *mut f32,
    workspace: *mut c_void,
) -> KvqStatus {
    call(|| {
        let (plan, ptrs) = unsafe { plan_and_cache(plan, cache) }?;
        let pointers = [
            ("slots", slots.is_null()),
            ("q", q.is_null()),
            ("out", out.is_null()),
            ("workspace", workspace.is_null()),
        ];
        if !check_step(plan, n, q_len, "kvq_attend", &pointers)? {
            return Ok(());
        }
        let ptrs = match ptrs {
            Ptrs::Integer(ptrs) => ptrs,
            Ptrs::XQuant(p) => {
                let (gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
                let steps = xquant_plan_kernels(&gpu, plan)?;
                // SAFETY: the caller vouches for the buffers, slots and workspace (the plan's
                // size, which covers the splits of `n` sequences).
                return unsafe {
                    steps.attend_raw(
                        &stream,
                        &p,
                        n as usize,
                        slots as u64,
                        (q as u64, out as u64, lse as u64),
                        workspace as u64,
                    )
                }
                .map_err(Failure::runtime);
            }
            Ptrs::Codebook(p) => {
                let (gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
                let kernels = codebook_plan_kernels(&gpu, plan)?;
                let splits = kernels.steps_splits(n as usize)?;
                // SAFETY: the caller vouches for the buffers, slots and workspace (the plan's
                // size, which covers `splits` for `n` sequences).
                return unsafe {
                    kernels.steps.attend_raw(
                        &stream,
                        &p,
                        n as usize,
                        slots as u64,
                        q as u64,
                        out as u64,
                        lse as u64,
                        splits,
                        workspace as u64,
                    )
                }
                .map_err(Failure::runtime);
            }
        };
        let (kernels, stream, _context) = unsafe { step_gpu(plan, stream) }?;
        // SAFETY: the caller vouches for the workspace (the plan's size).
        let rows = n as usize * q_len as usize;
        let mut scratch = unsafe { kernels.scratch(plan, rows, workspace as u64) }?;
        // SAFETY: the caller vouches for the buffers and slots.
        unsafe {
            kernels.decode.attend_raw(
                &stream,
                &ptrs,
                n as usize,
                q_len as usize,
                slots as u64,
                q as u64,
                out as u64,
                lse as u64,
                &mut scratch,
            )
        }
        .map_err(Failure::runtime)
    })
}
