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
//! - XQuant-CL (`x(cross_layer)`, xquant-cl2): `kvq_xquant_prefill_cross_layer` and
//!   `kvq_xquant_append_cross_layer` take, beside X, the accumulator X̂ the engine carries
//!   through the layers (zeros at the first), store the latents of X − X̂ and X̂'s latents (buffer
//!   `xquant_accumulator`), and replace X̂ with the layer's for the next layer;
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
use kvq::{CacheSource, XSource};

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
/// on it. Call it once per layer before the layer's first prefill. For XQuant-CL the call also
/// solves the layer's lift matrix on the host (a system of min(d_model, 2R) unknowns: seconds at
/// d_model 4,096; docs/CODEBOOKS.md §3).
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

/// Refuses a write of the other XQuant source: `cross_layer` says whether the call takes X̂.
fn check_source(plan: &KvqPlan, cross_layer: bool, what: &str) -> Result<(), Failure> {
    let is_cl = matches!(plan.spec().source, CacheSource::X(XSource::CrossLayer));
    match (is_cl, cross_layer) {
        (true, false) => Err(Failure::argument(format!(
            "{what}: `{}` stores deltas against the accumulator X̂; call {what}_cross_layer with \
             X and X̂",
            plan.spec()
        ))),
        (false, true) => Err(Failure::argument(format!(
            "{what}: `{}` caches the layer input's latents (x(latent)) and takes no X̂; call {} \
             with X",
            plan.spec(),
            what.trim_end_matches("_cross_layer")
        ))),
        _ => Ok(()),
    }
}

/// An XQuant prefill of `n` prompts from `x` and, for XQuant-CL, `x_hat` (0 otherwise).
///
/// # Safety
/// As `kvq_xquant_prefill_cross_layer`.
#[allow(clippy::too_many_arguments)]
unsafe fn prefill(
    what: &str,
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    (n, slots, tokens): (u32, *const i32, *const u32),
    x: *const c_void,
    x_hat: Option<*mut c_void>,
    workspace: *mut c_void,
) -> Result<(), Failure> {
    let (plan, p) = unsafe { xquant_plan(plan, cache, what) }?;
    check_source(plan, x_hat.is_some(), what)?;
    if n > plan.limits().max_seqs {
        return Err(Failure::argument(format!(
            "{what}: {n} sequences, more than the plan's max_seqs ({})",
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
        return Err(Failure::argument(format!("{what}: x is NULL")));
    }
    if total > 0 && x_hat.is_some_and(|p| p.is_null()) {
        return Err(Failure::argument(format!("{what}: x_hat is NULL")));
    }
    if workspace.is_null() {
        return Err(Failure::argument(format!("{what}: workspace is NULL")));
    }
    let (gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
    let steps = xquant_plan_kernels(&gpu, plan)?;
    let (x, ws) = (x as u64, workspace as u64);
    // SAFETY: the caller vouches for the buffers; slots and lengths are checked above, the
    // workspace is the plan's.
    match x_hat {
        None => unsafe { steps.prefill_raw(&stream, &p, &prompts, x, ws) },
        Some(x_hat) => unsafe {
            steps.prefill_cross_layer_raw(&stream, &p, &prompts, (x, x_hat as u64), ws)
        },
    }
    .map_err(Failure::runtime)
}

/// An XQuant append of one token a sequence from `x` and, for XQuant-CL, `x_hat`.
///
/// # Safety
/// As `kvq_xquant_append_cross_layer`.
#[allow(clippy::too_many_arguments)]
unsafe fn append(
    what: &str,
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    (n, slots): (u32, *const i32),
    x: *const c_void,
    x_hat: Option<*mut c_void>,
    workspace: *mut c_void,
) -> Result<(), Failure> {
    let (plan, p) = unsafe { xquant_plan(plan, cache, what) }?;
    check_source(plan, x_hat.is_some(), what)?;
    let pointers = [
        ("slots", slots.is_null()),
        ("x", x.is_null()),
        ("x_hat", x_hat.is_some_and(|p| p.is_null())),
        ("workspace", workspace.is_null()),
    ];
    if !check_step(plan, n, 1, what, &pointers)? {
        return Ok(());
    }
    let (gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
    let steps = xquant_plan_kernels(&gpu, plan)?;
    let (n, slots, x, ws) = (n as usize, slots as u64, x as u64, workspace as u64);
    // SAFETY: the caller vouches for the buffers and slots; n ≤ max_seqs was checked.
    match x_hat {
        None => unsafe { steps.append_raw(&stream, &p, n, slots, x, ws) },
        Some(x_hat) => unsafe {
            steps.append_cross_layer_raw(&stream, &p, n, slots, (x, x_hat as u64), ws)
        },
    }
    .map_err(Failure::runtime)
}

/// Prefills `n` empty sequence slots of an XQuant plan from prompts' layer input packed back to
/// back: `x` is `[Σ tokens][d_model]` in the plan's dtype (the normalised input of the attention
/// layer, the rows that would be multiplied by W_k and W_v), prompt `i` (`tokens[i]` tokens, into
/// slot `slots[i]`) after prompts `< i`; `slots` and `tokens` are host arrays of `n`. The prompts
/// are projected to latents on the tensor cores in the workspace, then written as the integer
/// plans write K and V: each prompt's sink and tail latents in FP16, its whole pages quantized into
/// the pool pages its block-table row names; its slot's length becomes its tokens. `workspace` is
/// the plan's workspace (`kvq_plan_workspace_bytes`). Runs on `stream` with no allocation; the job
/// list is copied from the host, so the call does not belong in a CUDA graph. XQuant-CL plans
/// take `kvq_xquant_prefill_cross_layer` instead.
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
    let what = "kvq_xquant_prefill";
    call(|| unsafe {
        prefill(
            what,
            plan,
            cache,
            stream,
            (n, slots, tokens),
            x,
            None,
            workspace,
        )
    })
}

/// `kvq_xquant_prefill` for an XQuant-CL plan (`x(cross_layer)`, e.g. xquant-cl2): beside the
/// prompts' layer input `x`, `x_hat` holds the accumulator X̂ of the same rows (`[Σ tokens]
/// [d_model]` in the plan's dtype; zeros at the first layer of the chain). Stores the latents of
/// `x − x_hat` as `kvq_xquant_prefill` stores X's, keeps `x_hat`'s latents in
/// `cache->xquant_accumulator`, and overwrites `x_hat` with this layer's accumulator, which the
/// engine hands to the next layer's call (docs/CODEBOOKS.md §3.1).
///
/// # Safety
/// As `kvq_xquant_prefill`; `x_hat` NULL or device memory of `x`'s size, read and written.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvq_xquant_prefill_cross_layer(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    n: u32,
    slots: *const i32,
    tokens: *const u32,
    x: *const c_void,
    x_hat: *mut c_void,
    workspace: *mut c_void,
) -> KvqStatus {
    let what = "kvq_xquant_prefill_cross_layer";
    let prompts = (n, slots, tokens);
    call(|| unsafe {
        prefill(
            what,
            plan,
            cache,
            stream,
            prompts,
            x,
            Some(x_hat),
            workspace,
        )
    })
}

/// Appends one token to each of `n` sequences of an XQuant plan from its layer input: `x` is
/// `[n][d_model]` in the plan's dtype, row `i` for the slot `slots[i]` names (`slots`: `n` i32 in
/// device memory, distinct; −1 marks a padding sequence, skipped). Each row is projected to
/// latents in the workspace, then written at position `seq_lens[slot]` as `kvq_append` writes K
/// and V (a page quantized where the token completes one), and `seq_lens[slot]` grows by one. No
/// host synchronisation, no allocation: capturable in a CUDA graph. XQuant-CL plans take
/// `kvq_xquant_append_cross_layer` instead.
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
    let what = "kvq_xquant_append";
    call(|| unsafe { append(what, plan, cache, stream, (n, slots), x, None, workspace) })
}

/// `kvq_xquant_append` for an XQuant-CL plan: beside the layer input `x`, `x_hat` holds the
/// accumulator X̂ of the same rows (`[n][d_model]` in the plan's dtype, zeros at the first layer
/// of the chain). Stores the latents of `x − x_hat`, keeps `x_hat`'s latents at the token's row
/// of `cache->xquant_accumulator`, and overwrites `x_hat` with this layer's accumulator for the
/// next layer's call (padding rows' too). No host synchronisation, no allocation: capturable in
/// a CUDA graph.
///
/// # Safety
/// As `kvq_xquant_append`; `x_hat` NULL or device memory of `x`'s size, read and written.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvq_xquant_append_cross_layer(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    n: u32,
    slots: *const i32,
    x: *const c_void,
    x_hat: *mut c_void,
    workspace: *mut c_void,
) -> KvqStatus {
    let what = "kvq_xquant_append_cross_layer";
    call(|| unsafe {
        append(
            what,
            plan,
            cache,
            stream,
            (n, slots),
            x,
            Some(x_hat),
            workspace,
        )
    })
}
