//! Loading a scheme's decode kernels and launching them.

use std::sync::Arc;

use std::ffi::c_void;

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use kvq_codegen::{decode_kernels, DecodeKernels, KernelShape, TuneParams};
use kvq_spec::SchemeSpec;

use super::cache::CacheView;
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{driver_has_launch_ex, launch_overlapping_previous};
use crate::module::allow_dynamic_shared;
use crate::nvrtc::{CompileOptions, Source};

/// The compiled decode kernels of one scheme × shape × tuning.
pub struct DecodeKernel {
    spec: SchemeSpec,
    generated: DecodeKernels,
    decode: CudaFunction,
    combine: CudaFunction,
    range: Option<CudaFunction>,
    /// The GPU and driver can launch the combine kernel overlapping the decode kernel
    /// (programmatic dependent launch: compute capability 9.0 on, `cuLaunchKernelEx`).
    can_overlap_combine: bool,
    /// `attend` does so.
    overlap_combine: bool,
}

/// Whether decode steps overlap by default: wherever the GPU can, unless `KVQ_PDL=off` (a switch
/// for measuring the difference, or for a driver that misbehaves).
fn overlap_by_default() -> bool {
    std::env::var("KVQ_PDL").map_or(true, |v| v != "off")
}

/// Per-launch scratch (split partials, calibration ranges), reusable across steps of the same
/// batch size, KV heads and split count.
pub struct DecodeScratch {
    splits: usize,
    rows: usize,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    score_range: CudaSlice<f32>,
}

fn launch_err(name: &str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::launch(name, e)
}

impl DecodeScratch {
    /// Scratch for `batch` sequences of `q_heads` query heads of `head_dim`, split `splits` ways.
    /// Filled with NaN, so a partial result the kernel forgot to write cannot pass a check.
    pub fn new(
        stream: &Arc<CudaStream>,
        batch: usize,
        q_heads: usize,
        head_dim: usize,
        splits: usize,
    ) -> Result<DecodeScratch> {
        let rows = batch * q_heads;
        let nan = |n: usize, what: &str| {
            stream
                .clone_htod(&vec![f32::NAN; n.max(1)])
                .map_err(|e| RuntimeError::driver(format!("allocate {what}"), e))
        };
        Ok(DecodeScratch {
            splits,
            rows,
            part_acc: nan(rows * splits * head_dim, "split partial outputs")?,
            part_ml: nan(rows * splits * 2, "split softmax statistics")?,
            score_range: nan(rows * splits * 2, "calibration score ranges")?,
        })
    }

    /// Split-K partitions this scratch was sized for.
    pub fn splits(&self) -> usize {
        self.splits
    }
}

impl DecodeKernel {
    /// Generates, compiles (through the JIT's caches) and loads the kernels.
    pub fn load(
        jit: &Jit,
        spec: &SchemeSpec,
        shape: &KernelShape,
        tune: &TuneParams,
    ) -> Result<DecodeKernel> {
        let generated = decode_kernels(spec, shape, tune)?;
        let source = Source::new(
            format!("{}.cu", generated.decode.name),
            generated.source.clone(),
        );
        let mut names = vec![
            generated.decode.name.as_str(),
            generated.combine.name.as_str(),
        ];
        if let Some(r) = &generated.range {
            names.push(r.name.as_str());
        }
        let mut functions = jit
            .functions(&source, &names, &CompileOptions::default())?
            .into_iter();
        let mut next = || {
            functions.next().ok_or_else(|| {
                RuntimeError::InvalidInput("kernel list shorter than requested".into())
            })
        };
        let decode = next()?;
        allow_dynamic_shared(&decode, &generated.decode)?;
        let combine = next()?;
        let range = match &generated.range {
            Some(entry) => {
                let f = next()?;
                allow_dynamic_shared(&f, entry)?;
                Some(f)
            }
            None => None,
        };
        let can_overlap = jit.arch().sm() >= 90 && driver_has_launch_ex();
        Ok(DecodeKernel {
            spec: *spec,
            generated,
            decode,
            combine,
            range,
            can_overlap_combine: can_overlap,
            overlap_combine: can_overlap && overlap_by_default(),
        })
    }

    /// Whether [`attend`](Self::attend) launches the combine kernel overlapping the decode
    /// kernel (programmatic dependent launch): on by default from compute capability 9.0 with a
    /// driver that has `cuLaunchKernelEx` (CUDA 12.0 on), off with `KVQ_PDL=off`.
    pub fn overlaps_combine(&self) -> bool {
        self.overlap_combine
    }

    /// Turns the overlap on (where the GPU can) or off, and returns whether it is now on. The
    /// results are the same bits either way; off, the launches are the plain ones an engine
    /// embedding the generated kernels would make.
    pub fn set_overlap_combine(&mut self, on: bool) -> bool {
        self.overlap_combine = on && self.can_overlap_combine;
        self.overlap_combine
    }

    /// The generated source and launch metadata.
    pub fn generated(&self) -> &DecodeKernels {
        &self.generated
    }

    /// How many decode CTAs a GPU of `sm_count` SMs holds at once (the driver's occupancy for
    /// this kernel's registers and shared memory): what [`default_splits`](super::default_splits)
    /// fills whole waves of.
    pub fn resident_ctas(&self, sm_count: usize) -> Result<usize> {
        let per_sm = self
            .decode
            .occupancy_max_active_blocks_per_multiprocessor(
                self.generated.decode.block,
                self.generated.decode.dynamic_shared_bytes as usize,
                None,
            )
            .map_err(|e| RuntimeError::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?;
        Ok(per_sm.max(1) as usize * sm_count.max(1))
    }

    /// The heuristic split count for a batch of `batch` sequences of at most `max_len` tokens
    /// with `kv_heads` KV heads on a GPU of `sm_count` SMs.
    pub fn default_splits(
        &self,
        batch: usize,
        kv_heads: usize,
        max_len: usize,
        sm_count: usize,
    ) -> Result<usize> {
        Ok(super::default_splits(
            batch,
            kv_heads,
            max_len,
            self.resident_ctas(sm_count)?,
            self.generated.tune.warps(),
        ))
    }

    /// Enqueues decode attention for every sequence of `cache` on `stream` (no host
    /// synchronisation): `q` is `[batch][kv_heads·gqa][head_dim]`, `out` the same shape, both in the
    /// kernel's dtype (16-bit words).
    pub fn attend(
        &self,
        stream: &Arc<CudaStream>,
        cache: CacheView<'_>,
        q: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        scratch: &mut DecodeScratch,
    ) -> Result<()> {
        let shape = self.generated.shape;
        let d = shape.head_dim as usize;
        let q_heads = cache.kv_heads * shape.gqa as usize;
        if *cache.spec != self.spec {
            return Err(RuntimeError::InvalidInput(format!(
                "cache holds scheme `{}`, kernel is for `{}`",
                cache.spec, self.spec
            )));
        }
        if cache.head_dim != d {
            return Err(RuntimeError::InvalidInput(format!(
                "cache head_dim {} but kernel head_dim {d}",
                cache.head_dim
            )));
        }
        let need = cache.batch * q_heads * d;
        if q.len() != need || out.len() != need {
            return Err(RuntimeError::InvalidInput(format!(
                "q and out must hold [batch {}][q_heads {q_heads}][head_dim {d}] = {need} values, got {} and {}",
                cache.batch,
                q.len(),
                out.len()
            )));
        }
        if scratch.rows != cache.batch * q_heads {
            return Err(RuntimeError::InvalidInput(format!(
                "scratch was made for {} query rows, this launch has {}",
                scratch.rows,
                cache.batch * q_heads
            )));
        }
        let splits = scratch.splits as u32;
        let max_pages = cache.max_pages as i32;
        let split_cfg = LaunchConfig {
            grid_dim: (splits, cache.kv_heads as u32, cache.batch as u32),
            block_dim: (self.generated.decode.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let decode_cfg = LaunchConfig {
            shared_mem_bytes: self.generated.decode.dynamic_shared_bytes,
            ..split_cfg
        };
        if let (Some(range), Some(entry)) = (&self.range, &self.generated.range) {
            let mut b = stream.launch_builder(range);
            b.arg(q)
                .arg(cache.k_pool)
                .arg(cache.page_table)
                .arg(&max_pages)
                .arg(cache.k_sink)
                .arg(cache.k_tail)
                .arg(cache.seq_lens)
                .arg(&mut scratch.score_range);
            // SAFETY: arguments match the kernel's parameter list (KernelEntry::params), and every
            // buffer was sized above for this grid.
            let range_cfg = LaunchConfig {
                block_dim: (entry.block, 1, 1),
                shared_mem_bytes: entry.dynamic_shared_bytes,
                ..split_cfg
            };
            unsafe { b.launch(range_cfg) }.map_err(launch_err(&entry.name))?;
        }
        let mut b = stream.launch_builder(&self.decode);
        b.arg(q)
            .arg(cache.k_pool)
            .arg(cache.v_pool)
            .arg(cache.page_table)
            .arg(&max_pages)
            .arg(cache.k_sink)
            .arg(cache.v_sink)
            .arg(cache.k_tail)
            .arg(cache.v_tail)
            .arg(cache.seq_lens)
            .arg(&scratch.score_range)
            .arg(&mut scratch.part_acc)
            .arg(&mut scratch.part_ml);
        // SAFETY: as above.
        unsafe { b.launch(decode_cfg) }.map_err(launch_err(&self.generated.decode.name))?;
        let cfg = LaunchConfig {
            grid_dim: (q_heads as u32, cache.batch as u32, 1),
            block_dim: (self.generated.combine.block, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_combine(stream, scratch, out, splits as i32, cfg)
            .map_err(launch_err(&self.generated.combine.name))
    }

    /// The combine launch: overlapping the decode kernel where the GPU allows
    /// ([`launch_overlapping_previous`]), otherwise a plain launch.
    fn launch_combine(
        &self,
        stream: &Arc<CudaStream>,
        scratch: &DecodeScratch,
        out: &mut CudaSlice<u16>,
        mut splits: i32,
        cfg: LaunchConfig,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        if !self.overlap_combine {
            let mut b = stream.launch_builder(&self.combine);
            b.arg(&scratch.part_acc)
                .arg(&scratch.part_ml)
                .arg(out)
                .arg(&splits);
            // SAFETY: arguments match the kernel's parameter list, sized by `attend`.
            return unsafe { b.launch(cfg) }.map(|_| ());
        }
        // The guards record the buffers' uses on the stream when dropped, after the launch (what
        // the launch builder does for its arguments).
        let (mut part_acc, _acc_read) = scratch.part_acc.device_ptr(stream);
        let (mut part_ml, _ml_read) = scratch.part_ml.device_ptr(stream);
        let (mut out_ptr, _out_write) = out.device_ptr_mut(stream);
        let mut params = [
            (&mut part_acc as *mut u64).cast::<c_void>(),
            (&mut part_ml as *mut u64).cast::<c_void>(),
            (&mut out_ptr as *mut u64).cast::<c_void>(),
            (&mut splits as *mut i32).cast::<c_void>(),
        ];
        // SAFETY: one pointer per parameter of the combine kernel (part_acc, part_ml, out,
        // num_splits), each to a live value of its type; the kernel waits for the decode grid
        // (`kvq_wait_for_previous_grid`) before its first read of the partials.
        unsafe { launch_overlapping_previous(stream, &self.combine, cfg, &mut params) }
    }
}
