//! The GPUs behind engines' streams: one opened device and JIT per GPU for the process, found from
//! the stream a call is given, and the kernels loaded on each. Kernels compile on first use (with
//! the disk cache, so a later process loads them in milliseconds) or ahead of time through
//! `kvq_plan_load`, which an engine calls before capturing CUDA graphs.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use kvq::codegen::{Dtype, KernelShape};
use kvq::runtime::codebook::CodebookSteps;
use kvq::runtime::cudarc::driver::{sys, CudaStream};
use kvq::runtime::device::RestoreContext;
use kvq::runtime::tune::{default_launch, TuneProblem};
use kvq::runtime::xquant::{XQuantLimits, XQuantSteps};
use kvq::runtime::{CacheWriter, DecodeKernel, DecodeScratch, Device, Jit, MergeKernel, Pieces};

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

    /// A loaded value that `pred` accepts, if any.
    fn find(&self, pred: impl Fn(&V) -> bool) -> Option<Arc<V>> {
        let map = self.0.get()?;
        let map = map.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        map.values().find(|v| pred(v)).cloned()
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

/// The GPU a caller's stream runs on, the stream borrowed for launches, and a guard that gives the
/// calling thread its current CUDA context back when the call ends. A stream of a GPU kvq has
/// opened is recognised by its context alone (one driver call); only a new GPU's is asked for its
/// device.
///
/// # Safety
/// `stream` is null (the thread's current context's legacy stream) or a live `CUstream`.
pub unsafe fn stream_gpu(
    stream: *mut c_void,
) -> Result<(Arc<Gpu>, Arc<CudaStream>, RestoreContext), Failure> {
    let stream = stream as sys::CUstream;
    let ctx = unsafe { kvq::runtime::device::stream_context(stream) }
        .map_err(|e| Failure::runtime(e.into()))?;
    let restore = RestoreContext::save();
    let gpu = match GPUS.find(|g| g.device.owns_context(ctx)) {
        Some(gpu) => gpu,
        None => gpu(unsafe { kvq::runtime::device::context_device(ctx) }
            .map_err(|e| Failure::runtime(e.into()))?)?,
    };
    // A stream of another context is the engine's CUDA setup, not an argument's value.
    let borrowed = unsafe { gpu.device.borrow_stream(stream, ctx) }
        .map_err(|e| Failure::new(KvqStatus::Cuda, e.to_string()))?;
    Ok((gpu, borrowed, restore))
}

/// A guard that gives the calling thread its current CUDA context back when dropped (loading the
/// driver first).
fn keep_current_context() -> Result<RestoreContext, Failure> {
    kvq::runtime::device_count().map_err(|e| Failure::runtime(e.into()))?;
    Ok(RestoreContext::save())
}

/// The merge kernel of `plan`'s head size and dtype on `gpu`.
pub fn merge_kernel(gpu: &Gpu, plan: &KvqPlan) -> Result<Arc<MergeKernel>, Failure> {
    let (head_dim, dtype) = (plan.limits().head_dim, plan.dtype());
    MERGES.get_or_load((gpu.device.ordinal(), head_dim, dtype), || {
        MergeKernel::load(&gpu.jit, head_dim, dtype).map_err(Failure::runtime)
    })
}

/// A plan's kernels on one GPU, and the launch each batch size gets.
pub struct PlanKernels {
    /// The fused decode kernel (the heuristic's block for the plan's largest batch and longest
    /// sequence).
    pub decode: DecodeKernel,
    /// The cache kernels (prefill, append).
    pub writer: CacheWriter,
    /// `(splits, pieces)` of an attend of `r` query rows (sequences × query tokens), at index
    /// `r - 1`.
    launches: Vec<(usize, Pieces)>,
    /// Bytes of the workspace every call of the plan on this GPU may use.
    pub workspace_bytes: usize,
}

impl PlanKernels {
    fn load(gpu: &Gpu, plan: &KvqPlan) -> Result<PlanKernels, Failure> {
        let l = plan.limits();
        let (kv_heads, max_seqs) = (l.kv_heads as usize, l.max_seqs as usize);
        // A launch's grid has a row for each query token, at most 65535.
        let max_rows = (max_seqs * l.max_q_len as usize).min(u16::MAX as usize);
        let max_len = l.max_seq_len as usize;
        let max_pages = plan.sizes().max_pages;
        let shape = KernelShape::new(l.head_dim, l.q_heads / l.kv_heads, plan.dtype());
        let problem = TuneProblem::new(*plan.spec(), shape, kv_heads, max_seqs, max_len);
        let (_, decode) = default_launch(&gpu.jit, &problem).map_err(Failure::runtime)?;
        let writer = CacheWriter::load(&gpu.jit, plan.spec(), l.head_dim as usize, plan.dtype())
            .map_err(Failure::runtime)?;
        let sm_count = gpu.device.props().sm_count as usize;
        let mut launches = Vec::with_capacity(max_rows);
        // The prefill's job list shares the workspace: two values a page of every slot at most.
        let mut workspace_bytes = 8 * max_seqs * max_pages;
        // A query row reads its sequence's cache like a sequence of its own.
        for n in 1..=max_rows {
            let splits = decode
                .default_splits(n, kv_heads, max_len, sm_count)
                .map_err(Failure::runtime)?;
            let pieces = decode.default_pieces(max_len, splits);
            let layout = decode
                .workspace_layout(n, kv_heads, max_pages, splits, pieces)
                .map_err(Failure::runtime)?;
            workspace_bytes = workspace_bytes.max(layout.bytes);
            launches.push((splits, pieces));
        }
        Ok(PlanKernels {
            decode,
            writer,
            launches,
            workspace_bytes,
        })
    }

    /// `(splits, pieces)` of an attend of `n` query rows (1 up to the plan's `max_seqs ×
    /// max_q_len`).
    pub fn launch(&self, n: usize) -> Option<(usize, Pieces)> {
        n.checked_sub(1).and_then(|i| self.launches.get(i).copied())
    }

    /// The scratch of an attend of `n` query rows in the workspace at `workspace`.
    ///
    /// # Safety
    /// `workspace` is a device allocation of the GPU's context of at least `workspace_bytes`
    /// bytes, used by nothing else while the launches run.
    pub unsafe fn scratch(
        &self,
        plan: &KvqPlan,
        n: usize,
        workspace: u64,
    ) -> Result<DecodeScratch, Failure> {
        let (splits, pieces) = self.launch(n).ok_or_else(|| {
            Failure::argument(format!(
                "{n} query rows (the plan takes 1 to {})",
                self.launches.len()
            ))
        })?;
        let l = plan.limits();
        let layout = self
            .decode
            .workspace_layout(
                n,
                l.kv_heads as usize,
                plan.sizes().max_pages,
                splits,
                pieces,
            )
            .map_err(Failure::runtime)?;
        // SAFETY: the layout fits workspace_bytes (PlanKernels::load took the largest), and the
        // caller vouches for the allocation.
        unsafe { DecodeScratch::lent(&layout, workspace) }.map_err(Failure::runtime)
    }
}

/// A codebook plan's kernels on one GPU: the encoders and decode, the split count each batch size
/// gets, and the workspace they take.
pub struct CodebookPlanKernels {
    /// Store, page encoders, decode and combine.
    pub steps: CodebookSteps,
    /// Splits of an attend of `n` sequences, at index `n - 1`.
    splits: Vec<usize>,
    /// Bytes of the workspace every call of the plan on this GPU may use.
    pub workspace_bytes: usize,
}

impl CodebookPlanKernels {
    fn load(gpu: &Gpu, plan: &KvqPlan) -> Result<CodebookPlanKernels, Failure> {
        let l = plan.limits();
        let shape = KernelShape::new(l.head_dim, l.q_heads / l.kv_heads, plan.dtype());
        let steps = CodebookSteps::load(&gpu.jit, plan.spec(), &shape, l.kv_heads as usize)
            .map_err(Failure::runtime)?;
        let max_rows = (l.max_seqs as usize).min(u16::MAX as usize);
        let splits: Vec<usize> = (1..=max_rows)
            .map(|n| steps.decode.default_splits(n, l.max_seq_len as usize))
            .collect();
        let workspace_bytes = splits
            .iter()
            .enumerate()
            .map(|(i, &s)| steps.workspace_bytes(i + 1, s))
            .max()
            .unwrap_or(0);
        Ok(CodebookPlanKernels {
            steps,
            splits,
            workspace_bytes,
        })
    }

    /// Splits of an attend of `n` sequences (1 up to the plan's `max_seqs`).
    pub fn steps_splits(&self, n: usize) -> Result<usize, Failure> {
        n.checked_sub(1)
            .and_then(|i| self.splits.get(i).copied())
            .ok_or_else(|| {
                Failure::argument(format!(
                    "{n} sequences (the plan takes 1 to {})",
                    self.splits.len()
                ))
            })
    }
}

/// What a plan has loaded on each GPU it has run on (by ordinal), loaded on first use.
pub struct PerGpu<T>(Mutex<HashMap<usize, Arc<T>>>);

impl<T> Default for PerGpu<T> {
    fn default() -> Self {
        PerGpu(Mutex::new(HashMap::new()))
    }
}

impl<T> std::fmt::Debug for PerGpu<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("PerGpu")
            .field("ordinals", &map.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl<T> PerGpu<T> {
    /// GPU `ordinal`'s value, loaded by `load` on first use. A load runs under the lock: a second
    /// thread waits for the first one's compile.
    fn get_or_load(
        &self,
        ordinal: usize,
        load: impl FnOnce() -> Result<T, Failure>,
    ) -> Result<Arc<T>, Failure> {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = map.get(&ordinal) {
            return Ok(k.clone());
        }
        let k = Arc::new(load()?);
        map.insert(ordinal, k.clone());
        Ok(k)
    }
}

/// A plan's kernels, by family, on each GPU.
#[derive(Debug, Default)]
pub struct PlanGpus {
    integer: PerGpu<PlanKernels>,
    codebook: PerGpu<CodebookPlanKernels>,
    xquant: PerGpu<XQuantSteps>,
}

/// `plan`'s kernels on `gpu`, compiled (through the disk cache) on first use; an error for a
/// codebook plan ([`codebook_plan_kernels`]).
pub fn plan_kernels(gpu: &Gpu, plan: &KvqPlan) -> Result<Arc<PlanKernels>, Failure> {
    if plan.codebook_sizes().is_some() || plan.xquant_sizes().is_some() {
        return Err(Failure::new(
            KvqStatus::Internal,
            "a codebook or XQuant plan's kernels are its own",
        ));
    }
    plan.loaded
        .integer
        .get_or_load(gpu.device.ordinal(), || PlanKernels::load(gpu, plan))
}

/// A codebook plan's kernels on `gpu`, compiled (through the disk cache) on first use.
pub fn codebook_plan_kernels(
    gpu: &Gpu,
    plan: &KvqPlan,
) -> Result<Arc<CodebookPlanKernels>, Failure> {
    plan.loaded.codebook.get_or_load(gpu.device.ordinal(), || {
        CodebookPlanKernels::load(gpu, plan)
    })
}

/// An XQuant plan's kernels on `gpu` (decode, projection, latent writes) and its workspace,
/// compiled (through the disk cache) on first use.
pub fn xquant_plan_kernels(gpu: &Gpu, plan: &KvqPlan) -> Result<Arc<XQuantSteps>, Failure> {
    let Some(x) = plan.xquant_sizes() else {
        return Err(Failure::new(
            KvqStatus::Internal,
            "only an XQuant plan has XQuantSteps",
        ));
    };
    plan.loaded.xquant.get_or_load(gpu.device.ordinal(), || {
        let l = plan.limits();
        let shape = KernelShape::new(l.head_dim, l.q_heads / l.kv_heads, plan.dtype());
        let limits = XQuantLimits {
            max_seqs: l.max_seqs as usize,
            max_seq_len: l.max_seq_len as usize,
            max_pages: plan.sizes().max_pages,
        };
        let steps = XQuantSteps::load(
            &gpu.jit,
            plan.spec(),
            &shape,
            l.kv_heads as usize,
            l.d_model as usize,
            limits,
        )
        .map_err(Failure::runtime)?;
        if *steps.weights_layout() != x.weights || steps.accumulator_bytes() != x.accumulator_bytes
        {
            return Err(Failure::new(
                KvqStatus::Internal,
                "the plan's projection or accumulator layout differs from the kernels'",
            ));
        }
        Ok(steps)
    })
}

/// The plan's workspace bytes on `gpu`, its kernels loaded first.
fn workspace_bytes(gpu: &Gpu, plan: &KvqPlan) -> Result<usize, Failure> {
    Ok(if plan.codebook_sizes().is_some() {
        codebook_plan_kernels(gpu, plan)?.workspace_bytes
    } else if plan.xquant_sizes().is_some() {
        xquant_plan_kernels(gpu, plan)?.workspace().bytes
    } else {
        plan_kernels(gpu, plan)?.workspace_bytes
    })
}

/// Compiles (or loads from the disk cache) `plan`'s kernels on GPU `device` now, so that no later
/// call compiles: call it before capturing a CUDA graph (merge, prefill, append and attend).
///
/// # Safety
/// `plan` is NULL or a live plan.
#[no_mangle]
pub unsafe extern "C" fn kvq_plan_load(plan: *const KvqPlan, device: i32) -> KvqStatus {
    call(|| {
        let plan = unsafe { plan.as_ref() }.ok_or_else(|| Failure::argument("plan is NULL"))?;
        let ordinal = usize::try_from(device)
            .map_err(|_| Failure::argument(format!("device {device} (expected an ordinal ≥ 0)")))?;
        let _context = keep_current_context()?;
        let gpu = gpu(ordinal)?;
        merge_kernel(&gpu, plan)?;
        workspace_bytes(&gpu, plan).map(|_| ())
    })
}

/// Stores in `*bytes` the size of the workspace `kvq_prefill` and `kvq_attend` take for `plan` on
/// GPU `device` (loading the plan's kernels there first, as `kvq_plan_load`). It depends on the
/// GPU (its SMs set the split counts), so ask on each kind of GPU the engine runs on.
///
/// # Safety
/// `plan` is NULL or a live plan; `bytes` is NULL or points at a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn kvq_plan_workspace_bytes(
    plan: *const KvqPlan,
    device: i32,
    bytes: *mut u64,
) -> KvqStatus {
    call(|| {
        let plan = unsafe { plan.as_ref() }.ok_or_else(|| Failure::argument("plan is NULL"))?;
        let bytes = unsafe { bytes.as_mut() }.ok_or_else(|| Failure::argument("bytes is NULL"))?;
        let ordinal = usize::try_from(device)
            .map_err(|_| Failure::argument(format!("device {device} (expected an ordinal ≥ 0)")))?;
        let _context = keep_current_context()?;
        let gpu = gpu(ordinal)?;
        *bytes = workspace_bytes(&gpu, plan)? as u64;
        Ok(())
    })
}
