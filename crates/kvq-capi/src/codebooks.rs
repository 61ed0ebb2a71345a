//! What codebook plans (CommVQ and custom codebook schemes) add to the engine surface: a layer's
//! codebooks written into the engine's `codebooks` buffer from a `kvq-codebooks-1` file or its
//! bytes, and `kvq_cache_check`, which reports the tokens the encoders refused.

use std::ffi::{c_char, c_void};
use std::path::Path;

use kvq::reference::commvq::Codebooks;
use kvq::runtime::codebook::take_slot_errors;
use kvq::runtime::copy_to_engine;

use crate::gpu::stream_gpu;
use crate::plan::{c_str, host_bytes, KvqPlan};
use crate::status::{call, Failure, KvqStatus};
use crate::steps::{plan_and_cache, KvqCache, Ptrs};

/// Packs `books` for `plan` and copies them to `cache->codebooks` on `stream`.
///
/// # Safety
/// As `kvq_codebooks_load`.
unsafe fn write(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
    read: impl FnOnce(&KvqPlan) -> Result<Codebooks, Failure>,
) -> Result<(), Failure> {
    let (plan, ptrs) = unsafe { plan_and_cache(plan, cache) }?;
    let (Ptrs::Codebook(p), Some(sizes)) = (ptrs, plan.codebook_sizes()) else {
        return Err(Failure::argument(format!(
            "`{}` has no codebooks (only codebook schemes, e.g. commvq1, take them)",
            plan.spec()
        )));
    };
    let books = read(plan)?;
    let l = plan.limits();
    let bytes = sizes
        .codebooks
        .pack(
            plan.spec(),
            &books,
            l.kv_heads as usize,
            l.head_dim as usize,
        )
        .map_err(Failure::runtime)?;
    let (_gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
    // SAFETY: the caller vouches for the buffer, of the plan's `codebooks` size (`bytes.len()`).
    unsafe { copy_to_engine(&stream, p.codebooks, &bytes, "the codebooks") }
        .map_err(Failure::runtime)
}

/// A codebook file's error as a status: the file's contents are the caller's argument.
fn file_error(e: kvq::reference::commvq::CodebookFileError) -> Failure {
    Failure::argument(format!("codebook file: {e}"))
}

/// Reads the `kvq-codebooks-1` file at `path` (one layer's codebooks, trained for the plan's
/// scheme at its KV heads and head size: anything else is refused with a message naming the
/// difference) and writes them into `cache->codebooks` on `stream`, stream-ordered before any
/// later call on it. Call it once per layer before the layer's first prefill.
///
/// # Safety
/// `plan` and `cache` are NULL or valid, `path` NULL or a NUL-terminated string, `stream` NULL
/// or a live stream of the device's primary context; `cache->codebooks` device memory of the
/// plan's `codebooks` size.
#[no_mangle]
pub unsafe extern "C" fn kvq_codebooks_load(
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
                Codebooks::load(
                    Path::new(path),
                    plan.spec(),
                    l.kv_heads as usize,
                    l.head_dim as usize,
                )
                .map_err(file_error)
            })
        }
    })
}

/// `kvq_codebooks_load` from the file's `len` bytes at `data` (host memory), for engines that
/// keep codebooks inside their own checkpoint.
///
/// # Safety
/// As `kvq_codebooks_load`; `data` NULL or `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn kvq_codebooks_load_bytes(
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
                Codebooks::from_safetensors(
                    bytes,
                    plan.spec(),
                    l.kv_heads as usize,
                    l.head_dim as usize,
                )
                .map_err(file_error)
            })
        }
    })
}

/// Waits for `stream` and reports what a codebook plan's encoders refused since the last check:
/// `KVQ_INVALID_ARGUMENT` naming the first slot, its token and why (a key or value NaN, infinite or
/// past f16's range; a scale or factor past f16's range), with how many slots were flagged. The
/// refused tokens were not appended (a prompt leaves its slot empty), and a flagged slot took no
/// later token until this call, which clears the flags. `KVQ_OK` when nothing was refused, and
/// always for plans without encoders (the integer schemes and FP16). Synchronises: call it where
/// the engine may wait (after a prefill, every so many decode steps).
///
/// # Safety
/// As `kvq_prefill`.
#[no_mangle]
pub unsafe extern "C" fn kvq_cache_check(
    plan: *const KvqPlan,
    cache: *const KvqCache,
    stream: *mut c_void,
) -> KvqStatus {
    call(|| {
        let (plan, ptrs) = unsafe { plan_and_cache(plan, cache) }?;
        let Ptrs::Codebook(p) = ptrs else {
            return Ok(());
        };
        let (_gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
        let slots = plan.limits().max_seqs as usize;
        // SAFETY: the caller vouches for the status buffer (the plan's size).
        let errors =
            unsafe { take_slot_errors(&stream, p.status, slots) }.map_err(Failure::runtime)?;
        match errors.split_first() {
            None => Ok(()),
            Some(((_, first), rest)) => Err(Failure::new(
                KvqStatus::InvalidArgument,
                if rest.is_empty() {
                    format!("refused: {first}")
                } else {
                    format!(
                        "refused: {first} (and in {} more slots: {})",
                        rest.len(),
                        rest.iter()
                            .map(|(s, _)| s.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                },
            )),
        }
    })
}
