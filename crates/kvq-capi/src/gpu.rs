//! The GPUs behind engines' streams: one opened device and JIT per GPU for the process, found from
//! the stream a call is given, and the kernels loaded on each. Kernels compile on first use (with
//! the disk cache, so a later process loads them in milliseconds) or ahead of time through
//! `kvq_plan_load`, which an engine calls before capturing CUDA graphs.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use kvq::codegen::Dtype;
use kvq::runtime::cudarc::driver::{sys, CudaStream};
use kvq::runtime::{Device, Jit, MergeKernel};

use crate::plan::KvqPlan;
use crate::status::{call, Failure, KvqStatus};

/// One GPU: its device (primary context) and JIT.
pub struct Gpu {
    pub device: Device,
    pub jit: Jit,
}

/// A map from a key to what was loaded for it, shared by every thread of the process. A load runs
/// under the lock: the first call of a kind waits for its compile, later ones find it.
struct Loaded<K, V>(OnceLock<Mutex<HashMap<K, Arc<V>>>>);

impl<K: std::hash::Hash + Eq + Copy, V> Loaded<K, V> {
    const fn new() -> Self {
        Loaded(OnceLock::new())
    }

    fn get_or_load(
        &self,
        key: K,
        load: impl FnOnce() -> Result<V, Failure>,
    ) -> Result<Arc<V>, Failure> {
        let map = self.0.get_or_init(|| Mutex::new(HashMap::new()));
        // A panic while loading (caught at the ABI) leaves nothing half-inserted: keep going.
        let mut map = map.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(v) = map.get(&key) {
            return Ok(v.clone());
        }
        let v = Arc::new(load()?);
        map.insert(key, v.clone());
        Ok(v)
    }
}

static GPUS: Loaded<usize, Gpu> = Loaded::new();
static MERGES: Loaded<(usize, u32, Dtype), MergeKernel> = Loaded::new();

/// GPU `ordinal`, opened once per process.
pub fn gpu(ordinal: usize) -> Result<Arc<Gpu>, Failure> {
    GPUS.get_or_load(ordinal, || {
        let device = Device::open(ordinal).map_err(|e| Failure::runtime(e.into()))?;
        let jit = Jit::new(&device).map_err(|e| Failure::runtime(e.into()))?;
        Ok(Gpu { device, jit })
    })
}

/// The GPU a caller's stream runs on, and the stream borrowed for launches.
///
/// # Safety
/// `stream` is null (the thread's current context's legacy stream) or a live `CUstream`.
pub unsafe fn stream_gpu(stream: *mut c_void) -> Result<(Arc<Gpu>, Arc<CudaStream>), Failure> {
    let stream = stream as sys::CUstream;
    let (ordinal, ctx) = unsafe { kvq::runtime::device::stream_device(stream) }
        .map_err(|e| Failure::runtime(e.into()))?;
    let gpu = gpu(ordinal)?;
    let borrowed =
        unsafe { gpu.device.borrow_stream(stream, ctx) }.map_err(|e| Failure::runtime(e.into()))?;
    Ok((gpu, borrowed))
}

/// The merge kernel of `plan`'s head size and dtype on `gpu`.
pub fn merge_kernel(gpu: &Gpu, plan: &KvqPlan) -> Result<Arc<MergeKernel>, Failure> {
    let (head_dim, dtype) = (plan.limits().head_dim, plan.dtype());
    MERGES.get_or_load((gpu.device.ordinal(), head_dim, dtype), || {
        MergeKernel::load(&gpu.jit, head_dim, dtype).map_err(Failure::runtime)
    })
}

/// Compiles (or loads from the disk cache) `plan`'s kernels on GPU `device` now, so that no later
/// call compiles: call it before capturing a CUDA graph. Today that is the merge kernel.
///
/// # Safety
/// `plan` is NULL or a live plan.
#[no_mangle]
pub unsafe extern "C" fn kvq_plan_load(plan: *const KvqPlan, device: i32) -> KvqStatus {
    call(|| {
        let plan = unsafe { plan.as_ref() }.ok_or_else(|| Failure::argument("plan is NULL"))?;
        let ordinal = usize::try_from(device)
            .map_err(|_| Failure::argument(format!("device {device} (expected an ordinal ≥ 0)")))?;
        let gpu = gpu(ordinal)?;
        merge_kernel(&gpu, plan).map(|_| ())
    })
}
