//! The calls that run on a GPU, as far as a machine without one (or without its driver) can take
//! them: arguments are checked before the driver is touched, and a missing driver or GPU is
//! `KVQ_STATUS_CUDA` with a message, never a crash. tests/gpu.rs runs them on a GPU.

use std::ffi::{c_void, CStr};
use std::ptr;

use kvq_capi::*;

fn plan() -> KvqPlan {
    let limits = KvqPlanLimits {
        head_dim: 128,
        q_heads: 32,
        kv_heads: 8,
        dtype: KVQ_DTYPE_F16,
        max_seqs: 4,
        max_seq_len: 4096,
        pool_pages: 64,
    };
    KvqPlan::new("kivi2", &limits).unwrap()
}

fn last_message() -> String {
    unsafe { CStr::from_ptr(kvq_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Whether this machine's driver loads and has a GPU.
fn has_gpu() -> bool {
    kvq::runtime::device_count().is_ok_and(|n| n > 0)
}

/// `kvq_merge` on the legacy stream with `parts` parts of 4 rows, fake (never dereferenced)
/// buffers and `out` as given; the status and this thread's message.
fn merge_fake(plan: *const KvqPlan, parts: u32, out: *mut c_void) -> (KvqStatus, String) {
    let fake = 0x1000 as *mut c_void;
    let status = unsafe {
        kvq_merge(
            plan,
            ptr::null_mut(),
            fake,
            fake.cast(),
            parts,
            4,
            out,
            ptr::null_mut(),
        )
    };
    (status, last_message())
}

#[test]
fn merge_arguments_are_checked_before_the_driver() {
    let plan = plan();
    let fake = 0x1000 as *mut c_void;
    let (status, message) = merge_fake(&plan, 0, fake);
    assert_eq!(status, KvqStatus::InvalidArgument);
    assert!(message.contains("parts is 0"), "{message}");
    let (status, message) = merge_fake(&plan, 2, ptr::null_mut());
    assert_eq!(
        (status, message.as_str()),
        (KvqStatus::InvalidArgument, "out is NULL")
    );
    let (status, message) = merge_fake(ptr::null(), 2, fake);
    assert_eq!(
        (status, message.as_str()),
        (KvqStatus::InvalidArgument, "plan is NULL")
    );
}

#[test]
fn without_a_driver_or_gpu_the_calls_say_so() {
    if has_gpu() {
        return; // tests/gpu.rs covers this machine
    }
    let plan = plan();
    let status = unsafe { kvq_plan_load(&plan, 0) };
    assert_eq!(status, KvqStatus::Cuda, "{}", last_message());
    let message = last_message();
    assert!(
        message.contains("libcuda") || message.contains("GPU"),
        "the message names what is missing: {message}"
    );
    let (status, message) = merge_fake(&plan, 2, 0x1000 as *mut c_void);
    assert_eq!(status, KvqStatus::Cuda, "{message}");
    assert_eq!(
        unsafe { kvq_plan_load(&plan, -1) },
        KvqStatus::InvalidArgument
    );
    assert!(last_message().contains("device -1"), "{}", last_message());
}
