//! A codebook scheme's steps on an engine's own memory ([`CodebookSteps`]): prompts into empty
//! sequence slots, one new token a sequence (lengths read on the device, so a CUDA graph can
//! capture it) and the fused decode with its combine, all on raw device pointers
//! ([`CodebookPtrs`]) in the layouts [`super::CodebookSizes`] gives. The encoders write what
//! [`super::CodebookEncoder`] writes, bit for bit: the same kernels' device functions.

use super::buffers::CodebookBufferLayout;
use super::decode::CodebookKernel;
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{launch_err, unit_source, Args};
use crate::nvrtc::CompileOptions;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};
use kvq_codegen::{
    codebook_encode_kernels, CodebookEncodeKernels, KernelEntry, KernelShape, CODEBOOK_STATUS_WORDS,
};
use kvq_reference::commvq::device::{DeviceLayout, SideKind, SideLayout};
use kvq_spec::SchemeSpec;
use std::sync::Arc;

/// An engine cache of a codebook scheme: device pointers of its buffers, each allocated as
/// [`super::CodebookSizes`] says, and the plan's values the kernels take.
#[derive(Debug, Clone, Copy)]
pub struct CodebookPtrs {
    /// Columns of the page table.
    pub max_pages: usize,
    /// RoPE base the decode rotates RoPE-commutative codes with.
    pub rope_theta: f64,
    /// `[pool page][kv_head][k block]` bytes.
    pub k_pool: u64,
    /// `[pool page][kv_head][v block]` bytes.
    pub v_pool: u64,
    /// `[slot][max_pages]` i32: each logical page's pool page.
    pub page_table: u64,
    /// `[slot][kv_head][sink][D]` f16.
    pub k_sink: u64,
    /// As `k_sink`, for V.
    pub v_sink: u64,
    /// `[slot][kv_head][tail ring][D]` f16.
    pub k_tail: u64,
    /// As `k_tail`, for V.
    pub v_tail: u64,
    /// `[slot]` i32 tokens.
    pub seq_lens: u64,
    /// `[slot][kv_head][tail ring][D]` inputs of K tokens not yet coded (before RoPE for RoPE keys).
    pub k_pending: u64,
    /// As `k_pending`, for V.
    pub v_pending: u64,
    /// `[slot][CODEBOOK_STATUS_WORDS]` u32, zero while clean.
    pub status: u64,
    /// The layer's codebook buffer ([`CodebookBufferLayout`]).
    pub codebooks: u64,
}

/// New keys and values of a step, `[token][kv_head][head_dim]` in the plan's 16-bit format.
#[derive(Debug, Clone, Copy)]
pub struct StepInputs {
    /// Keys before RoPE (read only when keys are RoPE-coded; 0 otherwise).
    pub k_pre_rope: u64,
    /// Keys as the model attends to them (after RoPE).
    pub k: u64,
    /// Values.
    pub v: u64,
}

/// One coded side's kernels.
struct SideKernels {
    chunk: CudaFunction,
    chunk_entry: KernelEntry,
    step: CudaFunction,
    step_entry: KernelEntry,
}

/// A codebook scheme's cache-filling and decode kernels for one shape, on engine memory.
pub struct CodebookSteps {
    encode: CodebookEncodeKernels,
    buffer: CodebookBufferLayout,
    kv_heads: usize,
    store: CudaFunction,
    step_store: CudaFunction,
    commit: CudaFunction,
    set_length: CudaFunction,
    k: Option<SideKernels>,
    v: Option<SideKernels>,
    /// The decode and combine.
    pub decode: CodebookKernel,
}

fn narrow(what: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| RuntimeError::InvalidInput(format!("{what} {x} past i32")))
}

fn is_rope(side: &SideLayout) -> bool {
    matches!(side.kind, SideKind::Rope { .. })
}

impl CodebookSteps {
    /// Generates, compiles (through the JIT's caches) and loads the kernels of `spec` for `shape`
    /// over `kv_heads` KV heads (the decode with its default launch shape).
    pub fn load(
        jit: &Jit,
        spec: &SchemeSpec,
        shape: &KernelShape,
        kv_heads: usize,
    ) -> Result<Self> {
        let decode = CodebookKernel::load(jit, spec, shape, kv_heads)?;
        let encode = codebook_encode_kernels(
            spec,
            shape.head_dim,
            shape.dtype,
            narrow("KV heads", kv_heads)? as u32,
        )?;
        let st = &encode.steps;
        let mut names = vec![
            encode.store.name.as_str(),
            st.store.name.as_str(),
            st.commit.name.as_str(),
            st.set_length.name.as_str(),
        ];
        for (chunk, step) in [
            (&encode.encode_k, &st.encode_k),
            (&encode.encode_v, &st.encode_v),
        ] {
            if let (Some(c), Some(s)) = (chunk, step) {
                names.push(c.name.as_str());
                names.push(s.name.as_str());
            }
        }
        let source = unit_source(&encode.store.name, &encode.source);
        let mut functions = jit
            .functions(&source, &names, &CompileOptions::default())?
            .into_iter();
        let mut next = || {
            functions.next().ok_or_else(|| {
                RuntimeError::InvalidInput("kernel list shorter than requested".into())
            })
        };
        let (store, step_store, commit, set_length) = (next()?, next()?, next()?, next()?);
        let mut side = |chunk: &Option<KernelEntry>, step: &Option<KernelEntry>| -> Result<_> {
            Ok(match (chunk, step) {
                (Some(c), Some(s)) => Some(SideKernels {
                    chunk: next()?,
                    chunk_entry: c.clone(),
                    step: next()?,
                    step_entry: s.clone(),
                }),
                _ => None,
            })
        };
        let k = side(&encode.encode_k, &st.encode_k)?;
        let v = side(&encode.encode_v, &st.encode_v)?;
        Ok(Self {
            buffer: CodebookBufferLayout::new(&encode.layout),
            encode,
            kv_heads,
            store,
            step_store,
            commit,
            set_length,
            k,
            v,
            decode,
        })
    }

    /// The device layout the kernels read and write.
    pub fn layout(&self) -> &DeviceLayout {
        &self.encode.layout
    }

    /// The generated cache-filling kernels.
    pub fn generated(&self) -> &CodebookEncodeKernels {
        &self.encode
    }

    fn status_of(p: &CodebookPtrs, slot: usize) -> u64 {
        p.status + (4 * CODEBOOK_STATUS_WORDS * slot) as u64
    }

    /// Section `i`'s address in the codebook buffer.
    fn section(&self, p: &CodebookPtrs, i: usize) -> u64 {
        p.codebooks + self.buffer.offsets[i] as u64
    }

    fn set_length(
        &self,
        stream: &Arc<CudaStream>,
        p: &CodebookPtrs,
        slot: usize,
        len: usize,
        begin: bool,
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = Args::new(stream);
        args.int(narrow("slot", slot)?)
            .int(narrow("tokens", len)?)
            .int(begin as i32)
            .ptr(p.seq_lens)
            .ptr(p.status);
        // SAFETY: the entry's params; the caller vouches for the buffers (slot within max_seqs).
        unsafe { args.launch(&self.set_length, cfg, false) }
            .map_err(launch_err(&self.encode.steps.set_length.name))
    }

    /// Fills empty slots with prompts: prompt `i` (`prompts[i] = (slot, tokens)`) is rows
    /// `Σ_{j<i} tokens_j …` of `inputs`. Each slot is emptied first (length 0, status clean), its
    /// rows stored, its pages coded straight from the inputs, and its length set to the prompt's
    /// if the encoders found nothing wrong (otherwise the slot's status says what, and it stays
    /// empty). Asynchronous on `stream`.
    ///
    /// # Safety
    /// Every pointer is device memory of `stream`'s context of the sizes
    /// [`super::CodebookSizes`] gives for limits the slots and lengths respect (checked by the
    /// caller), the inputs hold every prompt's rows, and the page table rows of these slots name
    /// pool pages for every page the prompts fill.
    pub unsafe fn prefill_raw(
        &self,
        stream: &Arc<CudaStream>,
        p: &CodebookPtrs,
        prompts: &[(usize, usize)],
        inputs: &StepInputs,
    ) -> Result<()> {
        let layout = *self.layout();
        let (h, d) = (self.kv_heads, layout.head_dim);
        let mut row = 0usize;
        for &(slot, n) in prompts {
            self.set_length(stream, p, slot, 0, true)?;
            if n == 0 {
                continue;
            }
            let status = Self::status_of(p, slot);
            let ring_from = |side: &SideLayout| -> Result<i32> {
                let r = side.regions(n);
                narrow("token", r.sink_end + r.pages * side.page)
            };
            let cfg = LaunchConfig {
                grid_dim: (narrow("tokens", n)? as u32, h as u32, 1),
                block_dim: (self.encode.store.block, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut args = Args::new(stream);
            args.ptr(inputs.k_pre_rope)
                .ptr(inputs.k)
                .ptr(inputs.v)
                .int(narrow("row", row)?)
                .int(0)
                .int(ring_from(&layout.k)?)
                .int(ring_from(&layout.v)?)
                .int(narrow("slot", slot)?)
                .ptr(p.k_pool)
                .ptr(p.v_pool)
                .ptr(p.page_table)
                .int(narrow("pages", p.max_pages)?)
                .ptr(p.k_sink)
                .ptr(p.v_sink)
                .ptr(p.k_tail)
                .ptr(p.v_tail)
                .ptr(p.k_pending)
                .ptr(p.v_pending)
                .ptr(status);
            // SAFETY: the store entry's params; the caller vouches for the buffers.
            unsafe { args.launch(&self.store, cfg, false) }
                .map_err(launch_err(&self.encode.store.name))?;
            for (side, kernels, first_table) in [
                (&layout.k, self.k.as_ref(), 5),
                (&layout.v, self.v.as_ref(), 10),
            ] {
                let (Some(kernels), pages) = (kernels, side.pages(n)) else {
                    continue;
                };
                if pages == 0 {
                    continue;
                }
                let src = match (std::ptr::eq(side, &layout.k), is_rope(side)) {
                    (true, true) => inputs.k_pre_rope,
                    (true, false) => inputs.k,
                    (false, _) => inputs.v,
                };
                let cfg = LaunchConfig {
                    grid_dim: (narrow("pages", pages)? as u32, h as u32, 1),
                    block_dim: (kernels.chunk_entry.block, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut args = Args::new(stream);
                args.ptr(src + 2 * (row * h * d) as u64)
                    .int(narrow("row stride", h * d)?)
                    .int(narrow("head stride", d)?)
                    .int(narrow("first row", side.sink.min(n))?)
                    .int(0)
                    .int(0)
                    .int(narrow("slot", slot)?)
                    .ptr(if std::ptr::eq(side, &layout.k) {
                        p.k_pool
                    } else {
                        p.v_pool
                    })
                    .ptr(p.page_table)
                    .int(narrow("pages", p.max_pages)?);
                for t in 0..5 {
                    args.ptr(self.section(p, first_table + t));
                }
                args.ptr(status);
                // SAFETY: the encoder entry's params; the caller vouches for the buffers.
                unsafe { args.launch(&kernels.chunk, cfg, false) }
                    .map_err(launch_err(&kernels.chunk_entry.name))?;
            }
            self.set_length(stream, p, slot, n, false)?;
            row += n;
        }
        Ok(())
    }

    /// Appends one token to each of `n` sequences: row `i` of `inputs` to the slot `slots[i]`
    /// names (`slots`: `n` device i32, distinct; −1 skips the row), at the slot's length; a page
    /// the token closes is coded from the slot's pending ring; then each slot whose status stayed
    /// clean grows by one. No host synchronisation: capturable in a CUDA graph.
    ///
    /// # Safety
    /// As [`Self::prefill_raw`]; `slots` holds `n` device i32, each −1 or a slot whose page-table
    /// row names the page its token completes.
    pub unsafe fn append_raw(
        &self,
        stream: &Arc<CudaStream>,
        p: &CodebookPtrs,
        n: usize,
        slots: u64,
        inputs: &StepInputs,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let grid = (narrow("sequences", n)? as u32, self.kv_heads as u32, 1);
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (self.encode.steps.store.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = Args::new(stream);
        args.ptr(inputs.k_pre_rope)
            .ptr(inputs.k)
            .ptr(inputs.v)
            .ptr(slots)
            .ptr(p.seq_lens)
            .ptr(p.k_pool)
            .ptr(p.v_pool)
            .ptr(p.page_table)
            .int(narrow("pages", p.max_pages)?)
            .ptr(p.k_sink)
            .ptr(p.v_sink)
            .ptr(p.k_tail)
            .ptr(p.v_tail)
            .ptr(p.k_pending)
            .ptr(p.v_pending)
            .ptr(p.status);
        // SAFETY: the step store entry's params; the caller vouches for the buffers.
        unsafe { args.launch(&self.step_store, cfg, false) }
            .map_err(launch_err(&self.encode.steps.store.name))?;
        for (kernels, pending, pool, first_table) in [
            (self.k.as_ref(), p.k_pending, p.k_pool, 5),
            (self.v.as_ref(), p.v_pending, p.v_pool, 10),
        ] {
            let Some(kernels) = kernels else { continue };
            let cfg = LaunchConfig {
                grid_dim: grid,
                block_dim: (kernels.step_entry.block, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut args = Args::new(stream);
            args.ptr(pending)
                .ptr(slots)
                .ptr(p.seq_lens)
                .ptr(pool)
                .ptr(p.page_table)
                .int(narrow("pages", p.max_pages)?);
            for t in 0..5 {
                args.ptr(self.section(p, first_table + t));
            }
            args.ptr(p.status);
            // SAFETY: the step encoder entry's params; the caller vouches for the buffers.
            unsafe { args.launch(&kernels.step, cfg, false) }
                .map_err(launch_err(&kernels.step_entry.name))?;
        }
        let commit = &self.encode.steps.commit;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(commit.block as usize) as u32, 1, 1),
            block_dim: (commit.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = Args::new(stream);
        args.ptr(slots)
            .int(narrow("sequences", n)?)
            .ptr(p.seq_lens)
            .ptr(p.status);
        // SAFETY: the commit entry's params.
        unsafe { args.launch(&self.commit, cfg, false) }.map_err(launch_err(&commit.name))
    }

    /// Bytes of the workspace an attend of `n` sequences in `splits` splits takes.
    pub fn workspace_bytes(&self, n: usize, splits: usize) -> usize {
        let parts = n * self.kv_heads * self.decode.generated().shape.gqa as usize * splits;
        let d = self.layout().head_dim;
        (4 * parts * d).next_multiple_of(256) + 8 * parts
    }

    /// Attention of one query token for each of `n` sequences (`q`, `out`: `[n][q_heads][D]` in
    /// the plan's format; sequence `i` in slot `slots[i]`, −1: a padding row of zeros), `lse`
    /// (0: not written) `[n][q_heads]` f32, in `splits` splits through the combine, the partials
    /// in `workspace`. Capturable in a CUDA graph.
    ///
    /// # Safety
    /// As [`Self::append_raw`]; `q`, `out`, `lse` device memory of those sizes, `workspace` at
    /// least [`Self::workspace_bytes`] bytes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_raw(
        &self,
        stream: &Arc<CudaStream>,
        p: &CodebookPtrs,
        n: usize,
        slots: u64,
        q: u64,
        out: u64,
        lse: u64,
        splits: usize,
        workspace: u64,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let parts = n * self.kv_heads * self.decode.generated().shape.gqa as usize * splits;
        let part_acc = workspace;
        let part_ml = workspace + (4 * parts * self.layout().head_dim).next_multiple_of(256) as u64;
        let books = [0, 1, 2, 3, 4].map(|i| self.section(p, i));
        // SAFETY: forwarded.
        unsafe {
            self.decode.attend_ptrs(
                stream, p, &books, n, slots, q, out, lse, splits, part_acc, part_ml,
            )
        }
    }
}

/// Waits for `stream`, reads the status words of `slots` slots at `status`, and returns each
/// flagged slot's error ([`super::status_error`]), clearing those slots' words so that they take
/// tokens again.
///
/// # Safety
/// `status` is device memory of `stream`'s context of `slots ×` [`CODEBOOK_STATUS_WORDS`] u32.
pub unsafe fn take_slot_errors(
    stream: &Arc<CudaStream>,
    status: u64,
    slots: usize,
) -> Result<Vec<(usize, RuntimeError)>> {
    let mut words = vec![0u32; slots * CODEBOOK_STATUS_WORDS];
    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut words, status, stream.cu_stream()) }
        .map_err(|e| RuntimeError::driver("read the encoders' status", e))?;
    stream
        .synchronize()
        .map_err(|e| RuntimeError::driver("wait for the encoders", e))?;
    let mut errors = Vec::new();
    let clean = [0u32; CODEBOOK_STATUS_WORDS];
    for (slot, w) in words.chunks(CODEBOOK_STATUS_WORDS).enumerate() {
        if let Some(e) = super::status_error(slot, w) {
            let at = status + (4 * CODEBOOK_STATUS_WORDS * slot) as u64;
            unsafe { cudarc::driver::result::memcpy_htod_async(at, &clean, stream.cu_stream()) }
                .map_err(|e| RuntimeError::driver("clear a slot's status", e))?;
            errors.push((slot, e));
        }
    }
    stream
        .synchronize()
        .map_err(|e| RuntimeError::driver("clear the encoders' status", e))?;
    Ok(errors)
}
