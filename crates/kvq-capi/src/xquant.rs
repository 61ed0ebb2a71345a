//! What XQuant plans (`source = x(latent)`: xquant2/3/4 and custom latent schemes) add to the
//! engine surface. Their cache holds the layer input's latents X·down_k and X·down_v in the
//! integer store of the usual buffers (`k_pool` … `page_table`, at the plan's store heads), and
//! the decode rebuilds K from them; so the writes take X, not K and V:
//!
//! - `kvq_xquant_weights_load` / `_bytes`: a layer's projections (a `kvq-projections-1` file,
//!   made from the model's W_k and W_v by Python's `kvq.xquant_projections` or the Rust
//!   `Projections::from_weights` then `save`) packed into the `xquant_weights` buffer;
//! - `kvq_xquant_prefill`: prompts' X into empty slots; `kvq_xquant_append`: one token's X a
//!   sequence (capturable in a CUDA graph);
//! - `kvq_attend` serves XQuant plans as the others (one query token a sequence).

use std::ffi::{c_char, c_void};
use std::path::Path;

use kvq::reference::rope::Rope;
use kvq::reference::xquant::{ProjectionFileError, Projections};
use kvq::runtime::copy_to_engine;
use kvq::runtime::xquant::XQuantPtrs;

use crate::gpu::{stream_gpu, xquant_plan_kernels};
use crate::plan::{c_str, host_bytes, KvqPlan};
use crate::status::{call, Failure, KvqStatus};
use crate::steps::{check_step, plan_and_cache, read_prompts, KvqCache, Ptrs};

/// The plan and the XQuant pointers of `cache`; an error for other plans naming `what`.
///
/// # Safety
/// Each pointer is NULL or valid.
unsafe fn xquant_plan<'a>(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    what: &str,
) -> Result<(&'a KvqPlan, XQuantPtrs), Failure> {
    let (plan, ptrs) = unsafe { plan_and_cache(plan, cache) }?;
    match ptrs {
        Ptrs::XQuant(p) => Ok((plan, p)),
        _ => Err(Failure::argument(format!(
            "{what}: `{}` caches K and V (only XQuant plans, e.g. xquant2, take the layer input)",
            plan.spec()
        ))),
    }
}

/// A projection file's error as a status: the file's contents are the caller's argument.
fn file_error(e: ProjectionFileError) -> Failure {
    Failure::argument(format!("projection file: {e}"))
}

/// Packs the projections `read` returns for `plan` and copies them to `cache->xquant_weights`.
///
/// # Safety
/// As `kvq_xquant_weights_load`.
unsafe fn write(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    read: impl FnOnce(&KvqPlan) -> Result<Projections, ProjectionFileError>,
) -> Result<(), Failure> {
    let (plan, p) = unsafe { xquant_plan(plan, cache, "kvq_xquant_weights_load") }?;
    let Some(sizes) = plan.xquant_sizes() else {
        return Err(Failure::new(
            KvqStatus::Internal,
            "an XQuant plan without sizes",
        ));
    };
    let projections = read(plan).map_err(file_error)?;
    let rope = Rope {
        theta: plan.limits().rope_theta,
    };
    let bytes = sizes
        .weights
        .pack(plan.spec(), &projections, rope, plan.dtype())
        .map_err(Failure::runtime)?;
    let (_gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
    // SAFETY: the caller vouches for the buffer, of the plan's `xquant_weights` size (the
    // layout's bytes, `bytes.len()`).
    unsafe { copy_to_engine(&stream, p.weights, &bytes, "the projections") }
        .map_err(Failure::runtime)
}

/// Reads the `kvq-projections-1` file at `path` (one layer's XQuant projections, made for the
/// plan's `d_model`, KV heads and head size, and a scheme of the same source: anything else is
/// refused with a message naming the difference), packs it with the plan's RoPE base and dtype,
/// and writes it into `cache->xquant_weights` on `stream`, stream-ordered before any later call
/// on it. Call it once per layer before the layer's first prefill.
///
/// # Safety
/// `plan` and `cache` are NULL or valid, `path` NULL or a NUL-terminated string, `stream` NULL
/// or a live stream of the device's primary context; `cache->xquant_weights` device memory of
/// the plan's `xquant_weights` size.
#[no_mangle]
pub unsafe extern "C" fn kvq_xquant_weights_load(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    path: *const c_char,
) -> KvqStatus {
    call(|| {
        // SAFETY: the caller vouches for a NUL-terminated string.
        let path = unsafe { c_str(path, "path") }?;
        unsafe {
            write(plan, cache, stream, |plan| {
                let l = plan.limits();
                Projections::load(
                    Path::new(path),
                    plan.spec(),
                    l.d_model as usize,
                    l.kv_heads as usize,
                    l.head_dim as usize,
                )
            })
        }
    })
}

/// `kvq_xquant_weights_load` from the file's `len` bytes at `data` (host memory), for engines
/// that keep the projections inside their own checkpoint.
///
/// # Safety
/// As `kvq_xquant_weights_load`; `data` NULL or `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn kvq_xquant_weights_load_bytes(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    data: *const u8,
    len: usize,
) -> KvqStatus {
    call(|| {
        // SAFETY: the caller vouches for `len` readable bytes.
        let bytes = unsafe { host_bytes(data, len, "data") }?;
        unsafe {
            write(plan, cache, stream, |plan| {
                let l = plan.limits();
                Projections::from_safetensors(
                    bytes,
                    plan.spec(),
                    l.d_model as usize,
                    l.kv_heads as usize,
                    l.head_dim as usize,
                )
            })
        }
    })
}

/// Prefills `n` empty sequence slots of an XQuant plan from prompts' layer input packed back to
/// back: `x` is `[Σ tokens][d_model]` in the plan's dtype (the normalised input of the attention
/// layer, the rows that would be multiplied by W_k and W_v), prompt `i` (`tokens[i]` tokens, into
/// slot `slots[i]`) after prompts `< i`; `slots` and `tokens` are host arrays of `n`. The prompts
/// are projected to latents on the tensor cores in the workspace, then written as the integer
/// plans write K and V: each prompt's sink and tail latents in FP16, its whole pages quantized into
/// the pool pages its block-table row names; its slot's length becomes its tokens. `workspace` is
/// the plan's workspace (`kvq_plan_workspace_bytes`). Runs on `stream` with no allocation; the job
/// list is copied from the host, so the call does not belong in a CUDA graph.
///
/// # Safety
/// `plan` and `cache` are NULL or valid (the weights loaded); `slots` and `tokens` NULL or `n`
/// readable values; `stream` NULL or a live stream of the device's primary context; `x` and the
/// device buffers that device's memory of the sizes above, alive until the launches have run.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvq_xquant_prefill(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    n: u32,
    slots: *const i32,
    tokens: *const u32,
    x: *const c_void,
    workspace: *mut c_void,
) -> KvqStatus {
    call(|| {
        let (plan, p) = unsafe { xquant_plan(plan, cache, "kvq_xquant_prefill") }?;
        if n > plan.limits().max_seqs {
            return Err(Failure::argument(format!(
                "kvq_xquant_prefill: {n} sequences, more than the plan's max_seqs ({})",
                plan.limits().max_seqs
            )));
        }
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the caller vouches for `n` values each.
        let prompts = unsafe { read_prompts(plan, n, slots, tokens) }?;
        let total: usize = prompts.iter().map(|p| p.1).sum();
        if total > 0 && x.is_null() {
            return Err(Failure::argument("kvq_xquant_prefill: x is NULL"));
        }
        if workspace.is_null() {
            return Err(Failure::argument("kvq_xquant_prefill: workspace is NULL"));
        }
        let (gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
        let steps = xquant_plan_kernels(&gpu, plan)?;
        // SAFETY: the caller vouches for the buffers; slots and lengths are checked above, the
        // workspace is the plan's.
        unsafe { steps.prefill_raw(&stream, &p, &prompts, x as u64, workspace as u64) }
            .map_err(Failure::runtime)
    })
}

/// Appends one token to each of `n` sequences of an XQuant plan from its layer input: `x` is
/// `[n][d_model]` in the plan's dtype, row `i` for the slot `slots[i]` names (`slots`: `n` i32 in
/// device memory, distinct; −1 marks a padding sequence, skipped). Each row is projected to
/// latents in the workspace, then written at position `seq_lens[slot]` as `kvq_append` writes K
/// and V (a page quantized where the token completes one), and `seq_lens[slot]` grows by one. No
/// host synchronisation, no allocation: capturable in a CUDA graph.
///
/// # Safety
/// As `kvq_xquant_prefill`; `slots` holds `n` device i32, each −1 or a slot below max_seqs whose
/// block-table row names the page its token completes.
#[no_mangle]
pub unsafe extern "C" fn kvq_xquant_append(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    n: u32,
    slots: *const i32,
    x: *const c_void,
    workspace: *mut c_void,
) -> KvqStatus {
    call(|| {
        let what = "kvq_xquant_append";
        let (plan, p) = unsafe { xquant_plan(plan, cache, what) }?;
        let pointers = [
            ("slots", slots.is_null()),
            ("x", x.is_null()),
            ("workspace", workspace.is_null()),
        ];
        if !check_step(plan, n, 1, what, &pointers)? {
            return Ok(());
        }
        let (gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
        let steps = xquant_plan_kernels(&gpu, plan)?;
        // SAFETY: the caller vouches for the buffers and slots; n ≤ max_seqs was checked.
        unsafe {
            steps.append_raw(
                &stream,
                &p,
                n as usize,
                slots as u64,
                x as u64,
                workspace as u64,
            )
        }
        .map_err(Failure::runtime)
    })
}
