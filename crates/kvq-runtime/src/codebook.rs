//! Codebook schemes (CommVQ) on the GPU: the fused decode over a paged cache in the device layout
//! of `kvq_reference::commvq::device` ([`CodebookKernel`]), and a batch's cache held in device
//! memory ([`CodebookCache`]), uploaded from the CPU reference's coded sequences.
//!
//! ```no_run
//! # fn demo(jit: &kvq_runtime::Jit, spec: &kvq_spec::SchemeSpec,
//! #         cache: &kvq_reference::commvq::CommVqCache) -> kvq_runtime::Result<()> {
//! use kvq_codegen::{Dtype, KernelShape};
//! use kvq_runtime::codebook::{CodebookCache, CodebookKernel};
//! let kernel = CodebookKernel::load(jit, spec, &KernelShape::new(128, 4, Dtype::F16), cache.kv_heads())?;
//! let stream = jit.device().default_stream();
//! let gpu = CodebookCache::upload(&stream, kernel.layout(), std::slice::from_ref(cache), cache.rope().theta)?;
//! # Ok(()) }
//! ```

use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{allow_dynamic_shared, launch_err, unit_source, Args, Input, Output};
use crate::nvrtc::CompileOptions;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use kvq_codegen::{
    codebook_kernels, CodebookKernels, KernelShape, CODEBOOK_SMEM_TILE, CODEBOOK_TILE,
};
use kvq_reference::commvq::device::{DeviceCodebooks, DeviceLayout, DeviceSequence};
use kvq_reference::commvq::CommVqCache;
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
        let heads = u32::try_from(kv_heads)
            .map_err(|_| RuntimeError::InvalidInput(format!("{kv_heads} KV heads")))?;
        let generated = codebook_kernels(spec, shape, heads)?;
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
    /// (what CommVQ-1's 160 KiB codebook allows; a smaller one would fit more CTAs, which this
    /// rule does not ask the occupancy for yet), without a partial second wave; otherwise enough
    /// CTAs for two waves.
    pub fn default_splits(&self, batch: usize, max_len: usize) -> usize {
        let pairs = (batch * self.kv_heads).max(1);
        let sms = self.sm_count as usize;
        let (want, tile) = if self.generated.book_in_shared_memory {
            ((sms / pairs).max(1), CODEBOOK_SMEM_TILE)
        } else {
            ((2 * sms).div_ceil(pairs), CODEBOOK_TILE)
        };
        let most = max_len.div_ceil(4 * tile as usize).max(1);
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
        let cfg = LaunchConfig {
            grid_dim: (q_heads as u32, cache.batch as u32, 1),
            block_dim: (self.generated.combine.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = Args::new(stream);
        args.input(Input::Slice(&scratch.part_acc))
            .input(Input::Slice(&scratch.part_ml))
            .output(Output::Slice(out))
            .null()
            .int(splits as i32);
        // SAFETY: as above; the partials hold `splits` parts a head.
        unsafe { args.launch(&self.combine, cfg, false) }
            .map_err(launch_err(&self.generated.combine.name))
    }
}

/// The split partials a decode writes and its combine reads, grown as launches need.
pub struct CodebookScratch {
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
}

impl CodebookScratch {
    /// An empty scratch on `stream`'s device.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(Self {
            part_acc: alloc(stream, 1)?,
            part_ml: alloc(stream, 1)?,
        })
    }

    fn reserve(&mut self, stream: &Arc<CudaStream>, parts: usize, head_dim: usize) -> Result<()> {
        if self.part_acc.len() < parts * head_dim {
            self.part_acc = alloc(stream, parts * head_dim)?;
        }
        if self.part_ml.len() < parts * 2 {
            self.part_ml = alloc(stream, parts * 2)?;
        }
        Ok(())
    }
}

fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
) -> Result<CudaSlice<T>> {
    stream
        .alloc_zeros::<T>(n.max(1))
        .map_err(|e| RuntimeError::driver("allocate a codebook cache buffer", e))
}

fn upload<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Clone>(
    stream: &Arc<CudaStream>,
    data: &[T],
) -> Result<CudaSlice<T>> {
    if data.is_empty() {
        return alloc(stream, 1);
    }
    stream
        .clone_htod(data)
        .map_err(|e| RuntimeError::driver("upload a codebook cache buffer", e))
}

/// A batch of CommVQ-coded sequences in device memory, in the layout [`CodebookKernel`] reads:
/// page pools of (page, KV head) blocks with a page table, FP16 sink and tail buffers, and the
/// layer's codebooks.
pub struct CodebookCache {
    spec: SchemeSpec,
    kv_heads: usize,
    head_dim: usize,
    batch: usize,
    max_pages: usize,
    rope_theta: f64,
    read_bytes: u64,
    k_pool: CudaSlice<u8>,
    v_pool: CudaSlice<u8>,
    page_table: CudaSlice<i32>,
    seq_lens: CudaSlice<i32>,
    k_sink: CudaSlice<u16>,
    v_sink: CudaSlice<u16>,
    k_tail: CudaSlice<u16>,
    v_tail: CudaSlice<u16>,
    k_book: CudaSlice<u32>,
    k_rows: CudaSlice<f32>,
    k_mean: CudaSlice<f32>,
    v_rows: CudaSlice<f32>,
    v_mean: CudaSlice<f32>,
}

impl CodebookCache {
    /// Uploads `caches` (one per sequence, all of one scheme, shape and codebooks) in `layout`.
    pub fn upload(
        stream: &Arc<CudaStream>,
        layout: &DeviceLayout,
        caches: &[CommVqCache],
        rope_theta: f64,
    ) -> Result<Self> {
        let first = caches
            .first()
            .ok_or_else(|| RuntimeError::InvalidInput("a batch of no sequences".into()))?;
        let (spec, kv_heads, d) = (*first.spec(), first.kv_heads(), first.head_dim());
        if (layout.kv_heads, layout.head_dim) != (kv_heads, d) {
            return Err(RuntimeError::InvalidInput(format!(
                "the layout is for {} KV heads of {}, the caches hold {kv_heads} of {d}",
                layout.kv_heads, layout.head_dim
            )));
        }
        let mut seqs: Vec<DeviceSequence> = Vec::with_capacity(caches.len());
        for c in caches {
            if *c.spec() != spec || c.kv_heads() != kv_heads || c.head_dim() != d {
                return Err(RuntimeError::InvalidInput(
                    "every sequence of a batch must share the scheme and shape".into(),
                ));
            }
            seqs.push(c.device_sequence()?);
        }
        let books: DeviceCodebooks = first.device_codebooks()?;
        // K and V share the page table: a sequence takes as many physical pages as the side that
        // needs more, the other side's blocks there stay zero.
        let pages: Vec<usize> = seqs.iter().map(|s| s.k.pages.max(s.v.pages)).collect();
        let max_pages = pages.iter().copied().max().unwrap_or(0).max(1);
        let total: usize = pages.iter().sum::<usize>().max(1);
        let mut k_pool = vec![0u8; total * kv_heads * layout.k.block_bytes];
        let mut v_pool = vec![0u8; total * kv_heads * layout.v.block_bytes];
        let mut table = vec![0i32; seqs.len() * max_pages];
        let mut base = 0usize;
        for (i, s) in seqs.iter().enumerate() {
            k_pool[base * kv_heads * layout.k.block_bytes..][..s.k.blocks.len()]
                .copy_from_slice(&s.k.blocks);
            v_pool[base * kv_heads * layout.v.block_bytes..][..s.v.blocks.len()]
                .copy_from_slice(&s.v.blocks);
            for p in 0..pages[i] {
                table[i * max_pages + p] = i32::try_from(base + p)
                    .map_err(|_| RuntimeError::InvalidInput("page index past i32".into()))?;
            }
            base += pages[i];
        }
        let concat = |f: fn(&DeviceSequence) -> &[u16]| -> Vec<u16> {
            seqs.iter().flat_map(|s| f(s).iter().copied()).collect()
        };
        // What a step reads of the cache: every page block a side holds, and the FP16 rows of
        // its sink and tail.
        let side_bytes = |side: &kvq_reference::commvq::device::SideLayout, len: usize| -> u64 {
            let blocks = side.pages(len) * kv_heads * side.block_bytes;
            let rows = if side.is_coded() {
                let r = side.regions(len);
                (r.sink().len() + r.tail().len()) * kv_heads * d * 2
            } else {
                0
            };
            (blocks + rows) as u64
        };
        let read_bytes = seqs
            .iter()
            .map(|s| side_bytes(&layout.k, s.len) + side_bytes(&layout.v, s.len))
            .sum();
        let lens: Vec<i32> = seqs
            .iter()
            .map(|s| i32::try_from(s.len).unwrap_or(i32::MAX))
            .collect();
        Ok(Self {
            spec,
            kv_heads,
            head_dim: d,
            batch: seqs.len(),
            max_pages,
            rope_theta,
            read_bytes,
            k_pool: upload(stream, &k_pool)?,
            v_pool: upload(stream, &v_pool)?,
            page_table: upload(stream, &table)?,
            seq_lens: upload(stream, &lens)?,
            k_sink: upload(stream, &concat(|s| &s.k.sink))?,
            v_sink: upload(stream, &concat(|s| &s.v.sink))?,
            k_tail: upload(stream, &concat(|s| &s.k.tail))?,
            v_tail: upload(stream, &concat(|s| &s.v.tail))?,
            k_book: upload(stream, &books.k_rope)?,
            k_rows: upload(stream, &books.k_rows_scaled)?,
            k_mean: upload(stream, &books.k_mean)?,
            v_rows: upload(stream, &books.v_rows_scaled)?,
            v_mean: upload(stream, &books.v_mean)?,
        })
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Bytes of the cache a decode step reads: the sides' page blocks and the FP16 rows of their
    /// sinks and tails (queries and outputs not counted).
    pub fn read_bytes(&self) -> u64 {
        self.read_bytes
    }

    /// Device bytes of the coded pages, the page table and the FP16 buffers (the codebooks not
    /// counted: they belong to the layer, not the sequences).
    pub fn cache_bytes(&self) -> usize {
        self.k_pool.len()
            + self.v_pool.len()
            + 4 * self.page_table.len()
            + 2 * (self.k_sink.len() + self.v_sink.len() + self.k_tail.len() + self.v_tail.len())
    }
}
