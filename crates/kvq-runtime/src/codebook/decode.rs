//! The fused decode of a codebook scheme over a [`CodebookCache`]: split-K attention straight from
//! the codes, and the combine of its splits.

use super::cache::CodebookCache;
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{allow_dynamic_shared, launch_err, unit_source, Args, Output};
use crate::nvrtc::CompileOptions;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use kvq_codegen::{codebook_kernels_with, CodebookKernels, CodebookParams, KernelShape};
use kvq_reference::commvq::device::DeviceLayout;
use kvq_spec::SchemeSpec;
use std::sync::Arc;

/// A codebook scheme's decode and combine kernels for one shape, compiled and loaded.
pub struct CodebookKernel {
    generated: CodebookKernels,
    spec: SchemeSpec,
    kv_heads: usize,
    decode: CudaFunction,
    combine: CudaFunction,
    sm_count: u32,
}

impl CodebookKernel {
    /// Generates, compiles (through the JIT's caches) and loads the kernels of `spec` for `shape`
    /// over caches of `kv_heads` KV heads.
    pub fn load(
        jit: &Jit,
        spec: &SchemeSpec,
        shape: &KernelShape,
        kv_heads: usize,
    ) -> Result<Self> {
        Self::load_with(
            jit,
            spec,
            shape,
            kv_heads,
            &CodebookParams::default_for(spec, shape)?,
        )
    }

    /// [`CodebookKernel::load`] with the launch shape `params` (a tuner's choice).
    pub fn load_with(
        jit: &Jit,
        spec: &SchemeSpec,
        shape: &KernelShape,
        kv_heads: usize,
        params: &CodebookParams,
    ) -> Result<Self> {
        let heads = u32::try_from(kv_heads)
            .map_err(|_| RuntimeError::InvalidInput(format!("{kv_heads} KV heads")))?;
        let generated = codebook_kernels_with(spec, shape, heads, params)?;
        let source = unit_source(&generated.decode.name, &generated.source);
        let names = [
            generated.decode.name.as_str(),
            generated.combine.name.as_str(),
        ];
        let mut functions = jit
            .functions(&source, &names, &CompileOptions::default())?
            .into_iter();
        let (Some(decode), Some(combine)) = (functions.next(), functions.next()) else {
            return Err(RuntimeError::InvalidInput(
                "kernel list shorter than requested".into(),
            ));
        };
        allow_dynamic_shared(&decode, &generated.decode)?;
        Ok(Self {
            generated,
            spec: *spec,
            kv_heads,
            decode,
            combine,
            sm_count: jit.device().props().sm_count,
        })
    }

    /// The device layout the kernel reads (the reference's).
    pub fn layout(&self) -> &DeviceLayout {
        &self.generated.layout
    }

    /// The generated source and launch metadata.
    pub fn generated(&self) -> &CodebookKernels {
        &self.generated
    }

    /// Splits a (sequence, KV head) takes by default, each at least four tiles of tokens: with
    /// the codebook in shared memory as many as fill one wave of the GPU's SMs at one CTA an SM
    /// (what CommVQ-1's 160 KiB codebook allows), without a partial second wave; otherwise enough
    /// CTAs for two waves. The tuner finds better counts at long contexts (BENCHMARKS.md).
    pub fn default_splits(&self, batch: usize, max_len: usize) -> usize {
        let pairs = (batch * self.kv_heads).max(1);
        let sms = self.sm_count as usize;
        let want = if self.generated.book_in_shared_memory {
            (sms / pairs).max(1)
        } else {
            (2 * sms).div_ceil(pairs)
        };
        let most = max_len.div_ceil(4 * self.generated.tile as usize).max(1);
        want.clamp(1, most)
    }

    /// Enqueues decode attention for every sequence of `cache` on `stream`: `q` and `out` are
    /// `[batch][kv_heads·gqa][head_dim]` in the kernel's dtype; `splits` parts a (sequence, KV
    /// head), merged by the combine kernel (one part: the decode writes `out` itself).
    pub fn attend(
        &self,
        stream: &Arc<CudaStream>,
        cache: &CodebookCache,
        q: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        splits: usize,
        scratch: &mut CodebookScratch,
    ) -> Result<()> {
        let shape = self.generated.shape;
        let d = shape.head_dim as usize;
        let q_heads = cache.kv_heads * shape.gqa as usize;
        if cache.spec != self.spec || cache.kv_heads != self.kv_heads || cache.head_dim != d {
            return Err(RuntimeError::InvalidInput(format!(
                "cache holds `{}` with {} KV heads of {}; the kernel is for `{}` with {} of {d}",
                cache.spec, cache.kv_heads, cache.head_dim, self.spec, self.kv_heads
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
        if splits == 0 || splits > 1024 {
            return Err(RuntimeError::InvalidInput(format!(
                "{splits} splits (1 to 1024)"
            )));
        }
        scratch.reserve(stream, cache.batch * q_heads * splits, d)?;
        let max_pages = i32::try_from(cache.max_pages)
            .map_err(|_| RuntimeError::InvalidInput(format!("{} pages", cache.max_pages)))?;
        let cfg = LaunchConfig {
            grid_dim: (splits as u32, cache.kv_heads as u32, cache.batch as u32),
            block_dim: (self.generated.decode.block, 1, 1),
            shared_mem_bytes: self.generated.decode.dynamic_shared_bytes,
        };
        let mut args = Args::new(stream);
        args.buffer(q)
            .buffer(&cache.k_pool)
            .buffer(&cache.v_pool)
            .buffer(&cache.page_table)
            .int(max_pages)
            .buffer(&cache.k_sink)
            .buffer(&cache.v_sink)
            .buffer(&cache.k_tail)
            .buffer(&cache.v_tail)
            .buffer(&cache.seq_lens)
            .null()
            .int(1)
            .buffer(&cache.k_book)
            .buffer(&cache.k_rows)
            .buffer(&cache.k_mean)
            .buffer(&cache.v_rows)
            .buffer(&cache.v_mean)
            .double(cache.rope_theta)
            .buffer_mut(&mut scratch.part_acc)
            .buffer_mut(&mut scratch.part_ml);
        let one_part = splits == 1;
        let mut out = Some(out);
        if one_part {
            args.output(Output::Slice(out.take().expect("the output is still here")));
        } else {
            args.null();
        }
        // SAFETY: the arguments follow KernelEntry::params of the decode unit, every buffer was
        // sized for this grid (the cache by `upload`, the partials by `reserve` above).
        unsafe { args.launch(&self.decode, cfg, false) }
            .map_err(launch_err(&self.generated.decode.name))?;
        let Some(out) = out else { return Ok(()) };
        scratch.combine(
            stream,
            &self.combine,
            &self.generated.combine,
            out,
            (q_heads, cache.batch),
            splits,
        )
    }
}

impl CodebookKernel {
    /// [`Self::attend`] on an engine's memory ([`super::CodebookPtrs`]): `n` query rows, row `i`
    /// for the slot `slots[i]` names (device i32; −1: a padding row), `books` the addresses of the
    /// decode's five codebook tensors (k_book, k_rows, k_mean, v_rows, v_mean), partials at
    /// `part_acc` (`[n·q_heads·splits][D]` f32) and `part_ml` (`[n·q_heads·splits][2]` f32). The
    /// combine always runs, so `out` and `lse` (0: not written) come from one place.
    ///
    /// # Safety
    /// Every address is device memory of `stream`'s context of those sizes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_ptrs(
        &self,
        stream: &Arc<CudaStream>,
        p: &super::CodebookPtrs,
        books: &[u64; 5],
        n: usize,
        slots: u64,
        q: u64,
        out: u64,
        lse: u64,
        splits: usize,
        part_acc: u64,
        part_ml: u64,
    ) -> Result<()> {
        if splits == 0 || splits > 1024 {
            return Err(RuntimeError::InvalidInput(format!(
                "{splits} splits (1 to 1024)"
            )));
        }
        let rows = u32::try_from(n)
            .ok()
            .filter(|&r| r <= u16::MAX as u32)
            .ok_or_else(|| RuntimeError::InvalidInput(format!("{n} query rows (at most 65535)")))?;
        let max_pages = i32::try_from(p.max_pages)
            .map_err(|_| RuntimeError::InvalidInput(format!("{} pages", p.max_pages)))?;
        let cfg = LaunchConfig {
            grid_dim: (splits as u32, self.kv_heads as u32, rows),
            block_dim: (self.generated.decode.block, 1, 1),
            shared_mem_bytes: self.generated.decode.dynamic_shared_bytes,
        };
        let mut args = Args::new(stream);
        args.ptr(q)
            .ptr(p.k_pool)
            .ptr(p.v_pool)
            .ptr(p.page_table)
            .int(max_pages)
            .ptr(p.k_sink)
            .ptr(p.v_sink)
            .ptr(p.k_tail)
            .ptr(p.v_tail)
            .ptr(p.seq_lens)
            .ptr(slots)
            .int(1);
        for b in books {
            args.ptr(*b);
        }
        args.double(p.rope_theta).ptr(part_acc).ptr(part_ml).null();
        // SAFETY: the decode entry's params; the caller vouches for the buffers.
        unsafe { args.launch(&self.decode, cfg, false) }
            .map_err(launch_err(&self.generated.decode.name))?;
        let q_heads = self.kv_heads as u32 * self.generated.shape.gqa;
        let cfg = LaunchConfig {
            grid_dim: (q_heads, rows, 1),
            block_dim: (self.generated.combine.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = Args::new(stream);
        args.ptr(part_acc).ptr(part_ml).ptr(out);
        if lse == 0 {
            args.null();
        } else {
            args.ptr(lse);
        }
        args.int(splits as i32);
        // SAFETY: as above; the partials hold `splits` parts a head.
        unsafe { args.launch(&self.combine, cfg, false) }
            .map_err(launch_err(&self.generated.combine.name))
    }
}

/// The split partials the codebook decode writes and its combine reads.
pub type CodebookScratch = crate::split_scratch::SplitScratch;
