//! `kvq_merge`: attention states `(O, LSE)` of disjoint parts of each query row's tokens (one per
//! GPU of a context-parallel group, gathered) into the state over all of them, on the caller's
//! stream and memory.

use std::ffi::c_void;

use crate::gpu::{merge_kernel, stream_gpu};
use crate::plan::KvqPlan;
use crate::status::{call, Failure, KvqStatus};

/// Merges `parts` attention states of `rows` query rows (tokens × query heads) of the plan's
/// head_dim and dtype, on `stream` (a `CUstream`; NULL: the current context's legacy stream):
/// `out_parts` `[parts][rows][head_dim]` and `lse_parts` `[parts][rows]` f32 (natural log, −inf for
/// a part that saw none of a row's tokens) in, `out` `[rows][head_dim]` and `lse` `[rows]` out
/// (`lse` may be NULL). A row no part saw gets zeros and −inf. No host synchronisation and no
/// allocation: capturable in a CUDA graph once `kvq_plan_load` has loaded the kernel.
///
/// # Safety
/// `plan` is NULL or a live plan; `stream` NULL or a live stream of the device's primary context;
/// the buffers device memory of that device holding the sizes above, alive until the merge runs.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvq_merge(
    plan: *const KvqPlan,
    stream: *mut c_void,
    out_parts: *const c_void,
    lse_parts: *const f32,
    parts: u32,
    rows: u32,
    out: *mut c_void,
    lse: *mut f32,
) -> KvqStatus {
    call(|| {
        let plan = unsafe { plan.as_ref() }.ok_or_else(|| Failure::argument("plan is NULL"))?;
        if parts == 0 {
            return Err(Failure::argument(
                "parts is 0 (a merge takes at least one part)",
            ));
        }
        for (name, null) in [
            ("out_parts", out_parts.is_null()),
            ("lse_parts", lse_parts.is_null()),
            ("out", out.is_null()),
        ] {
            if null && rows > 0 {
                return Err(Failure::argument(format!("{name} is NULL")));
            }
        }
        let (gpu, stream, _context) = unsafe { stream_gpu(stream) }?;
        let kernel = merge_kernel(&gpu, plan)?;
        // SAFETY: the caller vouches for the buffers (sizes per the plan's head_dim and dtype).
        unsafe {
            kernel.merge_raw(
                &stream,
                parts as usize,
                rows as usize,
                out_parts as u64,
                lse_parts as u64,
                out as u64,
                lse as u64,
            )
        }
        .map_err(Failure::runtime)
    })
}
