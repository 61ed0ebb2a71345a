//! GPU discovery and properties through the CUDA driver API.
//!
//! [`Device::open`] checks that `libcuda` loads, initialises the driver, checks the ordinal
//! against the device count, retains the device's primary context (cudarc's [`CudaContext`])
//! and reads the properties kvq's code generator, autotuner and benchmarks need
//! ([`DeviceProps`]). Each failure is a typed [`JitError`]: no driver library, no GPU,
//! ordinal out of range, or the driver call that failed.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{CudaContext, CudaStream};
use serde::{Deserialize, Serialize};

use crate::arch::Arch;
use crate::error::{JitError, Result};
use crate::libs::{ensure_driver, guard_driver};
pub use crate::version::DriverVersion;

/// The CUDA version of the installed driver. Needs `libcuda`, not a GPU.
pub fn driver_version() -> Result<DriverVersion> {
    // Asked once, when the library is first checked (`cuDriverGetVersion` needs no cuInit).
    crate::libs::driver_version()
}

/// Initialises the driver; `Ok(false)` when it reports no device at all.
fn init_driver() -> Result<bool> {
    ensure_driver()?;
    guard_driver("cuInit", || match cudarc::driver::result::init() {
        Ok(()) => Ok(true),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => Ok(false),
        Err(e) => Err(JitError::driver("cuInit", e)),
    })
}

/// How many GPUs the driver reports (0 when it loads but finds none).
pub fn device_count() -> Result<usize> {
    if !init_driver()? {
        return Ok(0);
    }
    match cudarc::driver::result::device::get_count() {
        Ok(n) => Ok(n.max(0) as usize),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => Ok(0),
        Err(e) => Err(JitError::driver("cuDeviceGetCount", e)),
    }
}

/// What kvq needs to know about a GPU. Serializable, so tuning results can record it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceProps {
    /// Driver ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// `(major, minor)`.
    pub compute_capability: (u32, u32),
    /// The architecture the JIT compiles for ([`Arch::for_compute_capability`]).
    pub arch: Arch,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// L2 cache, bytes.
    pub l2_bytes: u64,
    /// Device memory, bytes.
    pub total_memory_bytes: u64,
    /// Largest dynamic shared memory a block can opt into, bytes.
    pub max_shared_memory_per_block_optin: u32,
    /// Memory bus width, bits.
    pub memory_bus_width_bits: u32,
    /// Peak memory clock, kHz.
    pub memory_clock_khz: u32,
    /// The driver's CUDA version.
    pub driver: DriverVersion,
}

impl DeviceProps {
    /// Theoretical peak DRAM bandwidth in GB/s (double data rate × bus width), a ceiling to
    /// compare measured copy bandwidth against.
    pub fn peak_memory_bandwidth_gbps(&self) -> f64 {
        2.0 * self.memory_clock_khz as f64 * 1e3 * (self.memory_bus_width_bits as f64 / 8.0) / 1e9
    }
}

impl fmt::Display for DeviceProps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GPU {}: {} (compute {}.{}, {}, {} SMs, {} MiB L2, {} MiB memory, {})",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.arch,
            self.sm_count,
            self.l2_bytes >> 20,
            self.total_memory_bytes >> 20,
            self.driver
        )
    }
}

/// An opened GPU: its primary context and its properties. Cheap to clone.
#[derive(Clone)]
pub struct Device {
    ctx: Arc<CudaContext>,
    props: Arc<DeviceProps>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("props", &self.props)
            .finish()
    }
}

impl Device {
    /// Opens GPU `ordinal`.
    pub fn open(ordinal: usize) -> Result<Device> {
        // The session's first calls into the driver (context, queries): a panic inside the
        // bindings comes back as an error, never through a host engine.
        guard_driver("open the device", || Device::open_unguarded(ordinal))
    }

    fn open_unguarded(ordinal: usize) -> Result<Device> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(JitError::NoGpu { ordinal, count });
        }
        let driver = driver_version()?;
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| JitError::driver(format!("create a context on GPU {ordinal}"), e))?;
        let attr = |a: CUdevice_attribute, what: &str| -> Result<u32> {
            ctx.attribute(a)
                .map(|v| v.max(0) as u32)
                .map_err(|e| JitError::driver(format!("cuDeviceGetAttribute({what})"), e))
        };
        let name = ctx
            .name()
            .map_err(|e| JitError::driver("cuDeviceGetName", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| JitError::driver("cuDeviceGetAttribute(compute capability)", e))?;
        let (major, minor) = (major.max(0) as u32, minor.max(0) as u32);
        let total_memory_bytes =
            ctx.total_mem()
                .map_err(|e| JitError::driver("cuDeviceTotalMem", e))? as u64;
        let props = DeviceProps {
            ordinal,
            name,
            compute_capability: (major, minor),
            arch: Arch::for_compute_capability(major, minor),
            sm_count: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                "multiprocessor count",
            )?,
            l2_bytes: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
                "L2 cache size",
            )? as u64,
            total_memory_bytes,
            max_shared_memory_per_block_optin: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "max shared memory per block (opt-in)",
            )?,
            memory_bus_width_bits: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
                "memory bus width",
            )?,
            memory_clock_khz: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
                "memory clock rate",
            )?,
            driver,
        };
        Ok(Device {
            ctx,
            props: Arc::new(props),
        })
    }

    /// The properties read at open.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }

    /// The architecture the JIT compiles for on this device.
    pub fn arch(&self) -> Arch {
        self.props.arch
    }

    /// The driver ordinal.
    pub fn ordinal(&self) -> usize {
        self.props.ordinal
    }

    /// cudarc's context (allocate buffers, create streams and events through it).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The context's default stream.
    pub fn default_stream(&self) -> Arc<CudaStream> {
        self.ctx.default_stream()
    }

    /// A new stream.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx
            .new_stream()
            .map_err(|e| JitError::driver("cuStreamCreate", e))
    }

    /// Waits for all work on the device; a kernel fault shows up here as
    /// [`JitError::Launch`] naming `after` (what was launched before).
    pub fn synchronize(&self, after: &str) -> Result<()> {
        self.ctx
            .synchronize()
            .map_err(|e| JitError::async_failure(after, e))
    }
}

/// The context a caller's stream belongs to (an engine's stream, handed to kvq through the C ABI
/// or the Python package). A null stream, the legacy default stream, stands for the calling
/// thread's current context; without one that is an error saying so.
///
/// # Safety
/// `stream` is null or a stream handle that has not been destroyed.
pub unsafe fn stream_context(stream: sys::CUstream) -> Result<sys::CUcontext> {
    // Loads and checks the driver first: every failure below is then a driver's answer.
    device_count()?;
    guard_driver("find the context of a stream", || {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the caller vouches for the stream; ctx is a valid out-pointer.
        unsafe { sys::cuStreamGetCtx(stream, &mut ctx) }
            .result()
            .map_err(|e| JitError::driver("cuStreamGetCtx (the stream's context)", e))?;
        if ctx.is_null() {
            return Err(JitError::InvalidInput(
                "the null stream stands for the thread's current CUDA context, and this thread \
                 has none: pass a stream, or make a context current first"
                    .into(),
            ));
        }
        Ok(ctx)
    })
}

/// The GPU ordinal of a live context (from [`stream_context`]), leaving the thread's current
/// context as it was.
///
/// # Safety
/// `ctx` is a live context.
pub unsafe fn context_device(ctx: sys::CUcontext) -> Result<usize> {
    guard_driver("find the device of a context", || {
        let mut device: sys::CUdevice = 0;
        // SAFETY: the caller vouches for ctx; it is pushed for the query and popped after.
        let pushed = unsafe { sys::cuCtxPushCurrent_v2(ctx) }.result();
        pushed.map_err(|e| JitError::driver("cuCtxPushCurrent (the stream's context)", e))?;
        let got = unsafe { sys::cuCtxGetDevice(&mut device) }.result();
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        let pop = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }.result();
        got.map_err(|e| JitError::driver("cuCtxGetDevice (the stream's device)", e))?;
        pop.map_err(|e| JitError::driver("cuCtxPopCurrent", e))?;
        Ok(device.max(0) as usize)
    })
}

/// The GPU ordinal and context a caller's stream belongs to: [`stream_context`], then
/// [`context_device`].
///
/// # Safety
/// `stream` is null or a stream handle that has not been destroyed.
pub unsafe fn stream_device(stream: sys::CUstream) -> Result<(usize, sys::CUcontext)> {
    let ctx = unsafe { stream_context(stream) }?;
    Ok((unsafe { context_device(ctx) }?, ctx))
}

impl Device {
    /// Whether `ctx` is this device's primary context, the one kvq's modules are loaded into (a
    /// stream of that context runs on this GPU, with no driver call to ask).
    pub fn owns_context(&self, ctx: sys::CUcontext) -> bool {
        ctx == self.ctx.cu_ctx()
    }

    /// A caller's stream of this device, borrowed for launches (dropping the wrapper leaves the
    /// stream alone). `ctx` is the stream's context from [`stream_device`]: it must be this
    /// device's primary context, the one kvq's modules are loaded into (PyTorch and most engines
    /// run on it); another context is an error naming the fix.
    ///
    /// # Safety
    /// `stream` is null or a live stream of `ctx`, and stays alive while the wrapper is used.
    pub unsafe fn borrow_stream(
        &self,
        stream: sys::CUstream,
        ctx: sys::CUcontext,
    ) -> Result<Arc<CudaStream>> {
        if !self.owns_context(ctx) {
            return Err(JitError::InvalidInput(format!(
                "the stream belongs to a CUDA context other than GPU {}'s primary context, which \
                 kvq's kernels are loaded into: create the stream in the primary context (as \
                 PyTorch does, or with cuDevicePrimaryCtxRetain)",
                self.ordinal()
            )));
        }
        // SAFETY: the caller vouches for the stream's life; its context is ours (checked).
        Ok(unsafe { self.ctx.wrap_borrowed_stream(stream) })
    }
}

/// Restores, when dropped, the CUDA context that was current on the calling thread when it was
/// made: kvq's launches make their stream's context current, and a caller (an engine, PyTorch,
/// another GPU's work on the same thread) keeps its own.
pub struct RestoreContext(Option<sys::CUcontext>);

impl RestoreContext {
    /// The thread's current context now (none is a context too: it is restored as none). Call it
    /// once the driver is loaded (after [`stream_device`]); if the driver cannot say, nothing is
    /// restored.
    pub fn save() -> RestoreContext {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: ctx is a valid out-pointer; the driver is loaded (the caller's contract).
        let known = unsafe { sys::cuCtxGetCurrent(&mut ctx) }.result().is_ok();
        RestoreContext(known.then_some(ctx))
    }
}

impl Drop for RestoreContext {
    fn drop(&mut self) {
        if let Some(ctx) = self.0 {
            // SAFETY: the context (or none) was current on this thread when saved, and a primary
            // or caller's context outlives the call; a failure leaves the thread as the launches
            // left it.
            let _ = unsafe { sys::cuCtxSetCurrent(ctx) };
        }
    }
}

/// Waits for `stream`; errors are reported as failures of `after`.
pub fn synchronize_stream(stream: &CudaStream, after: &str) -> Result<()> {
    stream
        .synchronize()
        .map_err(|e| JitError::async_failure(after, e))
}
