//! What the C-surface GPU tests share: device addresses of test allocations, the raw stream,
//! and status checks that print kvq's message.

// Each test binary uses the helpers it needs.
#![allow(dead_code)]

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use kvq::runtime::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use kvq_capi::{kvq_last_error_message, KvqCache, KvqPlan, KvqStatus};

/// `buf`'s device address (the allocation outlives the calls that use it).
pub fn ptr<T>(buf: &CudaSlice<T>, stream: &CudaStream) -> *mut c_void {
    let (p, _guard) = buf.device_ptr(stream);
    p as *mut c_void
}

/// The calling thread's last kvq message.
pub fn message() -> String {
    unsafe { CStr::from_ptr(kvq_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts `status` is `KVQ_OK`, naming `what` and kvq's message otherwise.
pub fn ok(status: KvqStatus, what: &str) {
    assert_eq!(status, KvqStatus::Ok, "{what}: {}", message());
}

/// A zeroed workspace of the plan's size on GPU 0 (at least one byte), `what` naming the case.
pub fn workspace(plan: &KvqPlan, stream: &Arc<CudaStream>, what: &str) -> CudaSlice<u8> {
    let mut bytes = 0u64;
    ok(
        unsafe { kvq_capi::kvq_plan_workspace_bytes(plan, 0, &mut bytes) },
        &format!("{what}: workspace"),
    );
    stream.alloc_zeros::<u8>(bytes.max(1) as usize).unwrap()
}

/// The stream as the C calls take it.
pub fn raw(stream: &Arc<CudaStream>) -> *mut c_void {
    stream.cu_stream().cast()
}

/// The plan's buffers, zeroed, and the cache struct over them; the block table maps slot `s`'s
/// logical page `j` to pool page `pool − 1 − (s·max_pages + j)`, backwards.
pub fn buffers(
    plan: &KvqPlan,
    stream: &Arc<CudaStream>,
) -> (Vec<CudaSlice<u8>>, KvqCache, Vec<i32>) {
    let mut bufs: Vec<CudaSlice<u8>> = (0..plan.buffer_count())
        .map(|i| {
            let bytes = plan.buffer(i).unwrap().bytes as usize;
            stream.alloc_zeros::<u8>(bytes.max(1)).unwrap()
        })
        .collect();
    let l = plan.limits();
    let max_pages = plan.info().max_pages_per_seq as usize;
    let table: Vec<i32> = (0..l.max_seqs as usize * max_pages)
        .map(|e| (l.pool_pages as usize - 1 - e) as i32)
        .collect();
    let bytes: Vec<u8> = table.iter().flat_map(|v| v.to_le_bytes()).collect();
    stream.memcpy_htod(&bytes, &mut bufs[7]).unwrap();
    let p: Vec<*mut c_void> = bufs.iter().map(|b| ptr(b, stream)).collect();
    let cache = KvqCache {
        k_pool: p[0],
        v_pool: p[1],
        k_sink: p[2],
        v_sink: p[3],
        k_tail: p[4],
        v_tail: p[5],
        seq_lens: p[6],
        page_table: p[7],
        k_pending: p[8],
        v_pending: p[9],
        status: p[10],
        codebooks: p[11],
        xquant_weights: p[12],
        xquant_accumulator: p[13],
    };
    (bufs, cache, table)
}
