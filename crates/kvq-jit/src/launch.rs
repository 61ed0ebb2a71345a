//! Kernel launches that may overlap the kernel before them in the stream (programmatic dependent
//! launch, compute capability 9.0 on). A kernel launched that way may be scheduled while its
//! predecessor still runs, and waits for the predecessor's results in its own code
//! (`griddepcontrol.wait`). kvq-runtime's decode step uses it twice: the decode grid of a
//! calibrated scheme overlaps the score-range grid, and the combine grid overlaps the decode
//! grid, so each one's launch and prologue hide behind the previous grid's last CTAs.
//!
//! cudarc's launch builder takes no launch attributes, so these launches go through
//! `cuLaunchKernelEx` (or `cuLaunchKernel` when not overlapping) with an argument list of their
//! own, [`Args`].

use std::ffi::c_void;
use std::ptr;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError, LaunchConfig,
    SyncOnDrop,
};

/// A buffer a kernel reads: a cudarc slice (its use recorded on the stream) or a device pointer
/// the caller owns (an engine's memory; 0 for a parameter the kernel takes as optional).
#[derive(Clone, Copy)]
pub enum Input<'a, T> {
    /// A cudarc allocation.
    Slice(&'a CudaSlice<T>),
    /// A device address.
    Raw(u64),
}

/// A buffer a kernel writes, as [`Input`].
pub enum Output<'a, T> {
    /// A cudarc allocation.
    Slice(&'a mut CudaSlice<T>),
    /// A device address.
    Raw(u64),
}

impl<T> Input<'_, T> {
    /// The device address, with the stream-order guard of a cudarc slice (hold it until the
    /// work that uses the address is enqueued).
    pub fn device_ptr<'s>(&'s self, stream: &'s CudaStream) -> (u64, Option<SyncOnDrop<'s>>) {
        match self {
            Input::Slice(s) => {
                let (p, g) = s.device_ptr(stream);
                (p, Some(g))
            }
            Input::Raw(p) => (*p, None),
        }
    }
}

impl<T> Output<'_, T> {
    /// The device address, as [`Input::device_ptr`], recorded as a write.
    pub fn device_ptr<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, Option<SyncOnDrop<'s>>) {
        match self {
            Output::Slice(s) => {
                let (p, g) = s.device_ptr_mut(stream);
                (p, Some(g))
            }
            Output::Raw(p) => (*p, None),
        }
    }

    /// The same buffer, lent again for one more launch.
    pub fn reborrow(&mut self) -> Output<'_, T> {
        match self {
            Output::Slice(s) => Output::Slice(&mut **s),
            Output::Raw(p) => Output::Raw(*p),
        }
    }

    /// The same buffer, for a launch that reads it.
    pub fn as_input(&self) -> Input<'_, T> {
        match self {
            Output::Slice(s) => Input::Slice(&**s),
            Output::Raw(p) => Input::Raw(*p),
        }
    }
}

/// A kernel's arguments in parameter order: device pointers and 32-bit scalars, each in an
/// 8-byte slot, with the buffers' stream-order guards (dropped after the launch, which records
/// the buffers' use on the stream as cudarc's launch builder does).
pub struct Args<'a> {
    stream: &'a Arc<CudaStream>,
    slots: Vec<u64>,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Args<'a> {
    /// An empty argument list for a launch on `stream`.
    pub fn new(stream: &'a Arc<CudaStream>) -> Self {
        Args {
            stream,
            slots: Vec::with_capacity(16),
            guards: Vec::with_capacity(16),
        }
    }

    /// A buffer the kernel reads.
    pub fn buffer<T>(&mut self, buffer: &'a CudaSlice<T>) -> &mut Self {
        let (ptr, guard) = buffer.device_ptr(self.stream);
        self.slots.push(ptr);
        self.guards.push(guard);
        self
    }

    /// A buffer the kernel writes.
    pub fn buffer_mut<T>(&mut self, buffer: &'a mut CudaSlice<T>) -> &mut Self {
        let (ptr, guard) = buffer.device_ptr_mut(self.stream);
        self.slots.push(ptr);
        self.guards.push(guard);
        self
    }

    /// A null pointer, for a buffer the kernel takes as optional (it writes nothing there).
    pub fn null(&mut self) -> &mut Self {
        self.ptr(0)
    }

    /// A device pointer the caller owns (an engine's memory): no stream-order guard is kept for
    /// it, so ordering its use with other streams is the caller's, as with any raw launch.
    pub fn ptr(&mut self, device_ptr: u64) -> &mut Self {
        self.slots.push(device_ptr);
        self
    }

    /// A buffer the kernel reads, either kind.
    pub fn input<T>(&mut self, buffer: Input<'a, T>) -> &mut Self {
        match buffer {
            Input::Slice(s) => self.buffer(s),
            Input::Raw(p) => self.ptr(p),
        }
    }

    /// A buffer the kernel writes, either kind.
    pub fn output<T>(&mut self, buffer: Output<'a, T>) -> &mut Self {
        match buffer {
            Output::Slice(s) => self.buffer_mut(s),
            Output::Raw(p) => self.ptr(p),
        }
    }

    /// An `int` parameter.
    pub fn int(&mut self, value: i32) -> &mut Self {
        self.slots.push(int_slot(value));
        self
    }

    /// A `double` parameter (its eight bytes fill the slot).
    pub fn double(&mut self, value: f64) -> &mut Self {
        self.slots.push(value.to_bits());
        self
    }

    /// Launches `func` on the stream; with `overlap`, allowed to overlap the stream's previous
    /// kernel (`cuLaunchKernelEx`, which every driver kvq accepts exports).
    ///
    /// # Safety
    /// The arguments match `func`'s parameters in number, order and type, and every buffer is
    /// large enough for the grid. With `overlap`, every CTA of `func` executes
    /// `griddepcontrol.wait` (which returns once the previous kernel has finished and its writes
    /// are visible) before it reads anything that kernel writes.
    pub unsafe fn launch(
        mut self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        overlap: bool,
    ) -> Result<(), DriverError> {
        let mut params: Vec<*mut c_void> = self
            .slots
            .iter_mut()
            .map(|slot| (slot as *mut u64).cast::<c_void>())
            .collect();
        self.stream.context().bind_to_thread()?;
        // SAFETY: the parameter pointers point into `self.slots`, alive through the calls; the
        // caller vouches for the arguments and, with `overlap`, for the kernel's wait.
        let status = unsafe {
            if overlap {
                launch_ex_overlapping(self.stream, func, cfg, &mut params)
            } else {
                sys::cuLaunchKernel(
                    func.cu_function(),
                    cfg.grid_dim.0,
                    cfg.grid_dim.1,
                    cfg.grid_dim.2,
                    cfg.block_dim.0,
                    cfg.block_dim.1,
                    cfg.block_dim.2,
                    cfg.shared_mem_bytes,
                    self.stream.cu_stream(),
                    params.as_mut_ptr(),
                    ptr::null_mut(),
                )
            }
        };
        drop(self.guards);
        status.result()
    }
}

/// An `int` argument's slot: the driver copies the parameter's 4 bytes from the slot's start.
fn int_slot(value: i32) -> u64 {
    let mut slot = [0u8; 8];
    slot[..4].copy_from_slice(&value.to_ne_bytes());
    u64::from_ne_bytes(slot)
}

/// `cuLaunchKernelEx` with programmatic stream serialization allowed.
///
/// # Safety
/// As [`Args::launch`] with `overlap`; `params` holds one valid pointer per parameter.
unsafe fn launch_ex_overlapping(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    params: &mut [*mut c_void],
) -> sys::CUresult {
    // SAFETY: an all-zero attribute value is valid (a union of plain integers and structs of them).
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attribute = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attribute,
        numAttrs: 1,
    };
    // SAFETY: the configuration and attribute live through the call; the caller vouches for
    // `params` and the kernel's wait.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            params.as_mut_ptr(),
            ptr::null_mut(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int_arguments_occupy_the_first_four_bytes_of_their_slot() {
        for value in [-7, 0, 1, i32::MAX, i32::MIN] {
            let bytes = int_slot(value).to_ne_bytes();
            assert_eq!(i32::from_ne_bytes(bytes[..4].try_into().unwrap()), value);
            assert_eq!(bytes[4..], [0; 4]);
        }
    }
}
