//! [`PagedKvCache`]: device buffers, the host's page book, and the steps.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use kvq_codegen::{DecodeKernels, Dtype, QuantizerForms};
use kvq_reference::footprint;
use kvq_reference::regions::TokenRegions;
use kvq_spec::{SchemeSpec, TensorQuant};

use super::append::{launch_append, AppendArgs};
use super::kernels::CacheFunctions;
use super::pages::{PageBook, SeqId, TableChanges};
use super::prefill::{
    launch_from_input, launch_prefill, max_job_values, prefill_jobs, PrefillArgs,
};
use super::sizes::CacheSizes;
use super::snapshot::SequenceSnapshot;
use crate::decode::{CacheBuffers, CacheView, DecodeKernel, DecodeScratch};
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{Input, Output};

/// How the K/V buffer a step hands in must fit its rows: exactly (the public steps: a buffer of
/// another size is a caller's mistake), or at least (kvq's own reused buffers, read from the start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rows {
    Exactly,
    AtLeast,
}

/// Sizes of a cache, fixed at creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// KV heads per sequence.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Sequence slots.
    pub max_seqs: usize,
    /// Physical pages in the pool (each holds `page` tokens of K and V for every KV head).
    pub pool_pages: usize,
    /// Longest sequence a slot can hold.
    pub max_tokens: usize,
    /// Element type of the K/V handed to prefill and append (the FP16 regions are always f16).
    pub input_dtype: Dtype,
}

/// Memory of the cache: allocated now, and what the sequences' tokens need.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryReport {
    /// Device bytes of pools, page table, FP16 buffers and lengths.
    pub allocated_bytes: usize,
    /// Pages in use / in the pool.
    pub pages_used: usize,
    /// Pages in the pool.
    pub pages_total: usize,
    /// Bytes the live sequences occupy (pages they hold + their FP16 buffers).
    pub sequence_bytes: usize,
    /// `sequence_bytes` in bits per cached K/V element.
    pub bits_per_element: f64,
}

/// Timing of the prefill page quantizers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantizeTiming {
    /// Median over the timed runs.
    pub median_us: f64,
    /// Input bytes the quantizers read.
    pub bytes_read: usize,
    /// Page-block bytes they wrote.
    pub bytes_written: usize,
}

impl QuantizeTiming {
    /// (read + written) / time, in GB/s.
    pub fn gbps(&self) -> f64 {
        (self.bytes_read + self.bytes_written) as f64 / (self.median_us * 1e3)
    }
}

/// A paged quantized KV cache for one layer.
pub struct PagedKvCache {
    spec: SchemeSpec,
    cfg: CacheConfig,
    stream: Arc<CudaStream>,
    kernels: CacheFunctions,
    book: PageBook,
    max_pages: usize,
    sizes: CacheSizes,
    buffers: CacheBuffers,
    /// Per-step slot list and prefill jobs (grown as needed).
    slots: CudaSlice<i32>,
}

fn dev(what: &str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::driver(what.to_string(), e)
}

fn alloc_zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
    what: &str,
) -> Result<CudaSlice<T>> {
    stream.alloc_zeros::<T>(n.max(1)).map_err(dev(what))
}

impl PagedKvCache {
    /// Compiles (or loads from the caches) the scheme's kernels and allocates the cache. The page
    /// quantizers take the form `KVQ_TUNE` selects (see [`choose_forms`](super::choose_forms)):
    /// the heuristic default, a stored tuning result, or one tuned now.
    pub fn new(
        jit: &Jit,
        stream: Arc<CudaStream>,
        spec: &SchemeSpec,
        cfg: CacheConfig,
    ) -> Result<Self> {
        let forms = super::forms::choose_forms(
            jit,
            &stream,
            spec,
            cfg.head_dim as u32,
            cfg.input_dtype,
            crate::tune::TunePolicy::from_env()?,
        )?;
        Self::with_forms(jit, stream, spec, cfg, forms)
    }

    /// As [`PagedKvCache::new`], with the page quantizers in the given forms (every form writes the
    /// same bytes; a form the layout does not support is an error).
    pub fn with_forms(
        jit: &Jit,
        stream: Arc<CudaStream>,
        spec: &SchemeSpec,
        cfg: CacheConfig,
        forms: QuantizerForms,
    ) -> Result<Self> {
        let sizes = CacheSizes::new(spec, &cfg)?;
        let kernels = CacheFunctions::load(jit, spec, cfg.head_dim as u32, cfg.input_dtype, forms)?;
        let book = PageBook::new(*spec, cfg.max_seqs, cfg.pool_pages, cfg.max_tokens);
        let max_pages = sizes.max_pages;
        let page_table = stream
            .clone_htod(&vec![-1i32; sizes.page_table_entries])
            .map_err(dev("allocate the page table"))?;
        let buffers = CacheBuffers {
            k_pool: alloc_zeros(&stream, sizes.k_pool_bytes, "allocate the K page pool")?,
            v_pool: alloc_zeros(&stream, sizes.v_pool_bytes, "allocate the V page pool")?,
            k_sink: alloc_zeros(&stream, sizes.k_sink_halves, "allocate K sinks")?,
            v_sink: alloc_zeros(&stream, sizes.v_sink_halves, "allocate V sinks")?,
            k_tail: alloc_zeros(&stream, sizes.k_tail_halves, "allocate K tail rings")?,
            v_tail: alloc_zeros(&stream, sizes.v_tail_halves, "allocate V tail rings")?,
            seq_lens: alloc_zeros(&stream, cfg.max_seqs, "allocate sequence lengths")?,
            page_table,
        };
        Ok(Self {
            slots: alloc_zeros(
                &stream,
                cfg.max_seqs.max(2 * max_pages),
                "allocate step lists",
            )?,
            buffers,
            spec: *spec,
            cfg,
            stream,
            kernels,
            book,
            max_pages,
            sizes,
        })
    }

    /// The forms of the page quantizers in use.
    pub fn quantizer_forms(&self) -> QuantizerForms {
        self.kernels.generated.quantizer_forms
    }

    /// The scheme every sequence is stored with.
    pub fn spec(&self) -> &SchemeSpec {
        &self.spec
    }

    /// The sizes the cache was created with.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// Tokens held for a sequence.
    pub fn len(&self, id: SeqId) -> Result<usize> {
        self.book.len(id)
    }

    /// A new, empty sequence.
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        let id = self.book.add()?;
        self.set_len(id, 0)?;
        Ok(id)
    }

    /// Frees a sequence's slot and pages.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<()> {
        self.book.remove(id)?;
        self.set_len(id, 0)?;
        let row = id.0 as usize * self.max_pages;
        let mut view = self.buffers.page_table.slice_mut(row..row + self.max_pages);
        self.stream
            .memcpy_htod(&vec![-1i32; self.max_pages], &mut view)
            .map_err(dev("clear a page-table row"))
    }

    fn set_len(&mut self, id: SeqId, len: usize) -> Result<()> {
        let at = id.0 as usize;
        let mut view = self.buffers.seq_lens.slice_mut(at..at + 1);
        self.stream
            .memcpy_htod(&[len as i32], &mut view)
            .map_err(dev("write a sequence length"))
    }

    fn write_table(&mut self, changes: &TableChanges) -> Result<()> {
        for &(slot, logical, phys) in changes {
            let at = slot * self.max_pages + logical;
            let mut view = self.buffers.page_table.slice_mut(at..at + 1);
            self.stream
                .memcpy_htod(&[phys as i32], &mut view)
                .map_err(dev("write the page table"))?;
        }
        Ok(())
    }

    fn check_tokens(&self, what: &str, x: &CudaSlice<u16>, tokens: usize) -> Result<()> {
        self.check_rows(what, x, tokens, Rows::Exactly)
    }

    fn check_rows(&self, what: &str, x: &CudaSlice<u16>, tokens: usize, fit: Rows) -> Result<()> {
        let want = tokens * self.cfg.kv_heads * self.cfg.head_dim;
        let fits = match fit {
            Rows::Exactly => x.len() == want,
            Rows::AtLeast => x.len() >= want,
        };
        if !fits {
            return Err(RuntimeError::InvalidInput(format!(
                "{what} holds {} values; [tokens {tokens}][kv_heads {}][head_dim {}] needs {want}",
                x.len(),
                self.cfg.kv_heads,
                self.cfg.head_dim
            )));
        }
        Ok(())
    }

    fn check_dtype(&self, dtype: Dtype) -> Result<()> {
        if dtype != self.cfg.input_dtype {
            return Err(RuntimeError::InvalidInput(format!(
                "K/V are {dtype} but this cache was created for {} inputs",
                self.cfg.input_dtype
            )));
        }
        Ok(())
    }

    /// Makes the step-list buffer hold at least `values` i32.
    fn reserve_list(&mut self, values: usize) -> Result<()> {
        if values > self.slots.len() {
            self.slots = alloc_zeros(&self.stream, values, "allocate a step list")?;
        }
        Ok(())
    }

    fn upload_list(&mut self, values: &[i32]) -> Result<()> {
        self.reserve_list(values.len())?;
        let mut view = self.slots.slice_mut(0..values.len());
        self.stream
            .memcpy_htod(values, &mut view)
            .map_err(dev("upload a step list"))
    }

    /// The token split of a quantized tensor at `len` tokens (as the reference's).
    fn regions(&self, tensor: &TensorQuant, len: usize) -> TokenRegions {
        TokenRegions::new(
            len,
            self.spec.sink as usize,
            self.spec.local_of(tensor) as usize,
            self.spec.page as usize,
        )
    }

    /// Bulk prefill of an empty sequence with a prompt's K and V (`[tokens][kv_heads][head_dim]`,
    /// the cache's input dtype): sink copied, every whole page quantized and packed, the rest left in
    /// the FP16 tail ring.
    pub fn prefill(
        &mut self,
        id: SeqId,
        k: &CudaSlice<u16>,
        v: &CudaSlice<u16>,
        tokens: usize,
        dtype: Dtype,
    ) -> Result<()> {
        self.prefill_packed(&[(id, tokens)], k, v, dtype)
    }

    /// Bulk prefill of several empty sequences from prompts packed back to back (`k` and `v`:
    /// `[Σ tokens][kv_heads][head_dim]`, sequence `i`'s rows after those of sequences `< i`, the
    /// layout of a batched prefill's K/V). Each tensor's pages of every sequence are quantized in
    /// one launch, so a batch keeps the whole GPU busy. All or nothing on the page pool: if the
    /// batch does not fit, no sequence changes.
    pub fn prefill_packed(
        &mut self,
        prompts: &[(SeqId, usize)],
        k: &CudaSlice<u16>,
        v: &CudaSlice<u16>,
        dtype: Dtype,
    ) -> Result<()> {
        self.prefill_rows(prompts, k, v, dtype, Rows::Exactly)
    }

    /// [`prefill_packed`](Self::prefill_packed) from `k`/`v` that hold the prompts' rows exactly
    /// or, with [`Rows::AtLeast`], as their first rows (a reused buffer).
    pub(crate) fn prefill_rows(
        &mut self,
        prompts: &[(SeqId, usize)],
        k: &CudaSlice<u16>,
        v: &CudaSlice<u16>,
        dtype: Dtype,
        fit: Rows,
    ) -> Result<()> {
        self.check_dtype(dtype)?;
        let total: usize = prompts.iter().map(|p| p.1).sum();
        self.check_rows("packed prefill K", k, total, fit)?;
        self.check_rows("packed prefill V", v, total, fit)?;
        for &(id, _) in prompts {
            if self.book.len(id)? != 0 {
                return Err(RuntimeError::InvalidInput(format!(
                    "prefill needs an empty sequence; sequence {} holds {} tokens (append instead)",
                    id.0,
                    self.book.len(id)?
                )));
            }
        }
        let growth: Vec<(SeqId, usize)> = prompts.iter().copied().filter(|p| p.1 > 0).collect();
        let changes = self.book.grow(&growth)?;
        self.write_table(&changes)?;
        let slots: Vec<(usize, usize)> = growth.iter().map(|&(id, t)| (id.0 as usize, t)).collect();
        let jobs = max_job_values(&self.spec, &slots, self.max_pages)?;
        self.reserve_list(jobs)?;
        let a = PrefillArgs {
            cache: self
                .buffers
                .writable(self.cfg.kv_heads, self.cfg.head_dim, self.max_pages),
            k: Input::Slice(k),
            v: Input::Slice(v),
            prompts: &slots,
            jobs: Output::Slice(&mut self.slots),
        };
        // SAFETY: this cache's buffers, sized by CacheSizes; `k`/`v` hold the prompts' rows
        // (checked above), the job list was reserved for them, and the book put every page the
        // prompts fill into the page table.
        unsafe { launch_prefill(&self.stream, &self.kernels, &self.spec, a) }
    }

    /// Times the page quantizers of a packed prefill (as [`PagedKvCache::prefill_packed`] launches
    /// them: one launch per tensor for the whole batch) on sequences already prefilled from the same
    /// `k`/`v`. Median µs over `runs` CUDA-event timed repetitions, with bytes read and written.
    pub fn time_packed_prefill_quantizers(
        &mut self,
        prompts: &[(SeqId, usize)],
        k: &CudaSlice<u16>,
        v: &CudaSlice<u16>,
        runs: usize,
    ) -> Result<QuantizeTiming> {
        let total: usize = prompts.iter().map(|p| p.1).sum();
        self.check_tokens("packed prefill K", k, total)?;
        self.check_tokens("packed prefill V", v, total)?;
        let (h, d) = (self.cfg.kv_heads, self.cfg.head_dim);
        let (mut read, mut written) = (0usize, 0usize);
        let mut launches = Vec::new();
        for &(id, tokens) in prompts {
            if self.book.len(id)? != tokens {
                return Err(RuntimeError::InvalidInput(format!(
                    "sequence {} was not prefilled with {tokens} tokens",
                    id.0
                )));
            }
        }
        for (which, tensor) in [(Tensor::K, self.spec.k), (Tensor::V, self.spec.v)] {
            let slots: Vec<(usize, usize)> =
                prompts.iter().map(|&(id, t)| (id.0 as usize, t)).collect();
            let list = prefill_jobs(&self.spec, &tensor, &slots, self.max_pages)?;
            if list.is_empty() {
                continue;
            }
            let pages = list.len() / 2;
            read += pages * self.spec.page as usize * h * d * 2;
            written += pages
                * h
                * match which {
                    Tensor::K => self.sizes.k_block_bytes,
                    Tensor::V => self.sizes.v_block_bytes,
                };
            let dev_list = self
                .stream
                .clone_htod(&list)
                .map_err(dev("upload prefill jobs"))?;
            launches.push((which, pages, dev_list));
        }
        let stream = self.stream.clone();
        let timer = crate::timing::GpuTimer::back_to_back();
        let timing = timer.time::<_, RuntimeError>(&stream, 2, runs, |s| {
            for (which, pages, list) in &launches {
                let (q, pool, x) = match which {
                    Tensor::K => (self.kernels.k.as_ref(), &mut self.buffers.k_pool, k),
                    Tensor::V => (self.kernels.v.as_ref(), &mut self.buffers.v_pool, v),
                };
                // SAFETY: the lists name pages of these prompts, which the book holds.
                unsafe {
                    launch_from_input(
                        s,
                        q,
                        Output::Slice(pool),
                        Input::Slice(x),
                        Input::Slice(list),
                        Input::Slice(&self.buffers.page_table),
                        *pages,
                        h as u32,
                    )?
                };
            }
            Ok(())
        })?;
        Ok(QuantizeTiming {
            median_us: timing.median_us(),
            bytes_read: read,
            bytes_written: written,
        })
    }

    /// Appends one token's K and V (`[n][kv_heads][head_dim]`, row i for `ids[i]`) to each listed
    /// sequence; a sequence whose tail then holds `local + page` tokens quantizes its oldest page.
    pub fn append(
        &mut self,
        ids: &[SeqId],
        k: &CudaSlice<u16>,
        v: &CudaSlice<u16>,
        dtype: Dtype,
    ) -> Result<()> {
        self.append_rows(ids, k, v, dtype, Rows::Exactly)
    }

    /// [`append`](Self::append) from `k`/`v` that hold the step's rows exactly or, with
    /// [`Rows::AtLeast`], as their first rows (a reused buffer).
    pub(crate) fn append_rows(
        &mut self,
        ids: &[SeqId],
        k: &CudaSlice<u16>,
        v: &CudaSlice<u16>,
        dtype: Dtype,
        fit: Rows,
    ) -> Result<()> {
        self.check_dtype(dtype)?;
        if ids.is_empty() {
            return Ok(());
        }
        self.check_rows("append K", k, ids.len(), fit)?;
        self.check_rows("append V", v, ids.len(), fit)?;
        let growth = ids
            .iter()
            .map(|&id| Ok((id, self.book.len(id)? + 1)))
            .collect::<Result<Vec<_>>>()?;
        let changes = self.book.grow(&growth)?;
        self.write_table(&changes)?;
        let slots: Vec<i32> = ids.iter().map(|id| id.0 as i32).collect();
        self.upload_list(&slots)?;
        let a = AppendArgs {
            cache: self
                .buffers
                .writable(self.cfg.kv_heads, self.cfg.head_dim, self.max_pages),
            slots: Input::Slice(&self.slots),
            n: ids.len(),
            k_new: Input::Slice(k),
            v_new: Input::Slice(v),
            stride: 1,
        };
        // SAFETY: the buffers are this cache's, sized by CacheSizes; `k`/`v` were checked to hold
        // `ids.len()` rows, the slot list holds them, and the book put every page the step can
        // complete into the page table above.
        unsafe { launch_append(&self.stream, &self.kernels, a) }
    }

    /// The device buffers for the decode kernels: every slot is a row of the batch (`q`/`out` are
    /// `[max_seqs][kv_heads·gqa][head_dim]`; empty slots produce zeros).
    pub fn view(&self) -> CacheView<'_> {
        self.buffers.view(
            &self.spec,
            self.cfg.max_seqs,
            self.cfg.kv_heads,
            self.cfg.head_dim,
            self.max_pages,
        )
    }

    /// Decode attention for every slot (see [`view`](Self::view)).
    pub fn attend(
        &self,
        kernel: &DecodeKernel,
        q: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        scratch: &mut DecodeScratch,
    ) -> Result<()> {
        kernel.attend(&self.stream, self.view(), q, out, scratch)
    }

    /// Longest sequence held (for split heuristics).
    pub fn max_len(&self) -> usize {
        (0..self.cfg.max_seqs)
            .filter_map(|s| self.book.len(SeqId(s as u32)).ok())
            .max()
            .unwrap_or(0)
    }

    /// Copies one sequence's device state back (tests, debugging).
    pub fn snapshot(&self, id: SeqId) -> Result<SequenceSnapshot> {
        let len = self.book.len(id)?;
        let h = self.cfg.kv_heads;
        let slot = id.0 as usize;
        let k_block = self.sizes.k_block_bytes * h;
        let v_block = self.sizes.v_block_bytes * h;
        let down_u8 = |pool: &CudaSlice<u8>, block: usize, page: u32| -> Result<Vec<u8>> {
            let at = page as usize * block;
            self.stream
                .clone_dtoh(&pool.slice(at..at + block))
                .map_err(dev("download a page"))
        };
        let pages = self.book.pages(id)?;
        let mut k_pages = Vec::new();
        let mut v_pages = Vec::new();
        let regions = |t: &TensorQuant| match t {
            TensorQuant::Fp16 => len.div_ceil(self.spec.page as usize),
            _ => self.regions(t, len).pages,
        };
        for &p in &pages[..regions(&self.spec.k)] {
            k_pages.push(down_u8(&self.buffers.k_pool, k_block, p)?);
        }
        for &p in &pages[..regions(&self.spec.v)] {
            v_pages.push(down_u8(&self.buffers.v_pool, v_block, p)?);
        }
        let down_u16 = |buf: &CudaSlice<u16>, per_slot: usize| -> Result<Vec<u16>> {
            if per_slot == 0 {
                return Ok(Vec::new());
            }
            let at = slot * per_slot;
            self.stream
                .clone_dtoh(&buf.slice(at..at + per_slot))
                .map_err(dev("download FP16 buffers"))
        };
        let per_slot = |halves: usize| halves / self.cfg.max_seqs;
        Ok(SequenceSnapshot {
            len,
            k_pages,
            v_pages,
            k_sink: down_u16(&self.buffers.k_sink, per_slot(self.sizes.k_sink_halves))?,
            v_sink: down_u16(&self.buffers.v_sink, per_slot(self.sizes.v_sink_halves))?,
            k_tail: down_u16(&self.buffers.k_tail, per_slot(self.sizes.k_tail_halves))?,
            v_tail: down_u16(&self.buffers.v_tail, per_slot(self.sizes.v_tail_halves))?,
        })
    }

    /// Allocated memory and what the live sequences occupy.
    pub fn memory(&self) -> Result<MemoryReport> {
        let (h, d) = (self.cfg.kv_heads, self.cfg.head_dim);
        let page_bytes = self.sizes.page_bytes(h);
        let fp16_per_seq = self.sizes.fp16_state_bytes() / self.cfg.max_seqs;
        let mut pages_used = 0;
        let mut elements = 0usize;
        let mut live = 0;
        for s in 0..self.cfg.max_seqs {
            if let Ok(len) = self.book.len(SeqId(s as u32)) {
                pages_used += self.book.pages(SeqId(s as u32))?.len();
                elements += 2 * len * h * d;
                live += 1;
            }
        }
        let sequence_bytes = pages_used * page_bytes + live * fp16_per_seq;
        let allocated_bytes = self.sizes.k_pool_bytes
            + self.sizes.v_pool_bytes
            + 4 * self.sizes.page_table_entries
            + self.sizes.fp16_state_bytes()
            + 4 * self.cfg.max_seqs;
        Ok(MemoryReport {
            allocated_bytes,
            pages_used,
            pages_total: self.book.total_pages(),
            sequence_bytes,
            bits_per_element: if elements == 0 {
                0.0
            } else {
                8.0 * sequence_bytes as f64 / elements as f64
            },
        })
    }

    /// The reference's exact footprint of one sequence of `len` tokens (same accounting).
    pub fn footprint(&self, len: usize) -> Result<footprint::Footprint> {
        footprint::scheme(
            &self.spec,
            self.cfg.head_dim as u32,
            self.cfg.kv_heads as u32,
            len as u64,
        )
        .map_err(|e| RuntimeError::InvalidInput(e.to_string()))
    }

    /// The decode kernels' metadata this cache is laid out for.
    pub fn matches(&self, kernels: &DecodeKernels) -> bool {
        kernels.scheme == self.spec.to_string()
            && kernels.shape.head_dim as usize == self.cfg.head_dim
    }
}

/// Which of the two cached tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tensor {
    K,
    V,
}
